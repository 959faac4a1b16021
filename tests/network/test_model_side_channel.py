"""The model configuration and ticket batches asked on the blob side channel (`GetConfig`,
`GetTickets`): a joiner gets them from real nodes on loopback without waiting for a libp2p
connection, with the version of their model and each name's own error; a stranger is refused
before its request is read; a member's oversized, garbage or stalled control frames end its
session with every slot released; an older provider (neither request) or a provider without a
usable side channel is asked over libp2p instead."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import pytest
import torch
import trio

from psyche.core.identity import SecretKey
from psyche.modeling.sharing import TENSOR_CODEC, model_hash
from psyche.network import blob_protocol, model_sharing
from psyche.network.blob_protocol import (
    MAX_CONTROL_FRAME,
    MAX_REQUEST_FRAME,
    MAX_TICKETS_NAMES,
    BlobRefused,
    BlobSession,
    ConfigFound,
    GetTickets,
    Reply,
    StreamClosed,
    TicketAnswer,
    TicketFound,
    TicketsFound,
)
from psyche.network.blob_routes import OLDER_PROVIDER_SECS, SIDE_CHANNEL, BlobRoutes
from psyche.network.blob_transport import BlobServer, TcpBlobTransport
from psyche.network.connection import NetworkConnection
from psyche.network.download import DownloadFailed
from psyche.network.model_download import ModelDownload
from psyche.network.peer_manager import PeerManager
from psyche.network.secure_channel import PeerRefused
from psyche.network.stats import PeerBandwidth
from psyche.network.testing import open_nodes, serve_model
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr, blob_hash
from psyche.network.transmittable import (
    DownloadType,
    ModelRequestType,
    SharableModelError,
    TicketResult,
    TransmittableModelConfig,
)

from .model_providers import (
    CONFIG_JSON,
    TOKENIZER_JSON,
    introduce_all,
    make_parameters,
    provider_model,
    without_side_channel,
)

CONFIG = ModelRequestType.Config()
VERSION = 20


def _count_libp2p_ticket_requests(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The peers asked for tickets over libp2p (`/psyche/model-sharing/1` and
    `/psyche/model-sharing-batch/1`)."""
    asked: list[bytes] = []
    request, batch = model_sharing.request_ticket, model_sharing.request_tickets

    async def counting(host, peer, request_type):  # type: ignore[no-untyped-def]
        asked.append(peer)
        return await request(host, peer, request_type)

    async def counting_batch(host, peer, names):  # type: ignore[no-untyped-def]
        asked.append(peer)
        return await batch(host, peer, names)

    monkeypatch.setattr(model_sharing, "request_ticket", counting)
    monkeypatch.setattr(model_sharing, "request_tickets", counting_batch)
    return asked


class _Counting:
    """A provider's side-channel answers, recorded (`ModelAnswers`)."""

    def __init__(self, inner: blob_protocol.ModelAnswers) -> None:
        self.inner = inner
        self.configs: list[ConfigFound | None] = []
        self.names: list[list[str]] = []

    async def config(self) -> ConfigFound | None:
        found = await self.inner.config()
        self.configs.append(found)
        return found

    async def tickets(self, names: list[str]) -> TicketsFound:
        self.names.append(names)
        return await self.inner.tickets(names)


def _count_config_answers(provider: NetworkConnection) -> list[ConfigFound | None]:
    """What `provider`'s blob server answered to each `GetConfig`."""
    return _count_answers(provider).configs


def _count_answers(provider: NetworkConnection) -> _Counting:
    inner = provider.blob_server.model_answers
    assert inner is not None
    counting = _Counting(inner)
    provider.blob_server.model_answers = counting
    return counting


def _versioned_model(parameters):  # type: ignore[no-untyped-def]
    model = provider_model(parameters)
    model.update_parameters(parameters, VERSION)
    model.update_config(CONFIG_JSON, TOKENIZER_JSON)
    return model


