"""Which way blobs come (psyche.network.blob_routes), between real nodes on loopback: the side
channel when it answers, a libp2p stream when it cannot be reached or breaks mid-transfer
(logged once per change), and one session per provider for many blobs."""

from __future__ import annotations

import logging
import os

import pytest
import trio

from psyche.network.blob_routes import LIBP2P_DIRECT, SIDE_CHANNEL
from psyche.network.download import Download, DownloadComplete, DownloadOutcome
from psyche.network.testing import open_nodes
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr, TransportAddr
from psyche.network.transmittable import DownloadType

from .blob_providers import serve_truncated

DEADLINE = 30


async def finished(download: Download) -> DownloadOutcome:
    with trio.fail_after(DEADLINE):
        return await download.finished()


def with_blob_addr(ticket: BlobTicket, blob_addr: str) -> BlobTicket:
    """The ticket, its provider's side channel replaced by `blob_addr`."""
    addrs = [a for a in ticket.addr.addrs if not isinstance(a, TransportAddr.BlobTcp)]
    addr = EndpointAddr(ticket.addr.id, [*addrs, TransportAddr.BlobTcp(blob_addr)])
    return BlobTicket(addr, BlobFormat.Raw, ticket.hash, ticket.size)


async def closed_port() -> int:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    return port


def test_an_unreachable_side_channel_falls_back_to_libp2p_once_and_logs_it(caplog) -> None:
    caplog.set_level(logging.INFO, logger="psyche.network.blob_routes")

    async def main() -> None:
        async with open_nodes(2) as (a, b):
            data = os.urandom(2_000_000)
            ticket, size = await a.add_downloadable(data, "distro-result_1")
            unreachable = with_blob_addr(ticket, f"127.0.0.1:{await closed_port()}")
            done = await finished(
                b.start_download(unreachable, "distro-result_1", DownloadType.DistroResult([]))
            )
            assert isinstance(done, DownloadComplete)
            assert bytes(done.data) == data
            assert b.blob_routes.routes[a.endpoint_id] == LIBP2P_DIRECT
            assert a.bytes_served == size
            # the next blob goes straight to libp2p (the side channel is remembered as down)
            second, _ = await a.add_downloadable(os.urandom(1000), "distro-result_2")
            second = with_blob_addr(second, f"127.0.0.1:{await closed_port()}")
            done = await finished(
                b.start_download(second, "distro-result_2", DownloadType.DistroResult([]))
            )
            assert isinstance(done, DownloadComplete)
        changes = [r for r in caplog.records if "now come by" in r.getMessage()]
        assert len(changes) == 1
        assert "side channel unreachable" in changes[0].getMessage()

    trio.run(main)


def test_a_side_channel_that_breaks_mid_transfer_continues_on_libp2p() -> None:
    async def main() -> None:
        async with open_nodes(2) as (a, b), trio.open_nursery() as nursery:
            data = os.urandom(3_000_000)
            ticket, _ = await a.add_downloadable(data, "distro-result_1")
            blob = bytes(a.store.get(ticket.hash) or b"")
            port = await nursery.start(serve_truncated, a.secret_key, blob)
            dying = with_blob_addr(ticket, f"127.0.0.1:{port}")
            done = await finished(
                b.start_download(dying, "distro-result_1", DownloadType.DistroResult([]))
            )
            assert isinstance(done, DownloadComplete)
            assert bytes(done.data) == data
            assert b.blob_routes.routes[a.endpoint_id] == LIBP2P_DIRECT
            # one provider, one attempt: the break was absorbed inside it
            assert not [f for f in b.downloader.provider_failures if f[1] == a.endpoint_id]
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_one_session_carries_many_blobs_from_a_provider() -> None:
    async def main() -> None:
        async with open_nodes(2) as (a, b):
            payloads = [os.urandom(100_000) for _ in range(12)]
            tickets = [
                (await a.add_downloadable(p, f"model-{i}"))[0] for i, p in enumerate(payloads)
            ]
            for i, ticket in enumerate(tickets):
                done = await finished(
                    b.start_download(ticket, f"model-{i}", DownloadType.DistroResult([]))
                )
                assert isinstance(done, DownloadComplete)
                assert bytes(done.data) == payloads[i]
            assert b.blob_routes.routes[a.endpoint_id] == SIDE_CHANNEL
            assert a.blob_server.sessions == 1
            assert b.blob_routes.idle_sessions() == 1

    trio.run(main)


def test_concurrent_fetches_from_a_provider_share_one_pipelined_session() -> None:
    """Fetches running at once against one provider go on one side-channel session (one
    handshake, requests pipelined), not one session each."""

    async def main() -> None:
        async with open_nodes(2, max_downloads_per_peer=4) as (a, b):
            payloads = [os.urandom(300_000) for _ in range(8)]
            tickets = [
                (await a.add_downloadable(p, f"model-{i}"))[0] for i, p in enumerate(payloads)
            ]
            outcomes: dict[int, object] = {}

            async def one(i: int) -> None:
                download = b.start_download(tickets[i], f"model-{i}", DownloadType.DistroResult([]))
                outcomes[i] = await finished(download)

            async with trio.open_nursery() as nursery:
                for i in range(len(tickets)):
                    nursery.start_soon(one, i)
            for i, payload in enumerate(payloads):
                done = outcomes[i]
                assert isinstance(done, DownloadComplete)
                assert bytes(done.data) == payload
            assert a.blob_server.sessions == 1
            assert b.blob_routes.idle_sessions() == 1

    trio.run(main)


@pytest.mark.parametrize("limit", [1, 3])
def test_fetches_per_provider_are_bounded(limit: int) -> None:
    async def main() -> None:
        async with open_nodes(2, max_downloads_per_peer=limit) as (a, b):
            tickets = [
                (await a.add_downloadable(os.urandom(500_000), f"model-{i}"))[0] for i in range(8)
            ]
            serving: list[int] = []
            lookup = a.blob_server.lookup

            def watch(digest: bytes) -> bytes | bytearray | None:
                serving.append(a.blob_server.admission.established)
                return lookup(digest)

            a.blob_server.lookup = watch
            async with trio.open_nursery() as nursery:
                for i, ticket in enumerate(tickets):
                    nursery.start_soon(
                        finished,
                        b.start_download(ticket, f"model-{i}", DownloadType.DistroResult([])),
                    )
            assert len(serving) == 8
            assert max(serving) <= limit
            assert a.blob_server.sessions <= limit

    trio.run(main)
