"""Blob transfers between real nodes: integrity, fallback providers, refusal, hostile input."""

from __future__ import annotations

import os
import struct

import pytest
import trio
from libp2p.network.exceptions import SwarmException

from psyche.core.identity import SecretKey
from psyche.network import blob_protocol
from psyche.network.blob_protocol import BlobRefused, HashMismatch
from psyche.network.blob_transport import TcpBlobTransport
from psyche.network.download import Download, DownloadComplete, DownloadFailed, DownloadOutcome
from psyche.network.secure_channel import PeerRefused
from psyche.network.testing import connect_pairs, open_nodes
from psyche.network.ticket import (
    BlobFormat,
    BlobTicket,
    EndpointAddr,
    TransportAddr,
    parse_host_port,
)
from psyche.network.transmittable import (
    DownloadType,
    ModelRequestType,
    TransmittableModelParameter,
)

from ..polling import poll_until
from .blob_providers import serve_truncated


def payload(size: int, name: str = "w") -> TransmittableModelParameter:
    return TransmittableModelParameter(name.encode(), os.urandom(size))


async def finished(download: Download) -> DownloadOutcome:
    with trio.fail_after(10):
        return await download.finished()


def test_download_verifies_serves_onward_and_survives_bad_providers() -> None:
    async def main() -> None:
        async with open_nodes(4) as (a, b, c, d), trio.open_nursery() as nursery:
            await connect_pairs([a, b, c, d], [(2, 0), (1, 0)])
            data = payload(3_000_000)
            ticket, size = await a.add_downloadable(data, "distro-result_1")
            assert ticket.provider == a.endpoint_id
            assert ticket.size == size

            done = await finished(
                b.start_download(ticket, "distro-result_1", DownloadType.DistroResult([]))
            )
            assert isinstance(done, DownloadComplete)
            assert done.data == data
            assert done.hash == ticket.hash
            assert done.from_ == a.endpoint_id
            assert a.bytes_served == size

            # a's copy rots; c must notice and fetch b's copy (b serves what it downloaded)
            blob = a.store.get(ticket.hash)
            assert blob is not None
            corrupted = bytearray(blob)
            corrupted[len(corrupted) // 2] ^= 0xFF
            a.store._blobs[ticket.hash] = bytes(corrupted)
            b_addr = b.endpoint_addr()
            c.address_book.add(b_addr)
            done = await finished(
                c.start_download(
                    ticket, "distro-result_1", DownloadType.DistroResult([b.endpoint_id])
                )
            )
            assert isinstance(done, DownloadComplete)
            assert done.data == data
            failures = [(p, r) for h, p, r in c.downloader.provider_failures if h == ticket.hash]
            assert failures
            assert failures[0][0] == a.endpoint_id
            assert "corrupted" in failures[0][1]
            assert b.bytes_served == size

            # d (connected to nobody over libp2p) first meets a provider that dies mid-transfer
            dying = SecretKey.generate()
            blob_bytes = bytes(b.store.get(ticket.hash) or b"")
            port = await nursery.start(serve_truncated, dying, blob_bytes)
            d.set_allowed_peers([a.endpoint_id, b.endpoint_id, c.endpoint_id, dying.public_key])
            d.address_book.add(
                EndpointAddr(dying.public_key, [TransportAddr.BlobTcp(f"127.0.0.1:{port}")])
            )
            d.address_book.add(b_addr)
            dying_ticket = BlobTicket(
                EndpointAddr(dying.public_key, [TransportAddr.BlobTcp(f"127.0.0.1:{port}")]),
                BlobFormat.Raw,
                ticket.hash,
                ticket.size,
            )
            done = await finished(
                d.start_download(
                    dying_ticket, "distro-result_1", DownloadType.DistroResult([b.endpoint_id])
                )
            )
            assert isinstance(done, DownloadComplete)
            assert done.data == data
            (failure,) = [f for f in d.downloader.provider_failures if f[1] == dying.public_key]
            assert "closed after" in failure[2]

            # with no other provider the download fails, and says so
            d.store.delete_tag("distro-result_1")
            d.store.gc()
            failed = await finished(
                d.start_download(dying_ticket, "distro-result_1", DownloadType.DistroResult([]))
            )
            assert isinstance(failed, DownloadFailed)
            assert failed.error == "Download error"
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_outsiders_are_refused_blobs_both_ways() -> None:
    async def main() -> None:
        async with open_nodes(2) as (a, _b), open_nodes(1, allow_each_other=False) as (outsider,):
            outsider.set_allowed_peers([a.endpoint_id])
            ticket, _ = await a.add_downloadable(payload(1000), "distro-result_1")
            with pytest.raises(PeerRefused, match="allowlist"):
                await outsider.blob_transport.fetch(
                    ticket.addr, ticket.hash, ticket.size, lambda n: None
                )
            download = outsider.start_download(ticket, "t", DownloadType.DistroResult([]))
            assert isinstance(await finished(download), DownloadFailed)

            # nor does a run member download from an outsider, even with the right hash
            theirs, _ = await outsider.add_downloadable(payload(1000), "distro-result_1")
            failed = await finished(
                a.start_download(theirs, "distro-result_1", DownloadType.DistroResult([]))
            )
            assert isinstance(failed, DownloadFailed)
            assert [
                r for _, p, r in a.downloader.provider_failures if p == outsider.endpoint_id
            ] == ["not in allowlist"]
            assert outsider.bytes_served == 0

            # nor ask it (or be asked) for model parameters
            with pytest.raises(PermissionError):
                await a.request_model_blob_ticket(outsider.endpoint_id, ModelRequestType.Config())
            outsider.address_book.add(a.endpoint_addr())
            # a's connection gate refuses the outsider once the libp2p handshake names it
            with pytest.raises(SwarmException):
                await outsider.request_model_blob_ticket(a.endpoint_id, ModelRequestType.Config())
            assert outsider.endpoint_id not in a.connection_monitor.connected_peers()

    trio.run(main)


def test_hostile_blob_requests_do_not_harm_the_provider() -> None:
    async def main() -> None:
        async with open_nodes(2, download_timeout_secs=1.0) as (a, b):
            data = payload(200_000)
            ticket, _ = await a.add_downloadable(data, "distro-result_1")
            host, port = parse_host_port(a.endpoint_addr().blob_addrs()[0])
            for junk in (
                struct.pack(">I", 1 << 30),  # absurd frame length
                struct.pack(">I", 8) + b"\xff" * 8,  # undecodable hello
                os.urandom(2000),
                b"",
            ):
                stream = await trio.open_tcp_stream(host, port)
                # The provider must hang up: wait for that (not for a fixed time).
                with trio.fail_after(blob_protocol.HANDSHAKE_TIMEOUT_SECS + 20):
                    try:
                        await stream.send_all(junk)
                        await stream.send_eof()
                        while await stream.receive_some(65536):
                            pass
                    except trio.BrokenResourceError:
                        pass  # a reset is a hang-up too
                await stream.aclose()

            # a member claiming b's identity inside the blob protocol cannot sign b's transcript
            impostor_key = SecretKey.generate()
            a.set_allowed_peers([b.endpoint_id, impostor_key.public_key])
            impostor = TcpBlobTransport(
                impostor_key, lambda h: None, lambda p: True, bind_host="127.0.0.1"
            )
            impostor._identity = _ClaimsToBe(b.secret_key.public_key, impostor._identity)
            with pytest.raises(BlobRefused, match="bad signature"):
                await impostor.fetch(ticket.addr, ticket.hash, ticket.size, lambda n: None)

            # a lying ticket (wrong size) is refused before any payload is read
            lying = BlobTicket(ticket.addr, BlobFormat.Raw, ticket.hash, ticket.size - 1)
            with pytest.raises(blob_protocol.BlobProtocolError, match="ticket says"):
                await b.blob_transport.fetch(lying.addr, lying.hash, lying.size, lambda n: None)

            # the provider still serves honest requests
            done = await finished(
                b.start_download(ticket, "distro-result_1", DownloadType.DistroResult([]))
            )
            assert isinstance(done, DownloadComplete)
            assert done.data == data

    trio.run(main)


class _ClaimsToBe:
    """An identity that announces someone else's public key but can only sign with its own."""

    def __init__(self, claimed: bytes, real: SecretKey) -> None:
        self.public_key = claimed
        self._real = real

    def sign(self, data: bytes) -> bytes:
        return self._real.sign(data)


def test_hash_mismatch_is_detected_by_the_transport() -> None:
    async def main() -> None:
        provider, requester = SecretKey.generate(), SecretKey.generate()
        good = os.urandom(100_000)
        bad = bytearray(good)
        bad[0] ^= 1
        server = TcpBlobTransport(
            provider, lambda h: bytes(bad), lambda p: True, bind_host="127.0.0.1"
        )
        client = TcpBlobTransport(requester, lambda h: None, lambda p: True, bind_host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            addr = EndpointAddr(provider.public_key, server.local_addrs())
            from psyche.network.ticket import blob_hash

            with pytest.raises(HashMismatch):
                await client.fetch(addr, blob_hash(good), len(good), lambda n: None)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_untagged_blobs_are_collected_and_no_longer_served() -> None:
    async def main() -> None:
        async with open_nodes(2, gc_interval_secs=0.05) as (a, b):
            old, _ = await a.add_downloadable(payload(1000, "a"), "distro-result_3")
            new, _ = await a.add_downloadable(payload(1000, "b"), "distro-result_4")
            model, _ = await a.add_downloadable(payload(1000, "c"), "model-c")
            assert a.remove_staled_tags(4) == 2
            with trio.fail_after(10):  # the GC runs every 0.05 s; one pass drops both
                await poll_until(lambda: a.store.get(old.hash) is None, 0.01)
            assert a.store.get(model.hash) is None
            assert a.store.get(new.hash) is not None
            with pytest.raises(blob_protocol.BlobNotFound):
                await b.blob_transport.fetch(old.addr, old.hash, old.size, lambda n: None)

    trio.run(main)


async def serve_silently(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A provider that accepts connections and never answers."""

    async def handler(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])


def test_a_hanging_provider_hits_the_download_timeout() -> None:
    async def main() -> None:
        async with open_nodes(1, download_timeout_secs=0.5) as (a,), trio.open_nursery() as nursery:
            port = await nursery.start(serve_silently)
            silent = SecretKey.generate()
            a.set_allowed_peers([silent.public_key])
            addr = EndpointAddr(silent.public_key, [TransportAddr.BlobTcp(f"127.0.0.1:{port}")])
            ticket = BlobTicket(addr, BlobFormat.Raw, bytes(32), 10)
            download = a.start_download(ticket, "distro-result_1", DownloadType.DistroResult([]))
            # the provider never answers, so only the download timeout can end this download
            failed = await finished(download)
            assert isinstance(failed, DownloadFailed)
            assert "timed out after 0.5 s" in failed.error
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_every_download_resolves_even_when_the_network_shuts_down() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_silently)
            silent = SecretKey.generate()
            addr = EndpointAddr(silent.public_key, [TransportAddr.BlobTcp(f"127.0.0.1:{port}")])
            ticket = BlobTicket(addr, BlobFormat.Raw, bytes(32), 10)
            async with open_nodes(1) as (a,):
                a.set_allowed_peers([silent.public_key])
                # the provider never answers and the timeout is 600 s: only the shutdown ends it
                hanging = a.start_download(ticket, "distro-result_1", DownloadType.DistroResult([]))
                a.shutdown()
                await trio.sleep_forever()  # the shutdown cancels the network's block
            failed = await finished(hanging)
            assert isinstance(failed, DownloadFailed)
            assert "shut down" in failed.error
            late = a.start_download(ticket, "distro-result_1", DownloadType.DistroResult([]))
            assert late.done
            failed = await finished(late)
            assert isinstance(failed, DownloadFailed)
            assert failed.error == "the network is shut down"
            nursery.cancel_scope.cancel()

    trio.run(main)
