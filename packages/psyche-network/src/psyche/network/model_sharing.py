"""The P2P model-sharing protocol: a joining client asks a peer for the ticket of each blob.

Protocol `/psyche/model-sharing/0` (upstream ALPN `model-sharing/0`), one stream per request:
the requester writes `postcard(ModelRequestType)` and half-closes; the provider reads at most
1000 bytes, answers it from the model the node shares (`NetworkConnection.shared_model`;
upstream asks the application through `ParameterRequest`/`ModelConfigRequest` events), writes
`postcard(Result<BlobTicket, SharableModelError>)` (at most 16384 bytes) and closes. The bytes
themselves then travel as ordinary blobs; what they hold is `sharable_model`'s.

`/psyche/model-sharing-batch/1` (a port extension) asks for many parameters in one stream, so a
joining client pays one round trip per peer instead of one per tensor: the requester writes
`postcard(Vec<String>)` (at most `MAX_BATCH_NAMES` names, `MAX_BATCH_REQUEST_BYTES`) and
half-closes; the provider answers each name as a single request (all concurrently, all from
one serving window: `answer_batch`) and writes
`postcard(ModelTickets { version: Option<u64>, results: Vec<Result<BlobTicket,
SharableModelError>> })`, one result per name in order (at most `MAX_BATCH_RESPONSE_BYTES`).
`version` names the model the tickets are of (`SharableModel.version`: the run's step the model
starts, the same on every honest provider), so that a joiner never mixes tickets of two serving
windows' models: the blobs are content-addressed, but a ticket asked again (a failed blob) or
of another peer after the next warmup began would be the newer model's. It is None when the
provider's model has no version, or when the model was replaced while the batch was answered
(its tickets are of two models). Version 0 of the protocol had no version.

`/psyche/model-sharing/1` is protocol 0 with the version in its answer: the requester writes
`postcard(ModelRequestType)` and half-closes, the provider writes `postcard(ModelTicket {
version: Option<u64>, result: Result<BlobTicket, SharableModelError> })`. A joiner asks for the
model's configuration with it (its parameter names are the download's plan), so that the
configuration is of the same model as the parameters' tickets: before, the configuration came
unversioned from whichever peer answered first. Protocol 0 stays served for upstream's
requesters.

A joiner asks both on the provider's blob side channel first (`blob_protocol`'s `GetConfig` and
`GetTickets`, answered by `SideChannelAnswers` from the same `AnswerFn`, so the answers are the
same): that session is opened and authenticated beside the libp2p dial, so the answers do not
wait behind, or compete with, the provider's set-up of the new libp2p connection (identify,
GossipSub, RTT probe, record exchange), which a cold fetch otherwise meets. Where the side
channel cannot answer (none usable, a provider older than these requests), the same request
goes over libp2p.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio
from libp2p.abc import IHost, INetStream

from psyche.core.serde import U64, PostcardError, from_bytes, struct, to_bytes
from psyche.network import p2p_host
from psyche.network.blob_protocol import ConfigFound, TicketAnswer, TicketFound, TicketsFound
from psyche.network.peer_manager import MODEL_REQUEST_TIMEOUT_SECS, not_serving_now
from psyche.network.sharable_model import noting_model_versions
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr
from psyche.network.transmittable import (
    ModelRequestType,
    SharableModelError,
    SharableModelFailure,
    TicketResult,
)

if TYPE_CHECKING:
    from psyche.network.blob_routes import BlobRoutes

MODEL_SHARING_PROTOCOL = "/psyche/model-sharing/0"
MAX_REQUEST_BYTES = 1000
MAX_RESPONSE_BYTES = 16384
MODEL_SHARING_VERSIONED_PROTOCOL = "/psyche/model-sharing/1"
MODEL_SHARING_BATCH_PROTOCOL = "/psyche/model-sharing-batch/1"
MAX_BATCH_NAMES = 256
MAX_BATCH_REQUEST_BYTES = 64 * 1024
MAX_BATCH_RESPONSE_BYTES = 1 << 20


@struct(frozen=True)
class ModelTickets:
    """A batch's answer on the wire: the version of the model its tickets are of."""

    version: U64 | None
    results: list[TicketResult]


