"""The P2P model-sharing protocol: a joining client asks a peer for the ticket of each blob.

Protocol `/psyche/model-sharing/0` (upstream ALPN `model-sharing/0`), one stream per request:
the requester writes `postcard(ModelRequestType)` and half-closes; the provider reads at most
1000 bytes, asks the application for a blob ticket (a `ParameterRequest` or `ModelConfigRequest`
event), writes `postcard(Result<BlobTicket, SharableModelError>)` (at most 16384 bytes) and
closes. The bytes themselves then travel as ordinary blobs; what they hold is `sharable_model`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from libp2p.abc import IHost, INetStream

from psyche.core.serde import PostcardError, from_bytes, to_bytes
from psyche.network import p2p_host
from psyche.network.events import ModelConfigRequest, NetworkEvent, ParameterRequest, TicketReply
from psyche.network.identity import fmt_short
from psyche.network.peer_manager import MODEL_REQUEST_TIMEOUT_SECS
from psyche.network.ticket import BlobTicket
from psyche.network.transmittable import (
    ModelRequestType,
    SharableModelError,
    SharableModelFailure,
    TicketResult,
)

logger = logging.getLogger(__name__)

MODEL_SHARING_PROTOCOL = "/psyche/model-sharing/0"
MAX_REQUEST_BYTES = 1000
MAX_RESPONSE_BYTES = 16384


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
    match from_bytes(data, TicketResult):
        case TicketResult.Ok(ticket):
            return ticket
        case TicketResult.Err(error):
            raise SharableModelFailure(error)
    raise PostcardError("unreachable")


# ----------------------------------------------------------------------------------------------
# Both ends of a stream


async def request_ticket(host: IHost, peer: bytes, request: ModelRequestType) -> BlobTicket:
    """Ask `peer` (already connected) for the ticket of a model config or parameter."""
    raw = await p2p_host.request(
        host, peer, MODEL_SHARING_PROTOCOL, encode_request(request), MAX_RESPONSE_BYTES
    )
    return decode_response(raw)


async def serve(
    stream: INetStream, allowed: p2p_host.AllowFn, post: Callable[[NetworkEvent], None]
) -> None:
    """Answer one inbound request: the application gets it as an event and has
    `MODEL_REQUEST_TIMEOUT_SECS` to reply (`ResponseChannelNotInitialized` otherwise)."""
    peer = await p2p_host.stream_peer(stream, allowed)
    if peer is None:
        return
    try:
        with trio.fail_after(MODEL_REQUEST_TIMEOUT_SECS):
            request = decode_request(await p2p_host.read_to_end(stream, MAX_REQUEST_BYTES))
        reply = TicketReply()
        match request:
            case ModelRequestType.Parameter(name):
                post(ParameterRequest(name, reply))
            case _:
                post(ModelConfigRequest(reply))
        result: TicketResult = TicketResult.Err(SharableModelError.ResponseChannelNotInitialized())
        with trio.move_on_after(MODEL_REQUEST_TIMEOUT_SECS):
            result = await reply.receive()
        await stream.write(encode_response(result))
        await stream.close()
    except Exception as e:  # malformed or hostile request, or the peer went away
        logger.info("dropping model-sharing request from %s: %s", fmt_short(peer), e)
        await p2p_host.reset_quietly(stream)
