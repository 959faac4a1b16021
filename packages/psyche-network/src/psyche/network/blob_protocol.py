"""The blob transfer protocol, independent of the byte stream it runs on.

A session authenticates once and then fetches any number of blobs:

    requester -> provider   Hello{version, requester, provider, nonce_r}
    provider  -> requester  Challenge{provider, nonce_p, sig_p}   | Refused(reason)
    requester -> provider   Get{sig_r, hash}
    provider  -> requester  Found(size) + `size` raw bytes        | NotFound | Refused(reason)
    requester -> provider   Get{sig_r, hash}                        (again, on the same session)
    ...

Control messages are postcard, each framed by a 4-byte big-endian length and capped at
`MAX_CONTROL_FRAME` bytes. Each side signs a transcript binding both identities and both fresh
nonces, so neither a replayed handshake nor a third party can pose as a run member; every later
`Get` of the session carries the same requester signature. The streams it runs on are the
encrypted side channel (`secure_channel`) or a libp2p stream (`blob_transport`), both of which
authenticate and encrypt on their own; the signed transcript keeps this protocol's guarantees
whatever carries it. Integrity of the bytes comes from the BLAKE3 hash the requester checks
before anything uses them. A requester's buffer grows as the bytes arrive, so a ticket's stated
size is never allocated before its bytes come.
"""

from __future__ import annotations

import hmac
import math
import os
import struct as _struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import trio

from psyche.core.identity import SecretKey, verify_signature
from psyche.core.serde import (
    U8,
    U64,
    DataEnum,
    FixedBytes,
    PostcardError,
    from_bytes,
    to_bytes,
    variant,
)
from psyche.core.serde import struct as wire_struct
from psyche.network.ticket import blob_hash
from psyche.transport import resize_bytearray

PROTOCOL_VERSION = 0
MAX_CONTROL_FRAME = 1024
NONCE_LENGTH = 32
RECEIVE_CHUNK = 1 << 20
SEND_CHUNK = 4 << 20  # with a stall timeout, each chunk must leave within it
HANDSHAKE_TIMEOUT_SECS = 5.0
FIRST_RECEIVE_BYTES = 1 << 20
INLINE_HASH_BYTES = 256 << 10
"""Blobs at least this large are hashed in a worker thread (BLAKE3 releases the GIL), so the
event loop keeps moving other transfers' bytes meanwhile."""
GROWTH = 4

_PROVIDER_DOMAIN = b"psyche-blob/0 provider"
_REQUESTER_DOMAIN = b"psyche-blob/0 requester"


# ----------------------------------------------------------------------------------------------
# Messages


@wire_struct(frozen=True)
class Hello:
    version: U8
    requester: Annotated[bytes, FixedBytes(32)]
    provider: Annotated[bytes, FixedBytes(32)]
    nonce: Annotated[bytes, FixedBytes(32)]


@wire_struct(frozen=True)
class Challenge:
    provider: Annotated[bytes, FixedBytes(32)]
    nonce: Annotated[bytes, FixedBytes(32)]
    signature: Annotated[bytes, FixedBytes(64)]


class ServerHello(DataEnum):
    Challenge = variant(Challenge)
    Refused = variant(str)


@wire_struct(frozen=True)
class Get:
    signature: Annotated[bytes, FixedBytes(64)]
    hash: Annotated[bytes, FixedBytes(32)]


class Reply(DataEnum):
    Found = variant(U64)
    NotFound = variant()
    Refused = variant(str)


def transcript(domain: bytes, hello: Hello, provider_nonce: bytes) -> bytes:
    return domain + hello.requester + hello.provider + hello.nonce + provider_nonce


# ----------------------------------------------------------------------------------------------
# Errors


class BlobProtocolError(Exception):
    """The peer broke the protocol (bad frame, bad signature, wrong identity...)."""


class BlobRefused(BlobProtocolError):
    """The provider refused us (not in its allowlist, wrong provider id...)."""


class BlobNotFound(BlobProtocolError):
    """The provider does not have the blob."""


class HashMismatch(BlobProtocolError):
    """Downloaded bytes do not hash to the ticket's hash: the provider is faulty or hostile."""


class StreamClosed(BlobProtocolError):
    """The stream ended before the protocol did: the path broke or the peer went away."""


