"""What strangers and members can make a blob provider hold (psyche.network.blob_transport):
handshake messages and control frames capped, pending connections that evict the oldest, a
capped number of blobs being served, handshake and send-stall timeouts, no blob kept in
memory by a requester that stops reading, and sessions that end when idle. Real sockets on
loopback; timeouts shortened."""

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
from psyche.network.secure_channel import SecureStream, StaticKey, secure_outbound
from psyche.network.ticket import EndpointAddr, blob_hash

from ..polling import poll_until

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
        self.secure: SecureStream | None = None

    @classmethod
    async def open(cls, p: Provider) -> RawRequester:
        return cls(await trio.open_tcp_stream("127.0.0.1", p.port))

    async def secure_handshake(self, p: Provider) -> SecureStream:
        self.secure = await secure_outbound(self.stream, StaticKey(self.key), p.key.public_key)
        return self.secure

    async def ask(self, p: Provider) -> None:
        """The secure handshake and the whole signed request, and nothing read after it."""
        secure = await self.secure_handshake(p)
        hello = blob_protocol.Hello(0, self.key.public_key, p.key.public_key, os.urandom(32))
        await blob_protocol.send_frame(secure, hello, blob_protocol.Hello)
        reply = await blob_protocol.read_frame(secure, blob_protocol.ServerHello)
        assert isinstance(reply, blob_protocol.ServerHello.Challenge)
        transcript = blob_protocol.transcript(b"psyche-blob/0 requester", hello, reply.value.nonce)
        get = blob_protocol.Get(self.key.sign(transcript), p.digest)
        await blob_protocol.send_frame(secure, get, blob_protocol.Get)

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
        await poll_until(predicate, 0.01)


# -- before authentication


async def test_a_handshake_message_past_1_kib_is_refused_at_once() -> None:
    async with provider() as p:
        for length in (1025, 0xFFFF):
            raw = await RawRequester.open(p)
            await raw.stream.send_all(struct.pack(">H", length))
            assert await raw.closed_by_provider()
            await raw.stream.aclose()
        assert p.transport.drops.counts["bad request"] == 2
        assert await fetch(p) == p.blob


async def test_a_control_frame_past_1_kib_is_refused_at_once() -> None:
    async with provider() as p:
        for length in (blob_protocol.MAX_CONTROL_FRAME + 1, 1 << 30):
            raw = await RawRequester.open(p)
            secure = await raw.secure_handshake(p)
            await secure.send_all(struct.pack(">I", length))
            assert await raw.closed_by_provider()
            await raw.stream.aclose()
        assert p.transport.drops.counts["bad request"] == 2
        assert await fetch(p) == p.blob


async def test_a_silent_stranger_is_closed_after_the_handshake_timeout() -> None:
    async with provider(handshake_timeout=0.5) as p:
        raw = await RawRequester.open(p)
        assert await raw.closed_by_provider()
        assert p.transport.drops.counts["timeout"] == 1
        await raw.stream.aclose()


async def test_a_flood_of_strangers_evicts_itself_and_costs_no_memory() -> None:
    async with provider(max_pending=16, max_pending_per_address=16) as p:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            flood = []
            for i in range(200):
                raw = await RawRequester.open(p)
                # a handshake message announced and never sent: the connection stays pending
                await raw.stream.send_all(struct.pack(">H", 1024))
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
            await raw.stream.aclose()


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
        await raw.stream.aclose()


async def test_serving_slots_are_capped_and_refusals_say_busy() -> None:
    async with provider(size=32 * MIB, max_connections=1, send_stall_timeout=DEADLINE) as p:
        stuck = await RawRequester.open(p)
        await stuck.ask(p)
        await wait_until(lambda: p.transport.serving_connections == 1)
        with pytest.raises(BlobRefused, match="busy"):
            await fetch(p)
        await stuck.stream.aclose()  # its slot is freed once the provider notices
        await wait_until(lambda: p.transport.serving_connections == 0)
        assert await fetch(p) == p.blob


# -- sessions


async def test_a_session_serves_several_blobs_and_ends_when_idle() -> None:
    async with provider(size=3 * MIB) as p:
        assert p.blob is not None
        session = await requester().open_session(p.addr)
        try:
            for _ in range(3):
                with trio.fail_after(DEADLINE):
                    assert await session.fetch(p.digest, len(p.blob), lambda n: None) == p.blob
            assert session.fetched == 3
            assert p.transport.server.sessions == 1
        finally:
            await session.stream.aclose()
        await wait_until(lambda: p.transport.server.sessions == 0)

    async with provider() as p:
        p.transport.server.idle_timeout = 0.2
        assert p.blob is not None
        session = await requester().open_session(p.addr)
        with trio.fail_after(DEADLINE):
            await session.fetch(p.digest, len(p.blob), lambda n: None)
        # the provider closes a session that asks for nothing more
        await wait_until(lambda: p.transport.server.sessions == 0)
        with pytest.raises(blob_protocol.BlobProtocolError):
            with trio.fail_after(DEADLINE):
                await session.fetch(p.digest, len(p.blob), lambda n: None)
        await session.stream.aclose()


