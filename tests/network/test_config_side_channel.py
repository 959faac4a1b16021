"""The model configuration asked on the blob side channel (`GetConfig`): a joiner gets it from
real nodes on loopback without waiting for a libp2p connection, with the version of its model;
a stranger is refused before its request is read; an older provider (no `GetConfig`) or a
provider without a usable side channel is asked over libp2p instead."""

from __future__ import annotations

import pytest
import trio

from psyche.core.identity import SecretKey
from psyche.modeling.sharing import TENSOR_CODEC, model_hash
from psyche.network import blob_protocol, model_sharing
from psyche.network.blob_protocol import BlobRefused, ConfigFound, StreamClosed
from psyche.network.blob_routes import SIDE_CHANNEL
from psyche.network.blob_transport import BlobServer, TcpBlobTransport
from psyche.network.connection import NetworkConnection
from psyche.network.model_download import ModelDownload
from psyche.network.secure_channel import PeerRefused
from psyche.network.testing import open_nodes, serve_model
from psyche.network.ticket import BlobTicket, EndpointAddr, TransportAddr
from psyche.network.transmittable import (
    DownloadType,
    ModelRequestType,
    TransmittableModelConfig,
)

from .test_model_sharing import (
    CONFIG_JSON,
    TOKENIZER_JSON,
    introduce_all,
    make_parameters,
    provider_model,
)

CONFIG = ModelRequestType.Config()
VERSION = 20