class BlobSessionEnded(StreamClosed):
    """The peer closed the stream between two messages."""


# ----------------------------------------------------------------------------------------------
# Streams


class ByteStream(Protocol):
    """The little a blob transfer needs from a connection; `receive_into` returns 0 at EOF."""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...

    async def receive_into(self, view: memoryview) -> int: ...

    async def aclose(self) -> None: ...


async def read_exactly(stream: ByteStream, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await stream.receive_into(view[got:])
        if k == 0:
            if got == 0:
                raise BlobSessionEnded("connection closed")
            raise StreamClosed(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


async def send_frame(stream: ByteStream, message: Any, tp: Any) -> None:
    body = to_bytes(message, tp)
    if len(body) > MAX_CONTROL_FRAME:
        raise BlobProtocolError(f"control frame of {len(body)} bytes exceeds {MAX_CONTROL_FRAME}")
    await stream.send_all(_struct.pack(">I", len(body)) + body)


async def read_frame(stream: ByteStream, tp: Any) -> Any:
    (length,) = _struct.unpack(">I", await read_exactly(stream, 4))
    if length > MAX_CONTROL_FRAME:
        raise BlobProtocolError(f"control frame of {length} bytes exceeds {MAX_CONTROL_FRAME}")
    try:
        body = await read_exactly(stream, length)
    except BlobSessionEnded:
        raise StreamClosed("connection closed inside a control frame") from None
    try:
        return from_bytes(body, tp)
    except PostcardError as e:
        raise BlobProtocolError(f"malformed {getattr(tp, '__name__', tp)}: {e}") from e


# ----------------------------------------------------------------------------------------------
# Provider side


BlobLookup = Callable[[bytes], "bytes | bytearray | None"]
AllowCheck = Callable[[bytes], bool]


@dataclass(frozen=True)
class Request:
    """A verified request: who asks, for which blob, and the signature every later `Get` of the
    session must repeat."""

    requester: bytes
    hash: bytes
    signature: bytes


async def serve_one(
    stream: ByteStream,
    identity: SecretKey,
    lookup: BlobLookup,
    allowed: AllowCheck,
    *,
    handshake_timeout: float = HANDSHAKE_TIMEOUT_SECS,
    send_stall_timeout: float | None = None,
) -> tuple[bytes, int] | None:
    """Answer one request; returns (requester, bytes sent) when a blob was served."""
    request = await accept_request(stream, identity, allowed, timeout=handshake_timeout)
    if request is None:
        return None
    sent = await send_blob(stream, lookup, request.hash, stall_timeout=send_stall_timeout)
    return None if sent is None else (request.requester, sent)


async def accept_request(
    stream: ByteStream,
    identity: SecretKey,
    allowed: AllowCheck,
    *,
    timeout: float = HANDSHAKE_TIMEOUT_SECS,
) -> Request | None:
    """The provider's side of the handshake, all of it within `timeout` seconds: the first
    signed request of an allowed peer, or None once a refusal is sent.

    Before this returns, a peer can make the provider read two control frames of at most
    `MAX_CONTROL_FRAME` bytes and send one; nothing else."""
    with trio.fail_after(timeout):
        hello: Hello = await read_frame(stream, Hello)
        if hello.version != PROTOCOL_VERSION:
            await send_frame(
                stream, ServerHello.Refused(f"unsupported version {hello.version}"), ServerHello
            )
            return None
        if hello.provider != identity.public_key:
            await send_frame(stream, ServerHello.Refused("wrong provider"), ServerHello)
            return None
        if not allowed(hello.requester):
            await send_frame(stream, ServerHello.Refused("not in allowlist"), ServerHello)
            return None
        nonce = os.urandom(NONCE_LENGTH)
        signature = identity.sign(transcript(_PROVIDER_DOMAIN, hello, nonce))
        await send_frame(
            stream,
            ServerHello.Challenge(Challenge(identity.public_key, nonce, signature)),
            ServerHello,
        )
        get: Get = await read_frame(stream, Get)
        if not verify_signature(
            hello.requester, transcript(_REQUESTER_DOMAIN, hello, nonce), get.signature
        ):
            await send_frame(stream, Reply.Refused("bad signature"), Reply)
            return None
    return Request(bytes(hello.requester), bytes(get.hash), bytes(get.signature))


async def next_request(stream: ByteStream, session: Request) -> bytes | None:
    """The hash of the session's next `Get`, or None when the requester ends the session.
    A `Get` without the session's signature is a protocol error."""
    try:
        get: Get = await read_frame(stream, Get)
    except BlobSessionEnded:
        return None
    if not hmac.compare_digest(bytes(get.signature), session.signature):
        raise BlobProtocolError("a later request of the session is not signed by its requester")
    return bytes(get.hash)


async def send_blob(
    stream: ByteStream, lookup: BlobLookup, digest: bytes, *, stall_timeout: float | None = None
) -> int | None:
    """`Found(size)` and the blob's bytes (how many), or `NotFound` (None). With a
    `stall_timeout`, a requester that reads nothing for that long is dropped
    (`trio.TooSlowError`): it cannot keep the blob in memory by never reading it."""
    blob = lookup(digest)
    with trio.fail_after(stall_timeout if stall_timeout is not None else math.inf):
        if blob is None:
            await send_frame(stream, Reply.NotFound(), Reply)
            return None
        await send_frame(stream, Reply.Found(len(blob)), Reply)
    with memoryview(blob) as view:
        if stall_timeout is None:
            await stream.send_all(view)
        else:
            for start in range(0, len(view), SEND_CHUNK):
                with trio.fail_after(stall_timeout):
                    await stream.send_all(view[start : start + SEND_CHUNK])
    return len(blob)


# ----------------------------------------------------------------------------------------------
# Requester side


ProgressFn = Callable[[int], None]


class SessionBroken(StreamClosed):
    """An earlier request of a pipelined session failed, so the replies behind it can no longer
    be read in step: the request was never answered (ask again on another session)."""


class BlobSession:
    """The requester's end of one session with `provider`: the first `fetch` runs the
    handshake, later ones reuse it.

    Fetches may overlap (a pipeline): each sends its `Get` at once and then waits its turn to
    read its reply, so the provider, which reads the next `Get` as soon as it has sent a blob,
    never waits a round trip between blobs. The protocol needs nothing new for this: the
    provider still sends one blob at a time per session and reads each `Get` (a 100-byte frame)
    only after the last blob left, so a waiting request costs it nothing but socket buffer.
    Replies come in request order; a fetch that raises or is cancelled after sending its `Get`
    leaves its reply unread, so the session is broken from then on: the fetches behind it raise
    `SessionBroken` (close the session). `NotFound` keeps the session in step. The hash is
    checked after the turn is handed on, so the next blob's bytes are read meanwhile."""

    def __init__(self, stream: ByteStream, identity: SecretKey, provider: bytes) -> None:
        self.stream = stream
        self.identity = identity
        self.provider = provider
        self.signature: bytes | None = None
        self.fetched = 0
        """Blobs fetched so far: 0 until the first one is complete."""
        self.pending = 0
        """Fetches whose `Get` is sent (or about to be) and whose reply is not read yet."""
        self.queued_bytes = 0
        """The bytes those fetches expect."""
        self.broken: str | None = None
        """Why the session can no longer be used (None while it can)."""
        self._send_lock = trio.Lock()
        self._turns: deque[trio.Event] = deque()

    async def fetch(self, digest: bytes, expected_size: int, on_progress: ProgressFn) -> bytearray:
        """Fetch and verify one blob; raises a `BlobProtocolError` on any deviation."""
        if self.broken is not None:
            raise SessionBroken(self.broken)
        self.pending += 1
        self.queued_bytes += expected_size
        turn = trio.Event()
        started = False
        try:
            async with self._send_lock:
                if self.broken is not None:
                    raise SessionBroken(self.broken)
                with trio.fail_after(HANDSHAKE_TIMEOUT_SECS):
                    started = True  # from here a failure leaves the stream out of step
                    if self.signature is None:
                        self.signature = await self._handshake()
                    self._turns.append(turn)
                    if len(self._turns) == 1:
                        turn.set()
                    await send_frame(self.stream, Get(self.signature, digest), Get)
            await turn.wait()
            if self.broken is not None:
                raise SessionBroken(self.broken)
            buf = await self._read_reply(expected_size, on_progress)
        except BaseException as e:
            if started and self.broken is None and not isinstance(e, BlobNotFound):
                self.broken = f"an earlier request of the session failed: {e!r}"
            raise
        finally:
            self.pending -= 1
            self.queued_bytes -= expected_size
            self._hand_on(turn)
        actual = await verify_hash(buf)
        if actual != digest:
            self.broken = "the provider sent corrupted bytes"
            raise HashMismatch(
                f"received bytes hash to {actual.hex()[:10]}, expected {digest.hex()[:10]}"
            )
        self.fetched += 1
        return buf

    async def handshake(self) -> None:
        """Authenticate now, ahead of the first fetch (which otherwise does it)."""
        async with self._send_lock:
            if self.broken is not None:
                raise SessionBroken(self.broken)
            if self.signature is None:
                try:
                    with trio.fail_after(HANDSHAKE_TIMEOUT_SECS):
                        self.signature = await self._handshake()
                except BaseException as e:
                    self.broken = f"the handshake failed: {e!r}"
                    raise

    def _hand_on(self, turn: trio.Event) -> None:
        """Give the next fetch its turn to read (all of them, to fail, once broken)."""
        if turn in self._turns:
            self._turns.remove(turn)
        if self.broken is not None:
            for waiting in self._turns:
                waiting.set()
        elif self._turns:
            self._turns[0].set()

    async def _read_reply(self, expected_size: int, on_progress: ProgressFn) -> bytearray:
        with trio.fail_after(HANDSHAKE_TIMEOUT_SECS):
            match await read_frame(self.stream, Reply):
                case Reply.Found(size):
                    pass
                case Reply.NotFound():
                    raise BlobNotFound("provider does not have the blob")
                case Reply.Refused(reason):
                    raise BlobRefused(f"provider refused the request: {reason}")
        if size != expected_size:
            raise BlobProtocolError(
                f"provider offers {size} bytes, the ticket says {expected_size}"
            )
        return await receive_growing(self.stream, size, on_progress)

    async def _handshake(self) -> bytes:
        nonce = os.urandom(NONCE_LENGTH)
        hello = Hello(PROTOCOL_VERSION, self.identity.public_key, self.provider, nonce)
        await send_frame(self.stream, hello, Hello)
        match await read_frame(self.stream, ServerHello):
            case ServerHello.Refused(reason):
                raise BlobRefused(f"provider refused the handshake: {reason}")
            case ServerHello.Challenge(challenge):
                pass
        if challenge.provider != self.provider or not verify_signature(
            self.provider,
            transcript(_PROVIDER_DOMAIN, hello, challenge.nonce),
            challenge.signature,
        ):
            raise BlobProtocolError("provider failed to prove its identity")
        return self.identity.sign(transcript(_REQUESTER_DOMAIN, hello, challenge.nonce))


async def fetch_one(
    stream: ByteStream,
    identity: SecretKey,
    provider: bytes,
    digest: bytes,
    expected_size: int,
    on_progress: ProgressFn,
) -> bytearray:
    """Fetch and verify one blob on a fresh stream (a session of one)."""
    return await BlobSession(stream, identity, provider).fetch(digest, expected_size, on_progress)


async def receive_growing(stream: ByteStream, size: int, on_progress: ProgressFn) -> bytearray:
    """Exactly `size` bytes into a buffer that grows as they arrive: reserved at
    `FIRST_RECEIVE_BYTES` and grown fourfold when full (without writing the new tail, see
    `psyche.transport`), so a ticket's size, however large, is not allocated before its bytes
    come; at most four times what arrived is ever reserved."""
    buf = bytearray()
    resize_bytearray(buf, min(size, FIRST_RECEIVE_BYTES))
    got = 0
    while got < size:
        if got == len(buf):
            resize_bytearray(buf, min(size, GROWTH * len(buf)))
        with memoryview(buf) as view:
            k = await stream.receive_into(view[got : min(len(buf), got + RECEIVE_CHUNK)])
        if k == 0:
            raise StreamClosed(f"provider closed after {got} of {size} bytes")
        got += k
        on_progress(got)
    return buf


async def verify_hash(data: bytearray) -> bytes:
    """BLAKE3 of a received blob, off the event loop when large."""
    if len(data) < INLINE_HASH_BYTES:
        return blob_hash(data)
    return await trio.to_thread.run_sync(blob_hash, data)