@contextlib.asynccontextmanager
async def _serving(
    parameters: dict[str, torch.Tensor],
) -> AsyncIterator[tuple[NetworkConnection, NetworkConnection]]:
    """A provider serving a model of `parameters` at `VERSION`, and a joiner that has its
    address (no libp2p connection between them yet)."""
    async with (
        open_nodes(2, model_codec=TENSOR_CODEC) as (provider, joiner),
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(serve_model, provider, _versioned_model(parameters))
        await introduce_all(joiner, [provider])
        yield provider, joiner
        nursery.cancel_scope.cancel()


def test_the_joiner_gets_the_configuration_on_the_side_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The configuration's ticket, with its model's version, comes on the side channel while no
    libp2p connection joins the two nodes (none is made for it); its bytes come by the same
    session. A whole download asks no ticket over libp2p (configuration or batch) and ends with
    the providers' model. Before, both were asked over libp2p only (after the joiner's dial)."""
    parameters = make_parameters(3)
    asked = _count_libp2p_ticket_requests(monkeypatch)

    async def main() -> None:
        async with (
            open_nodes(3, model_codec=TENSOR_CODEC) as (provider, other, joiner),
            trio.open_nursery() as nursery,
        ):
            for node in (provider, other):
                nursery.start_soon(serve_model, node, _versioned_model(parameters))
            await introduce_all(joiner, [provider, other])
            answers = _count_config_answers(provider)
            with trio.fail_after(30):
                ticket, version = await joiner.request_model_blob_ticket(
                    provider.endpoint_id, CONFIG
                )
                assert version == VERSION
                assert provider.endpoint_id not in joiner.connection_monitor.connected_peers()
                download = joiner.start_download(
                    ticket, "config", DownloadType.ModelSharing(CONFIG)
                )
                outcome = await download.finished()
            assert isinstance(outcome.data, TransmittableModelConfig)  # type: ignore[union-attr]
            assert outcome.data.config == CONFIG_JSON  # type: ignore[union-attr]
            assert joiner.blob_routes.routes[provider.endpoint_id] == SIDE_CHANNEL
            assert [a.version for a in answers if a is not None] == [VERSION]
            assert asked == []

            batches = _count_answers(other).names
            with trio.fail_after(60):
                model = await ModelDownload(
                    joiner, [provider.endpoint_id, other.endpoint_id], expected_version=VERSION
                ).run()
            assert model.config.config == CONFIG_JSON
            assert model_hash(model.parameters) == model_hash(parameters)
            assert asked == [], "no configuration and no ticket batch asked over libp2p"
            assert batches, "the other provider's tickets came on its side channel"
            nursery.cancel_scope.cancel()

    trio.run(main)


class _Fixed:
    """Answers of a provider serving one configuration and a ticket for each name starting
    with "p" (`ParameterUnknown` for the others), counted."""

    def __init__(self) -> None:
        self.configs = 0
        self.names: list[list[str]] = []

    async def config(self) -> ConfigFound | None:
        self.configs += 1
        return ConfigFound(VERSION, bytes(32), 10)

    async def tickets(self, names: list[str]) -> TicketsFound:
        self.names.append(names)
        return TicketsFound(VERSION, [_fixed_ticket(name) for name in names])


def _fixed_ticket(name: str) -> TicketAnswer:
    if name.startswith("p"):
        return TicketAnswer.Ok(TicketFound(bytes(32), len(name)))
    return TicketAnswer.Err(SharableModelError.ParameterUnknown(name))


async def _blob_server_beside(
    members: set[bytes], nursery: trio.Nursery, *, idle_timeout: float = 30.0
) -> tuple[EndpointAddr, _Fixed, BlobServer]:
    """A provider whose Noise layer lets anyone in but whose blob protocol serves only
    `members` (so the blob protocol's own check is what refuses): its address, what it
    answered, and its server."""
    identity = SecretKey.generate()
    answers = _Fixed()
    server = BlobServer(
        identity,
        lambda digest: None,
        members.__contains__,
        model_answers=answers,
        idle_timeout=idle_timeout,
    )
    transport = TcpBlobTransport(
        identity, lambda digest: None, lambda peer: True, bind_host="127.0.0.1", server=server
    )
    await nursery.start(transport.serve)
    return EndpointAddr(identity.public_key, transport.local_addrs()), answers, server


def _session(member: SecretKey) -> TcpBlobTransport:
    return TcpBlobTransport(member, lambda digest: None, lambda peer: True, bind_host="127.0.0.1")


TIMEOUT = 10.0


@pytest.mark.parametrize("request_is", ["config", "tickets"])
def test_a_strangers_model_request_is_refused_before_it_is_read(request_is: str) -> None:
    """A requester outside the run is refused at its `Hello` (the blob protocol's allowlist;
    its `GetConfig` / `GetTickets` is never read, the provider's model never asked), and by
    the Noise handshake of a real node (it cannot even send it); a member is answered on the
    same provider."""

    async def ask(session: BlobSession) -> object:
        if request_is == "config":
            return await session.config(TIMEOUT)
        return await session.tickets(["p.weight"], TIMEOUT)

    async def main() -> None:
        member, stranger = SecretKey.generate(), SecretKey.generate()
        async with trio.open_nursery() as nursery:
            addr, answered, _ = await _blob_server_beside({member.public_key}, nursery)
            with trio.fail_after(10):
                session = await _session(stranger).open_session(addr)
                with pytest.raises(BlobRefused, match="not in allowlist"):
                    await ask(session)
                await session.stream.aclose()
            assert (answered.configs, answered.names) == (0, [])

            with trio.fail_after(10):
                session = await _session(member).open_session(addr)
                assert await ask(session) in (
                    ConfigFound(VERSION, bytes(32), 10),
                    TicketsFound(VERSION, [TicketAnswer.Ok(TicketFound(bytes(32), 8))]),
                )
                await session.stream.aclose()
            assert answered.configs + len(answered.names) == 1
            nursery.cancel_scope.cancel()

        async with (
            open_nodes(1, model_codec=TENSOR_CODEC) as (provider,),
            open_nodes(1, allow_each_other=False) as (outsider,),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(serve_model, provider, _versioned_model(make_parameters(1)))
            answers = _count_config_answers(provider)
            outsider.set_allowed_peers([provider.endpoint_id])
            with trio.fail_after(10), pytest.raises(PeerRefused, match="allowlist"):
                await outsider.blob_transport.open_session(provider.endpoint_addr())
            with trio.fail_after(10):
                assert (
                    await model_sharing.config_on_side_channel(
                        outsider.blob_routes, provider.endpoint_addr()
                    )
                    is None
                )
                assert (
                    await model_sharing.tickets_on_side_channel(
                        outsider.blob_routes, provider.endpoint_addr(), ["model.norm.weight"]
                    )
                    is None
                )
            assert answers == []
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_request_is_told_apart_by_its_length_and_must_be_signed() -> None:
    """A 64-byte request frame is a `GetConfig`, a 96-byte one a `Get` (so `Get` is on the wire
    as before), any other a `GetTickets` (one that would be 96 bytes is padded); a `GetConfig`
    not signed by the session's requester is refused and the session closed, the configuration
    never looked up."""
    name = "p" * 29  # a GetTickets of one 29-character name would be 96 bytes unpadded
    assert len(blob_protocol.to_bytes(GetTickets(bytes(64), [name], b""), GetTickets)) == 96
    padded = blob_protocol.tickets_request(bytes(64), [name])
    assert len(blob_protocol.to_bytes(padded, GetTickets)) == 97

    async def main() -> None:
        member = SecretKey.generate()
        async with trio.open_nursery() as nursery:
            addr, answered, _ = await _blob_server_beside({member.public_key}, nursery)
            with trio.fail_after(10):
                session = await _session(member).open_session(addr)
                found = await session.tickets([name], TIMEOUT)
                assert found.answers == [TicketAnswer.Ok(TicketFound(bytes(32), 29))]
                assert answered.names == [[name]]
                await session.stream.aclose()
            with trio.fail_after(10):
                session = await _session(member).open_session(addr)
                await session.handshake()
                await blob_protocol.send_frame(
                    session.stream, blob_protocol.GetConfig(bytes(64)), blob_protocol.GetConfig
                )
                reply = await blob_protocol.read_frame(session.stream, blob_protocol.Reply)
                assert reply == blob_protocol.Reply.Refused("bad signature")
                with pytest.raises(StreamClosed):
                    await blob_protocol.read_frame(session.stream, blob_protocol.Reply)
            assert answered.configs == 0
            nursery.cancel_scope.cancel()
        get = blob_protocol.Get(bytes(64), bytes(32))
        assert len(blob_protocol.to_bytes(get, blob_protocol.Get)) == 96
        config = blob_protocol.GetConfig(bytes(64))
        assert len(blob_protocol.to_bytes(config, blob_protocol.GetConfig)) == (
            blob_protocol.GET_CONFIG_BYTES
        )

    trio.run(main)


async def _older_provider(provider: NetworkConnection) -> None:
    """`provider` as a node older than `GetConfig` and `GetTickets`: its blob server closes
    such a session."""
    provider.blob_server.model_answers = None


@pytest.mark.parametrize("provider_is", ["older", "without a side channel"])
def test_the_model_is_asked_over_libp2p_when_the_side_channel_cannot_answer(
    monkeypatch: pytest.MonkeyPatch, provider_is: str
) -> None:
    """An older provider (it closes the session on `GetConfig` and `GetTickets`) or one whose
    record names no side channel (relay-only, or none announced): the joiner asks for the
    configuration and the ticket batches over libp2p (the older one each time), and downloads
    the whole model of the version it wants."""
    parameters = make_parameters(4)
    asked = _count_libp2p_ticket_requests(monkeypatch)

    async def main() -> None:
        async with (
            open_nodes(2, model_codec=TENSOR_CODEC) as (provider, joiner),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(serve_model, provider, _versioned_model(parameters))
            if provider_is == "older":
                await _older_provider(provider)
                joiner.address_book.add(provider.endpoint_addr())
            else:
                joiner.address_book.add(without_side_channel(provider.endpoint_addr()))
            with trio.fail_after(60):
                ticket, version = await joiner.request_model_blob_ticket(
                    provider.endpoint_id, CONFIG
                )
            assert isinstance(ticket, BlobTicket)
            assert version == VERSION
            assert asked == [provider.endpoint_id]
            with trio.fail_after(60):
                model = await ModelDownload(
                    joiner, [provider.endpoint_id], expected_version=VERSION
                ).run()
            assert model.config.config == CONFIG_JSON
            assert model_hash(model.parameters) == model_hash(parameters)
            if provider_is == "older":
                # the configuration again and at least one ticket batch
                assert len(asked) >= 3
                assert set(asked) == {provider.endpoint_id}
            # else the joiner learnt the provider's whole record (side channel included) from
            # the connection the first request made, and asked on the side channel this time
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_ticket_batch_names_each_names_own_error() -> None:
    """On a real provider, a batch's unknown name gets its own `ParameterUnknown` beside the
    known names' tickets (as libp2p's batch answers), with the model's version, and no libp2p
    connection is made for it."""
    parameters = make_parameters(5)
    known = sorted(parameters)[:3]

    async def main() -> None:
        async with _serving(parameters) as (provider, joiner):
            with trio.fail_after(30):
                results = await joiner.request_model_blob_tickets(
                    provider.endpoint_id, [known[0], "no.such.weight", *known[1:]]
                )
            assert model_sharing.results_version(results) == VERSION
            assert [type(r) for r in results] == [
                TicketResult.Ok,
                TicketResult.Err,
                TicketResult.Ok,
                TicketResult.Ok,
            ]
            assert results[1].value == SharableModelError.ParameterUnknown("no.such.weight")
            assert all(
                r.value.addr.id == provider.endpoint_id for r in results if r is not results[1]
            )
            assert provider.endpoint_id not in joiner.connection_monitor.connected_peers()

    trio.run(main)


def test_a_large_batch_is_split_to_the_frame_caps() -> None:
    """A batch larger than a session's first request may be (1 KiB, read before the provider
    checks who asks) goes as a first part that fits and the rest at once, each later part at
    most `MAX_REQUEST_FRAME` bytes and `MAX_TICKETS_NAMES` names; the answers come back in
    order, one per name."""
    names = [f"p.layers.{i}.self_attn.q_proj.weight" for i in range(600)] + ["nope"]

    async def main() -> None:
        member = SecretKey.generate()
        async with trio.open_nursery() as nursery:
            addr, answered, _ = await _blob_server_beside({member.public_key}, nursery)
            with trio.fail_after(20):
                session = await _session(member).open_session(addr)
                found = await session.tickets(names, TIMEOUT)
                await session.stream.aclose()
            assert found.version == VERSION
            assert found.answers == [_fixed_ticket(name) for name in names]
            parts = answered.names
            assert [n for part in parts for n in part] == names
            first = blob_protocol.tickets_request(bytes(64), parts[0])
            assert len(blob_protocol.to_bytes(first, GetTickets)) <= MAX_CONTROL_FRAME
            for part in parts[1:]:
                assert len(part) <= MAX_TICKETS_NAMES
                frame = blob_protocol.tickets_request(bytes(64), part)
                assert len(blob_protocol.to_bytes(frame, GetTickets)) <= MAX_REQUEST_FRAME
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _all_released(server: BlobServer) -> None:
    """Wait (within the caller's timeout) until `server` holds no session and no slot: it
    closes a session as its connection's handler ends, just after the peer sees the close."""
    for _ in range(1000):
        if not (server.sessions or server.admission.pending or server.admission.established):
            return
        await trio.sleep(0.01)
    raise AssertionError("a slot was never released")


def _garbage(signature: bytes, case: str, first: bool) -> bytes:
    """A hostile member's control frame (4-byte length and body)."""
    if case == "oversized":
        body = bytes(MAX_CONTROL_FRAME + 1 if first else MAX_REQUEST_FRAME + 1)
    elif case == "undecodable":
        body = signature + b"\xff" * 40  # a GetTickets whose names' count is no varint
    else:  # too many names, in a frame under the cap
        names = ["p"] * (MAX_TICKETS_NAMES + 1)
        body = blob_protocol.to_bytes(GetTickets(signature, names, b""), GetTickets)
        assert len(body) <= (MAX_CONTROL_FRAME if first else MAX_REQUEST_FRAME)
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize("case", ["oversized", "undecodable", "too many names"])
@pytest.mark.parametrize("first", [True, False], ids=["first request", "later request"])
def test_a_members_bad_control_frame_ends_its_session(case: str, first: bool) -> None:
    """A member's oversized (over the phase's cap: 1 KiB first, `MAX_REQUEST_FRAME` later),
    undecodable or over-long `GetTickets` ends its session unanswered, before the provider's
    model is asked anything for it, and releases every slot (pending, serving, session)."""

    async def main() -> None:
        member = SecretKey.generate()
        async with trio.open_nursery() as nursery:
            addr, answered, server = await _blob_server_beside({member.public_key}, nursery)
            with trio.fail_after(10):
                session = await _session(member).open_session(addr)
                await session.handshake()
                assert session.signature is not None
                if not first:
                    assert (await session.config(TIMEOUT)) is not None
                await session.stream.send_all(_garbage(session.signature, case, first))
                with pytest.raises(StreamClosed):
                    await blob_protocol.read_frame(session.stream, Reply)
                await session.stream.aclose()
                await _all_released(server)
            assert answered.names == []
            assert answered.configs == (0 if first else 1)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_member_that_stalls_inside_a_request_is_dropped_at_the_idle_timeout() -> None:
    """A member that sends part of a request frame and nothing more is dropped when the
    session's idle timeout ends (the whole request must come within it), its slots released;
    a member that sends nothing at all after a request likewise."""

    async def main() -> None:
        member = SecretKey.generate()
        async with trio.open_nursery() as nursery:
            addr, answered, server = await _blob_server_beside(
                {member.public_key}, nursery, idle_timeout=0.5
            )
            for partial in (b"", (200).to_bytes(4, "big") + bytes(10)):
                with trio.fail_after(10):
                    session = await _session(member).open_session(addr)
                    assert (await session.config(TIMEOUT)) is not None
                    assert server.sessions == 1
                    await session.stream.send_all(partial)
                    with pytest.raises(StreamClosed):
                        await blob_protocol.read_frame(session.stream, Reply)
                    await session.stream.aclose()
                    await _all_released(server)
            assert answered.configs == 2
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_split_batch_whose_first_part_is_all_errors_names_its_tickets_version() -> None:
    """A batch split to the frame caps whose first part names only parameters the provider
    lacks: that part's answers are all errors and name no version (a provider notes the
    version of the tickets it gives), and the batch still names the version of the tickets in
    the later part, as libp2p's unsplit batch of the same names does. Before, the parts'
    versions were merged as a set, so the batch named none: the joiner refused its tickets
    (`OtherModelVersion(None, ...)`) and rested an honest provider."""
    parameters = make_parameters(6)
    known = sorted(parameters)
    unknown = [f"model.layers.{i}.mlp.no_such_proj.weight" for i in range(40)]
    names = unknown + known

    async def main() -> None:
        async with _serving(parameters) as (provider, joiner):
            answers = _count_answers(provider)
            with trio.fail_after(30):
                side = await joiner.request_model_blob_tickets(provider.endpoint_id, names)
            assert provider.endpoint_id not in joiner.connection_monitor.connected_peers()
            assert len(answers.names) > 1
            assert set(answers.names[0]) <= set(unknown)  # a part of errors only
            assert model_sharing.results_version(side) == VERSION
            with trio.fail_after(30):
                await joiner.connect(provider.endpoint_id)
                batch = await model_sharing.request_tickets(
                    joiner.host, provider.endpoint_id, names
                )
            assert model_sharing.results_version(batch) == VERSION
            assert [type(r) for r in side] == [type(r) for r in batch]
            assert sum(isinstance(r, TicketResult.Ok) for r in side) == len(known)

    trio.run(main)


def test_an_older_provider_is_asked_for_the_model_on_its_side_channel_once_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A provider older than `GetConfig` and `GetTickets` closes the session on them. The kept
    session it closed is tried again on a fresh one (a provider may close a kept session for
    its own reasons); once the fresh session's first request is closed too, the provider's
    model requests go straight to libp2p (`ask` answers None) without a session each, for
    `OLDER_PROVIDER_SECS`, and its blobs still come on the side channel; `prepare` then says
    it needs another path (a model download dials it over libp2p ahead of its ticket batches,
    instead of on the first). After that time it is asked on the side channel again (a
    restarted provider may be newer). Before, every request opened a session and a handshake
    that the provider then closed."""
    blobs = {blob_hash(data): data for data in (os.urandom(1 << 20) for _ in range(2))}
    digests = list(blobs)

    async def main() -> None:
        member, identity = SecretKey.generate(), SecretKey.generate()
        server = BlobServer(identity, blobs.get, {member.public_key}.__contains__)
        transport = TcpBlobTransport(
            identity, blobs.get, lambda peer: True, bind_host="127.0.0.1", server=server
        )
        client = _session(member)
        opened: list[EndpointAddr] = []
        open_session = client.open_session

        async def counted(provider: EndpointAddr) -> BlobSession:
            opened.append(provider)
            return await open_session(provider)

        monkeypatch.setattr(client, "open_session", counted)
        now = [0.0]
        routes = BlobRoutes(client, None, clock=lambda: now[0])

        async def fetch(digest: bytes) -> None:
            got = await routes.fetch(addr, digest, len(blobs[digest]), lambda received: None)
            assert got == blobs[digest]

        async with trio.open_nursery() as nursery:
            await nursery.start(transport.serve)
            addr = EndpointAddr(identity.public_key, transport.local_addrs())
            with trio.fail_after(30):
                await fetch(digests[0])  # its session is kept for the next request
                assert await routes.prepare(addr)  # (not known to be older yet)
                assert len(opened) == 1
                for _ in range(3):
                    assert await routes.ask(addr, lambda s: s.tickets(["p.w"], TIMEOUT)) is None
                    assert await routes.ask(addr, lambda s: s.config(TIMEOUT)) is None
                assert len(opened) == 2  # the kept session, then one fresh session
                await fetch(digests[1])
                assert routes.routes[addr.id] == SIDE_CHANNEL
                assert not await routes.prepare(addr)  # a session is kept, but no model answers
                assert len(opened) == 3
                now[0] += OLDER_PROVIDER_SECS
                assert await routes.ask(addr, lambda s: s.config(TIMEOUT)) is None
                assert len(opened) == 4
                assert await routes.ask(addr, lambda s: s.config(TIMEOUT)) is None
                assert len(opened) == 4
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_side_channel_providers_are_measured_and_ranked_like_any() -> None:
    """The download fetches two providers' blobs on the side channel (no libp2p connection
    to them) and a third's over libp2p: every provider's bandwidth is measured, so the next
    download ranks them alike; a side-channel provider whose blob then fails falls to the
    failed tier (asked last). Before, a side-channel provider's measurements were dropped (the
    monitor kept entries only for libp2p connections): it stayed unmeasured, behind the
    libp2p-measured peer, and its failure was never noted."""
    parameters = make_parameters(31)

    async def main() -> None:
        async with (
            open_nodes(4, model_codec=TENSOR_CODEC) as nodes,
            trio.open_nursery() as nursery,
        ):
            *providers, joiner = nodes
            for provider in providers:
                nursery.start_soon(serve_model, provider, provider_model(parameters))
            await introduce_all(joiner, providers[:2])
            joiner.address_book.add(without_side_channel(providers[2].endpoint_addr()))
            ids = [p.endpoint_id for p in providers]
            download = ModelDownload(joiner, ids)
            with trio.fail_after(60):
                got = await download.run()
            assert model_hash(got.parameters) == model_hash(parameters)
            monitor = joiner.connection_monitor
            assert not set(ids[:2]) & set(monitor.connected_peers())  # fetched on the side channel
            for peer in ids:
                bandwidth = monitor.get_bandwidth(peer)
                assert isinstance(bandwidth, PeerBandwidth.Measured), bandwidth
                assert bandwidth.value > 0
            # a blob the side-channel provider does not hold: its download fails
            missing = BlobTicket(providers[0].endpoint_addr(), BlobFormat.Raw, blob_hash(b"x"), 1)
            with trio.fail_after(60):
                outcome = await joiner.start_download(
                    missing, "missing", DownloadType.ModelSharing(CONFIG)
                ).finished()
            assert isinstance(outcome, DownloadFailed)
            assert monitor.get_bandwidth(ids[0]) == PeerBandwidth.Measured(0.0)
            ranking = PeerManager(monitor)
            ranking.set_peers(ids)
            asked = [ranking.get_next_peer() for _ in ids]
            assert asked[-1] == ids[0]
            nursery.cancel_scope.cancel()

    trio.run(main)