@struct(frozen=True)
class ModelTicket:
    """A single request's answer on the versioned protocol: the version of the model its
    ticket is of."""

    version: U64 | None
    result: TicketResult


class VersionedResults(list[TicketResult]):
    """A batch's results, one per name, with the version of the model they are of
    (`ModelTickets.version`); a list, so that whoever only relays the results needs nothing
    new."""

    def __init__(self, results: list[TicketResult], version: int | None) -> None:
        super().__init__(results)
        self.version = version


def results_version(results: list[TicketResult]) -> int | None:
    """The model version a batch's results carry (None for results that carry none)."""
    return results.version if isinstance(results, VersionedResults) else None


AnswerFn = Callable[[ModelRequestType], Awaitable[TicketResult]]
"""The provider's answer to one request (`NetworkConnection._answer_model_request`)."""


def batch_timeout(names: int) -> float:
    """A batch may take the single request's 10 s plus 50 ms per name (first requests
    serialize their tensors)."""
    return MODEL_REQUEST_TIMEOUT_SECS + 0.05 * names


# ----------------------------------------------------------------------------------------------
# Wire helpers (pure)


def encode_request(request: ModelRequestType) -> bytes:
    data = to_bytes(request, ModelRequestType)
    if len(data) > MAX_REQUEST_BYTES:
        raise ValueError(f"model request of {len(data)} bytes exceeds {MAX_REQUEST_BYTES}")
    return data


def decode_request(data: bytes) -> ModelRequestType:
    return from_bytes(data, ModelRequestType)


def encode_response(result: TicketResult) -> bytes:
    return to_bytes(result, TicketResult)


def decode_response(data: bytes) -> BlobTicket:
    """The ticket, or `SharableModelFailure` for the peer's error / `PostcardError` for garbage."""
    return _ticket(from_bytes(data, TicketResult))


def encode_versioned_response(result: TicketResult, version: int | None) -> bytes:
    return to_bytes(ModelTicket(version, result))


def decode_versioned_response(data: bytes) -> tuple[BlobTicket, int | None]:
    """(the ticket, the version of the model it is of), or as `decode_response` raises."""
    answer = from_bytes(data, ModelTicket)
    return _ticket(answer.result), answer.version


def _ticket(result: TicketResult) -> BlobTicket:
    match result:
        case TicketResult.Ok(ticket):
            answered: BlobTicket = ticket
            return answered
        case TicketResult.Err(error):
            raise SharableModelFailure(error)
    raise PostcardError("unreachable")


def encode_batch_request(names: list[str]) -> bytes:
    if len(names) > MAX_BATCH_NAMES:
        raise ValueError(f"{len(names)} names in one batch; at most {MAX_BATCH_NAMES}")
    data = to_bytes(names, list[str])
    if len(data) > MAX_BATCH_REQUEST_BYTES:
        raise ValueError(f"batch request of {len(data)} bytes exceeds {MAX_BATCH_REQUEST_BYTES}")
    return data


def decode_batch_request(data: bytes) -> list[str]:
    names = from_bytes(data, list[str])
    if len(names) > MAX_BATCH_NAMES:
        raise PostcardError(f"{len(names)} names in one batch; at most {MAX_BATCH_NAMES}")
    return names


def encode_batch_response(results: list[TicketResult], version: int | None) -> bytes:
    return to_bytes(ModelTickets(version, results))


def decode_batch_response(data: bytes, names: int) -> VersionedResults:
    answer = from_bytes(data, ModelTickets)
    if len(answer.results) != names:
        raise PostcardError(f"{len(answer.results)} results for {names} names")
    return VersionedResults(answer.results, answer.version)


# ----------------------------------------------------------------------------------------------
# Both ends of a stream


