"""What strangers and members can make a blob provider hold (psyche.network.blob_transport):
control frames capped before authentication, pending connections that evict the oldest, a
capped number of blobs being served, handshake and send-stall timeouts, and no blob kept in
memory by a requester that stops reading. Real sockets on loopback; timeouts shortened."""

from __future__ import annotations

import dataclasses
import gc
import os
import struct
import tracemalloc
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from psyche.core.identity import SecretKey
from psyche.network import blob_protocol
from psyche.network.blob_protocol import BlobRefused
from psyche.network.blob_transport import BLOB_LIMITS, TcpBlobTransport
from psyche.network.ticket import EndpointAddr, blob_hash

pytestmark = pytest.mark.anyio

DEADLINE = 30  # seconds: generous, for a busy 2-core machine
MIB = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


class Blob(bytearray):
    """A stored blob that a weak reference can watch."""


class Provider:
    def __init__(self, transport: TcpBlobTransport, key: SecretKey, blob: Blob) -> None:
        self.transport = transport
        self.key = key
        self.blob: Blob | None = blob
        self.digest = blob_hash(blob)
        self.port = int(transport.local_addrs()[0].value.rsplit(":", 1)[1])

    @property
    def addr(self) -> EndpointAddr:
        return EndpointAddr(self.key.public_key, self.transport.local_addrs())

    def lookup(self, digest: bytes) -> Blob | None:
        return self.blob if digest == self.digest else None


@asynccontextmanager
async def provider(size: int = 100_000, **limits: float | int) -> AsyncIterator[Provider]:
    key = SecretKey.generate()
    box: list[Provider] = []
    transport = TcpBlobTransport(
        key,
        lambda digest: box[0].lookup(digest),
        lambda peer: True,
        bind_host="127.0.0.1",
        limits=dataclasses.replace(BLOB_LIMITS, **limits),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(transport.serve)
        box.append(Provider(transport, key, Blob(os.urandom(size))))
        yield box[0]
        nursery.cancel_scope.cancel()


def requester() -> TcpBlobTransport:
    return TcpBlobTransport(
        SecretKey.generate(), lambda h: None, lambda p: True, bind_host="127.0.0.1"
    )


async def fetch(p: Provider) -> bytearray:
    assert p.blob is not None
    with trio.fail_after(DEADLINE):
        return await requester().fetch(p.addr, p.digest, len(p.blob), lambda n: None)


class RawRequester:
    """A requester driven by hand: it can stop at any step, or ask and never read."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.key = SecretKey.generate()

    @classmethod
    async def open(cls, p: Provider) -> RawRequester:
        return cls(await trio.open_tcp_stream("127.0.0.1", p.port))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def receive_into(self, view: memoryview) -> int:
        return await self.stream.socket.recv_into(view)

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def ask(self, p: Provider) -> None:
        """The whole signed request, and nothing read after it."""
        hello = blob_protocol.Hello(0, self.key.public_key, p.key.public_key, os.urandom(32))
        await blob_protocol.send_frame(self, hello, blob_protocol.Hello)
        reply = await blob_protocol.read_frame(self, blob_protocol.ServerHello)
        assert isinstance(reply, blob_protocol.ServerHello.Challenge)
        transcript = blob_protocol.transcript(b"psyche-blob/0 requester", hello, reply.value.nonce)
        get = blob_protocol.Get(self.key.sign(transcript), p.digest)
        await blob_protocol.send_frame(self, get, blob_protocol.Get)

    async def closed_by_provider(self) -> bool:
        with trio.fail_after(DEADLINE):
            try:
                while await self.stream.receive_some(1 << 20):
                    pass
            except trio.BrokenResourceError:
                pass
        return True


async def wait_until(predicate) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(DEADLINE):
        while not predicate():
            await trio.sleep(0.01)


# -- before authentication


async def test_a_control_frame_past_1_kib_is_refused_at_once() -> None:
    async with provider() as p:
        for length in (blob_protocol.MAX_CONTROL_FRAME + 1, 1 << 30):
            raw = await RawRequester.open(p)
            await raw.send_all(struct.pack(">I", length))
            assert await raw.closed_by_provider()
            await raw.aclose()
        assert p.transport.drops.counts["bad request"] == 2
        assert await fetch(p) == p.blob


async def test_a_silent_stranger_is_closed_after_the_handshake_timeout() -> None:
    async with provider(handshake_timeout=0.5) as p:
        raw = await RawRequester.open(p)
        assert await raw.closed_by_provider()
        assert p.transport.drops.counts["timeout"] == 1
        await raw.aclose()


async def test_a_flood_of_strangers_evicts_itself_and_costs_no_memory() -> None:
    async with provider(max_pending=16, max_pending_per_address=16) as p:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            flood = []
            for i in range(200):
                raw = await RawRequester.open(p)
                await raw.send_all(struct.pack(">I", blob_protocol.MAX_CONTROL_FRAME))
                flood.append(raw)
                if i % 50 == 49:  # members are served all along
                    assert await fetch(p) == p.blob
            await wait_until(lambda: p.transport.pending_connections <= 16)
            for raw in flood[:150]:
                assert await raw.closed_by_provider()
            await trio.testing.wait_all_tasks_blocked()
            assert tracemalloc.get_traced_memory()[1] - before < 8 * MIB
        finally:
            tracemalloc.stop()
        assert p.transport.drops.counts["evicted"] >= 184
        for raw in flood:
            await raw.aclose()


# -- serving


async def test_a_requester_that_stops_reading_is_dropped_and_the_blob_released() -> None:
    async with provider(size=32 * MIB, send_stall_timeout=0.5) as p:
        raw = await RawRequester.open(p)
        await raw.ask(p)  # 32 MiB are more than loopback's socket buffers hold
        await wait_until(lambda: p.transport.serving_connections == 1)
        await wait_until(lambda: p.transport.serving_connections == 0)
        assert p.transport.drops.counts["timeout"] == 1
        # The store forgets the blob: nothing of the dropped request keeps it alive.
        watch = weakref.ref(p.blob)
        p.blob = None
        gc.collect()
        assert watch() is None
        await raw.aclose()


async def test_serving_slots_are_capped_and_refusals_say_busy() -> None:
    async with provider(size=32 * MIB, max_connections=1, send_stall_timeout=DEADLINE) as p:
        stuck = await RawRequester.open(p)
        await stuck.ask(p)
        await wait_until(lambda: p.transport.serving_connections == 1)
        with pytest.raises(BlobRefused, match="busy"):
            await fetch(p)
        await stuck.aclose()  # its slot is freed once the provider notices
        await wait_until(lambda: p.transport.serving_connections == 0)
        assert await fetch(p) == p.blob