class Gate:
    """A session's stream whose reads wait while the gate is shut (requests still go out)."""

    def __init__(self, stream: blob_protocol.ByteStream) -> None:
        self.stream = stream
        self.open = trio.Event()
        self.open.set()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def receive_into(self, view: memoryview) -> int:
        await self.open.wait()
        return await self.stream.receive_into(view)

    async def aclose(self) -> None:
        await self.stream.aclose()


@asynccontextmanager
async def gated_session(p: Provider) -> AsyncIterator[tuple[blob_protocol.BlobSession, Gate]]:
    """A session past its handshake (one blob fetched) whose replies are held back until the
    gate opens again."""
    assert p.blob is not None
    session = await requester().open_session(p.addr)
    gate = Gate(session.stream)
    session.stream = gate
    try:
        with trio.fail_after(DEADLINE):
            await session.fetch(p.digest, len(p.blob), lambda n: None)
        gate.open = trio.Event()
        yield session, gate
    finally:
        await session.stream.aclose()


async def test_a_session_pipelines_overlapping_fetches() -> None:
    """Overlapping fetches on one session each send their request at once and read their
    reply in turn: all get their bytes over one provider session, and a `NotFound` among them
    keeps the session in step."""
    async with provider(size=3 * MIB) as p, gated_session(p) as (session, gate):
        assert p.blob is not None
        got: dict[int, bytearray | Exception] = {}

        async def one(i: int, digest: bytes) -> None:
            try:
                got[i] = await session.fetch(digest, len(p.blob or b""), lambda n: None)
            except blob_protocol.BlobProtocolError as e:
                got[i] = e

        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                for i, digest in enumerate([p.digest, os.urandom(32), p.digest, p.digest]):
                    nursery.start_soon(one, i, digest)
                    await wait_until(lambda i=i: session.pending == i + 1)
                await trio.sleep(0.05)  # were they serial, the later ones would wait here
                assert session.queued_bytes == 4 * len(p.blob)
                gate.open.set()
        assert got[0] == got[2] == got[3] == p.blob
        assert isinstance(got[1], blob_protocol.BlobNotFound)
        assert session.broken is None
        assert session.fetched == 4
        assert p.transport.server.sessions == 1


async def test_a_failed_fetch_breaks_the_pipeline_behind_it() -> None:
    """A fetch that fails after sending its request leaves its reply unread: the fetches
    behind it fail as `SessionBroken` (to be asked again elsewhere), never with another
    request's bytes, and the session takes no more."""
    async with provider(size=MIB) as p, gated_session(p) as (session, gate):
        assert p.blob is not None
        size = len(p.blob)
        errors: list[Exception] = []

        async def one(expected: int) -> None:
            try:
                await session.fetch(p.digest, expected, lambda n: None)
            except blob_protocol.BlobProtocolError as e:
                errors.append(e)

        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                for i, expected in enumerate([size + 1, size, size]):  # the first: wrong size
                    nursery.start_soon(one, expected)
                    await wait_until(lambda i=i: session.pending == i + 1)
                gate.open.set()
        assert "the ticket says" in str(errors[0])
        assert [type(e) for e in errors[1:]] == [blob_protocol.SessionBroken] * 2
        with pytest.raises(blob_protocol.SessionBroken):
            await session.fetch(p.digest, size, lambda n: None)


async def test_a_later_request_must_carry_the_sessions_signature() -> None:
    async with provider() as p:
        raw = await RawRequester.open(p)
        await raw.ask(p)
        assert raw.secure is not None
        reply = await blob_protocol.read_frame(raw.secure, blob_protocol.Reply)
        assert isinstance(reply, blob_protocol.Reply.Found)
        await blob_protocol.read_exactly(raw.secure, reply.value)
        forged = blob_protocol.Get(bytes(64), p.digest)
        await blob_protocol.send_frame(raw.secure, forged, blob_protocol.Get)
        assert await raw.closed_by_provider()
        assert p.transport.drops.counts["bad request"] == 1
        await raw.stream.aclose()


async def test_a_requester_buffer_grows_as_bytes_arrive() -> None:
    """A ticket may say 4 GiB; nothing near that is reserved before the bytes come."""
    size = 40 * MIB

    class Trickle:
        def __init__(self) -> None:
            self.sent = 0
            self.reserved: list[int] = []

        async def receive_into(self, view: memoryview) -> int:
            if self.sent >= 8 * MIB:
                return 0  # the provider goes away after 8 MiB
            n = min(len(view), MIB)
            self.sent += n
            return n

    trickle = Trickle()
    reserved: list[int] = []
    with pytest.raises(blob_protocol.BlobProtocolError, match="closed after"):
        await blob_protocol.receive_growing(
            trickle,
            size,
            lambda got: reserved.append(got),  # type: ignore[arg-type]
        )
    assert reserved[-1] == 8 * MIB
    tracemalloc.start()
    try:
        with pytest.raises(blob_protocol.BlobProtocolError):
            await blob_protocol.receive_growing(Trickle(), 4 << 30, lambda got: None)  # type: ignore[arg-type]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # at most four times what arrived (8 MiB), never the 4 GiB the "ticket" stated
    assert peak <= 4 * 8 * MIB + MIB