async def request_ticket(
    host: IHost, peer: bytes, request: ModelRequestType
) -> tuple[BlobTicket, int | None]:
    """Ask `peer` (already connected) for the ticket of a model config or parameter and the
    version of the model it is of."""
    raw = await p2p_host.request(
        host, peer, MODEL_SHARING_VERSIONED_PROTOCOL, encode_request(request), MAX_RESPONSE_BYTES
    )
    return decode_versioned_response(raw)


async def request_tickets(host: IHost, peer: bytes, names: list[str]) -> VersionedResults:
    """Ask `peer` (already connected) for the tickets of `names`, one result per name, and the
    version of the model they are of."""
    raw = await p2p_host.request(
        host,
        peer,
        MODEL_SHARING_BATCH_PROTOCOL,
        encode_batch_request(names),
        MAX_BATCH_RESPONSE_BYTES,
    )
    return decode_batch_response(raw, len(names))


async def serve_batch(stream: INetStream, allowed: p2p_host.AllowFn, answer: AnswerFn) -> None:
    """Answer one inbound batch: every name answered concurrently, all within `batch_timeout`
    (a name left unanswered gets `ResponseChannelNotInitialized`), with the version of the
    model the tickets came from (`answer` reaches the node's `SharableModel`, whose
    `answer_request` notes the version it answered from)."""

    async def handle() -> None:
        with trio.fail_after(MODEL_REQUEST_TIMEOUT_SECS):
            names = decode_batch_request(
                await p2p_host.read_to_end(stream, MAX_BATCH_REQUEST_BYTES)
            )
        results, version = await answer_batch(answer, names)
        response = encode_batch_response(results, version)
        if len(response) > MAX_BATCH_RESPONSE_BYTES:
            raise ValueError(f"batch response of {len(response)} bytes")
        await stream.write(response)
        await stream.close()

    await p2p_host.serve_member(stream, allowed, "model-sharing batch", handle)


async def serve(stream: INetStream, allowed: p2p_host.AllowFn, answer: AnswerFn) -> None:
    """Answer one inbound request within `MODEL_REQUEST_TIMEOUT_SECS`
    (`ResponseChannelNotInitialized` otherwise)."""
    await _serve_one(stream, allowed, answer, lambda result, _: encode_response(result))


async def serve_versioned(stream: INetStream, allowed: p2p_host.AllowFn, answer: AnswerFn) -> None:
    """`serve`, with the version of the model the ticket came from in the answer (None when
    the answer is an error)."""
    await _serve_one(stream, allowed, answer, encode_versioned_response)


async def answer_versioned(
    answer: AnswerFn, request: ModelRequestType
) -> tuple[TicketResult, int | None]:
    """`answer(request)` within `MODEL_REQUEST_TIMEOUT_SECS` (`ResponseChannelNotInitialized`
    otherwise) and the version of the model it came from (None when it names none)."""
    result: TicketResult = TicketResult.Err(SharableModelError.ResponseChannelNotInitialized())
    with noting_model_versions() as versions, trio.move_on_after(MODEL_REQUEST_TIMEOUT_SECS):
        result = await answer(request)
    return result, next(iter(versions)) if len(versions) == 1 else None


async def answer_batch(answer: AnswerFn, names: list[str]) -> tuple[list[TicketResult], int | None]:
    """Every name answered concurrently, all within `batch_timeout` (a name left unanswered
    gets `ResponseChannelNotInitialized`), and the version of the model the tickets came from
    (None unless exactly one).

    The batch is answered from one serving window (`SharableModel.generation`): either every
    ticket is of the one model served throughout, or every name is answered "not serving now".
    A window that closed (or opened) while the names were looked up would otherwise give some
    names tickets and others "not serving now", and a joiner could not tell an opening window
    (the tickets are of the model it wants) from a closing one (they are of the last model,
    and the rest will come from the next)."""
    unanswered = TicketResult.Err(SharableModelError.ResponseChannelNotInitialized())
    results: list[TicketResult] = [unanswered] * len(names)

    async def answer_one(index: int, name: str) -> None:
        results[index] = await answer(ModelRequestType.Parameter(name))

    with noting_model_versions() as versions, trio.move_on_after(batch_timeout(len(names))):
        async with trio.open_nursery() as nursery:
            for index, name in enumerate(names):
                nursery.start_soon(answer_one, index, name)
    served = any(isinstance(r, TicketResult.Ok) for r in results)
    stopped = any(isinstance(r, TicketResult.Err) and not_serving_now(r.value) for r in results)
    if served and (stopped or len(versions.generations) > 1):
        not_serving: TicketResult = TicketResult.Err(SharableModelError.ParametersNotInitialized())
        return [not_serving] * len(names), None
    return results, next(iter(versions)) if len(versions) == 1 else None