def _count_libp2p_ticket_requests(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The peers asked for a single ticket over libp2p (`/psyche/model-sharing/1`)."""
    asked: list[bytes] = []
    request = model_sharing.request_ticket

    async def counting(host, peer, request_type):  # type: ignore[no-untyped-def]
        asked.append(peer)
        return await request(host, peer, request_type)

    monkeypatch.setattr(model_sharing, "request_ticket", counting)
    return asked


def _count_config_answers(provider: NetworkConnection) -> list[ConfigFound | None]:
    """What `provider`'s blob server answered to each `GetConfig`."""
    answers: list[ConfigFound | None] = []
    config = provider.blob_server.config
    assert config is not None

    async def counting() -> ConfigFound | None:
        found = await config()
        answers.append(found)
        return found

    provider.blob_server.config = counting
    return answers


def _versioned_model(parameters):  # type: ignore[no-untyped-def]
    model = provider_model(parameters)
    model.update_parameters(parameters, VERSION)
    model.update_config(CONFIG_JSON, TOKENIZER_JSON)
    return model


def test_the_joiner_gets_the_configuration_on_the_side_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The configuration's ticket, with its model's version, comes on the side channel while no
    libp2p connection joins the two nodes (none is made for it); its bytes come by the same
    session. A whole download asks no single ticket over libp2p and ends with the provider's
    model. Before, the configuration was asked over libp2p only (after the joiner's dial)."""
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

            with trio.fail_after(60):
                model = await ModelDownload(
                    joiner, [provider.endpoint_id, other.endpoint_id], expected_version=VERSION
                ).run()
            assert model.config.config == CONFIG_JSON
            assert model_hash(model.parameters) == model_hash(parameters)
            assert asked == [], "no configuration asked over libp2p"
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _blob_server_beside(
    members: set[bytes], nursery: trio.Nursery
) -> tuple[EndpointAddr, list[int]]:
    """A provider whose Noise layer lets anyone in but whose blob protocol serves only
    `members` (so the blob protocol's own check is what refuses): its address and the number
    of `GetConfig`s it answered."""
    identity = SecretKey.generate()
    answered: list[int] = []

    async def config() -> ConfigFound | None:
        answered.append(1)
        return ConfigFound(VERSION, bytes(32), 10)

    server = BlobServer(identity, lambda digest: None, members.__contains__, config=config)
    transport = TcpBlobTransport(
        identity, lambda digest: None, lambda peer: True, bind_host="127.0.0.1", server=server
    )
    await nursery.start(transport.serve)
    return EndpointAddr(identity.public_key, transport.local_addrs()), answered


def test_a_strangers_configuration_request_is_refused_before_it_is_read() -> None:
    """A requester outside the run is refused at its `Hello` (the blob protocol's allowlist;
    its `GetConfig` is never read, the provider's configuration never looked up), and by the
    Noise handshake of a real node (it cannot even send it); a member is answered on the same
    provider."""

    async def main() -> None:
        member, stranger = SecretKey.generate(), SecretKey.generate()
        async with trio.open_nursery() as nursery:
            addr, answered = await _blob_server_beside({member.public_key}, nursery)
            client = TcpBlobTransport(
                stranger, lambda digest: None, lambda peer: True, bind_host="127.0.0.1"
            )
            with trio.fail_after(10):
                session = await client.open_session(addr)
                with pytest.raises(BlobRefused, match="not in allowlist"):
                    await session.config()
                await session.stream.aclose()
            assert answered == []

            ours = TcpBlobTransport(
                member, lambda digest: None, lambda peer: True, bind_host="127.0.0.1"
            )
            with trio.fail_after(10):
                session = await ours.open_session(addr)
                assert await session.config() == ConfigFound(VERSION, bytes(32), 10)
                await session.stream.aclose()
            assert answered == [1]
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
                assert await outsider.blob_routes.config(provider.endpoint_addr()) is None
            assert answers == []
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_request_is_told_apart_by_its_length_and_must_be_signed() -> None:
    """A 64-byte request frame is a `GetConfig`, a 96-byte one a `Get` (so `Get` is on the wire
    as before); a `GetConfig` not signed by the session's requester is refused and the session
    closed, the configuration never looked up."""

    async def main() -> None:
        member = SecretKey.generate()
        async with trio.open_nursery() as nursery:
            addr, answered = await _blob_server_beside({member.public_key}, nursery)
            ours = TcpBlobTransport(
                member, lambda digest: None, lambda peer: True, bind_host="127.0.0.1"
            )
            with trio.fail_after(10):
                session = await ours.open_session(addr)
                await session.handshake()
                await blob_protocol.send_frame(
                    session.stream, blob_protocol.GetConfig(bytes(64)), blob_protocol.GetConfig
                )
                reply = await blob_protocol.read_frame(session.stream, blob_protocol.Reply)
                assert reply == blob_protocol.Reply.Refused("bad signature")
                with pytest.raises(StreamClosed):
                    await blob_protocol.read_frame(session.stream, blob_protocol.Reply)
            assert answered == []
            nursery.cancel_scope.cancel()
        get = blob_protocol.Get(bytes(64), bytes(32))
        assert len(blob_protocol.to_bytes(get, blob_protocol.Get)) == 96
        config = blob_protocol.GetConfig(bytes(64))
        assert len(blob_protocol.to_bytes(config, blob_protocol.GetConfig)) == (
            blob_protocol.GET_CONFIG_BYTES
        )

    trio.run(main)


def _without_side_channel(addr: EndpointAddr) -> EndpointAddr:
    return EndpointAddr(addr.id, [a for a in addr.addrs if isinstance(a, TransportAddr.Libp2p)])


async def _older_provider(provider: NetworkConnection) -> None:
    """`provider` as a node older than `GetConfig`: its blob server closes such a session."""
    provider.blob_server.config = None


@pytest.mark.parametrize("provider_is", ["older", "without a side channel"])
def test_the_configuration_is_asked_over_libp2p_when_the_side_channel_cannot_answer(
    monkeypatch: pytest.MonkeyPatch, provider_is: str
) -> None:
    """An older provider (it closes the session on `GetConfig`) or one whose record names no
    side channel (relay-only, or none announced): the joiner asks for the configuration over
    libp2p (the older one each time), and downloads the whole model of the version it
    wants."""
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
                joiner.address_book.add(_without_side_channel(provider.endpoint_addr()))
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
                assert asked == [provider.endpoint_id] * 2
            # else the joiner learnt the provider's whole record (side channel included) from
            # the connection the first request made, and asked on the side channel this time
            nursery.cancel_scope.cancel()

    trio.run(main)