# ----------------------------------------------------------------------------------------------
# The same requests on the blob side channel (`blob_protocol`'s `GetConfig` and `GetTickets`)


class SideChannelAnswers:
    """A provider's answers to `GetConfig` and `GetTickets` (`blob_protocol.ModelAnswers`),
    the same as `/psyche/model-sharing/1` and `/psyche/model-sharing-batch/1` give."""

    def __init__(self, answer: AnswerFn) -> None:
        self._answer = answer

    async def config(self) -> ConfigFound | None:
        """None when there is no configuration to serve now (libp2p's request says why)."""
        result, version = await answer_versioned(self._answer, ModelRequestType.Config())
        if not isinstance(result, TicketResult.Ok):
            return None
        return ConfigFound(version, result.value.hash, result.value.size)

    async def tickets(self, names: list[str]) -> TicketsFound:
        results, version = await answer_batch(self._answer, names)
        return TicketsFound(version, [_side_ticket(result) for result in results])


def _side_ticket(result: TicketResult) -> TicketAnswer:
    answer: TicketAnswer
    match result:
        case TicketResult.Ok(ticket):
            answer = TicketAnswer.Ok(TicketFound(ticket.hash, ticket.size))
        case TicketResult.Err(error):
            answer = TicketAnswer.Err(error)
    return answer


async def config_on_side_channel(
    routes: BlobRoutes, provider: EndpointAddr | None
) -> tuple[BlobTicket, int | None] | None:
    """`request_ticket`'s answer for the configuration, asked on the blob side channel
    (`BlobRoutes.ask`); None when the side channel cannot answer it (none usable, an older
    provider, or no configuration served now: libp2p's request says why)."""
    if provider is None:
        return None
    found = await routes.ask(provider, lambda session: session.config(MODEL_REQUEST_TIMEOUT_SECS))
    if found is None:
        return None
    return BlobTicket(provider, BlobFormat.Raw, found.hash, found.size), found.version


async def tickets_on_side_channel(
    routes: BlobRoutes, provider: EndpointAddr | None, names: list[str]
) -> VersionedResults | None:
    """`request_tickets`'s answer, asked on the blob side channel (`BlobRoutes.ask`), one
    result per name (a name's error as libp2p gives it); None when the side channel cannot
    answer (none usable, an older provider, a broken session)."""
    if provider is None:
        return None
    found = await routes.ask(
        provider, lambda session: session.tickets(names, batch_timeout(len(names)))
    )
    if found is None:
        return None
    results: list[TicketResult] = []
    for answer in found.answers:
        match answer:
            case TicketAnswer.Ok(ticket):
                results.append(
                    TicketResult.Ok(BlobTicket(provider, BlobFormat.Raw, ticket.hash, ticket.size))
                )
            case TicketAnswer.Err(error):
                results.append(TicketResult.Err(error))
    return VersionedResults(results, found.version)


async def _serve_one(
    stream: INetStream,
    allowed: p2p_host.AllowFn,
    answer: AnswerFn,
    encode: Callable[[TicketResult, int | None], bytes],
) -> None:
    async def handle() -> None:
        with trio.fail_after(MODEL_REQUEST_TIMEOUT_SECS):
            request = decode_request(await p2p_host.read_to_end(stream, MAX_REQUEST_BYTES))
        await stream.write(encode(*await answer_versioned(answer, request)))
        await stream.close()

    await p2p_host.serve_member(stream, allowed, "model-sharing request", handle)
