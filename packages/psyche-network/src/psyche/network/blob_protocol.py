"""The blob transfer protocol, independent of the byte stream it runs on.

A session authenticates once and then fetches any number of blobs:

    requester -> provider   Hello{version, requester, provider, nonce_r}
    provider  -> requester  Challenge{provider, nonce_p, sig_p}   | Refused(reason)
    requester -> provider   Get{sig_r, hash}
    provider  -> requester  Found(size) + `size` raw bytes        | NotFound | Refused(reason)
    requester -> provider   Get{sig_r, hash}                        (again, on the same session)
    requester -> provider   GetConfig{sig_r}                        (any request of a session)
    provider  -> requester  Config{version, hash, size}             | NotFound | Refused(reason)
    requester -> provider   GetTickets{sig_r, names, pad}           (any request of a session)
    provider  -> requester  Tickets{version, [Ok{hash, size} | Err(SharableModelError)]}
    ...

`GetConfig` asks for the run's model configuration as `/psyche/model-sharing/1` does (the
answer names the version of the model it is of, `ModelTicket.version`), but on the session a
joiner opens beside its libp2p dial, so the answer does not wait behind the libp2p connection's
setup on the provider's event loop; the configuration's bytes then come as any blob, by `Get`.
The two requests are told apart by their frame's length (a `Get` is 96 bytes, a `GetConfig`
64), so `Get` is on the wire as before; a provider older than `GetConfig` cannot decode it and
closes the session, and the requester then asks over libp2p. `NotFound` means the provider
serves no configuration now (the libp2p request says why).

`GetTickets` asks for the tickets of parameters as `/psyche/model-sharing-batch/1` does, one
answer per name in order (a per-name error as on libp2p: unknown parameter, not serving now),
with the version of the model they are of. A ticket here is only the blob's hash and size: the
provider is the session's peer, and the bytes come by `Get` on this or another of its
sessions. Any other length than 64 or 96 is a `GetTickets` (the requester pads one that would
be 96 bytes by a byte).

Control messages are postcard, each framed by a 4-byte big-endian length. Their caps are per
phase, so that what a peer can make a provider read grows only with what it proved:
`MAX_CONTROL_FRAME` (1 KiB) for the handshake and a session's first request (read before the
requester's signature is checked) and for every reply but a ticket batch's;
`MAX_REQUEST_FRAME` (16 KiB, at most `MAX_TICKETS_NAMES` names) for a later request, whose
session's requester is a verified run member (libp2p's batch protocol reads up to 64 KiB of a
member per stream); `MAX_TICKETS_REPLY` for a ticket batch's answer. A requester whose names do
not fit a frame splits them: a session's first `GetTickets` carries what fits in 1 KiB and the
rest follows at once, pipelined. Each side signs a transcript binding both identities and both fresh
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn, Protocol, TypeVar

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
from psyche.network.transmittable import SharableModelError
from psyche.transport import resize_bytearray

PROTOCOL_VERSION = 0
MAX_CONTROL_FRAME = 1024
MAX_REQUEST_FRAME = 16 << 10
"""A request after the session's first (its requester verified): see the module's docstring."""
MAX_TICKETS_NAMES = 256
"""Names in one `GetTickets` (`model_sharing.MAX_BATCH_NAMES` on libp2p)."""
MAX_TICKETS_REPLY = 64 << 10
"""A `Tickets` answer: 256 tickets of 45 bytes and the errors' texts (an unknown name's echoes
it, so it is bounded by the request)."""
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


@wire_struct(frozen=True)
class GetConfig:
    """A request for the model configuration's blob (see the module's docstring)."""

    signature: Annotated[bytes, FixedBytes(64)]


@wire_struct(frozen=True)
class GetTickets:
    """A request for the tickets of `names` (see the module's docstring); `pad` is empty but
    for a frame that would otherwise be a `Get`'s length."""

    signature: Annotated[bytes, FixedBytes(64)]
    names: list[str]
    pad: bytes


GET_CONFIG_BYTES = 64
"""A `GetConfig` frame's length (a `Get`'s is 96): what tells the requests apart."""
GET_BYTES = 96
AnyRequest = Get | GetConfig | GetTickets


@wire_struct(frozen=True)
class ConfigFound:
    """Where the model configuration is: its blob (fetched by `Get`) and the version of the
    model it is of (`SharableModel.version`; None for a model served without one)."""

    version: U64 | None
    hash: Annotated[bytes, FixedBytes(32)]
    size: U64


@wire_struct(frozen=True)
class TicketFound:
    """A blob of the provider's: its hash and size."""

    hash: Annotated[bytes, FixedBytes(32)]
    size: U64


class TicketAnswer(DataEnum):
    """`Result<TicketFound, SharableModelError>`: one name's answer in a `Tickets` reply."""

    Ok = variant(TicketFound)
    Err = variant(SharableModelError)


@wire_struct(frozen=True)
class TicketsFound:
    """A `GetTickets`'s answer: one per name in order, and the version of the model they are
    of (None: none named, or tickets of two models)."""

    version: U64 | None
    answers: list[TicketAnswer]


class Reply(DataEnum):
    Found = variant(U64)
    NotFound = variant()
    Refused = variant(str)
    Config = variant(ConfigFound)
    Tickets = variant(TicketsFound)


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


class NoModelAnswers(BlobSessionEnded):
    """The provider closed the session where its answer to our `GetConfig` or `GetTickets`
    was to begin, having answered every request before it: what a provider older than these
    requests does (it cannot decode them)."""


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


async def send_frame(
    stream: ByteStream, message: Any, tp: Any, cap: int = MAX_CONTROL_FRAME
) -> None:
    await stream.send_all(encode_frame(message, tp, cap))


def encode_frame(message: Any, tp: Any, cap: int = MAX_CONTROL_FRAME) -> bytes:
    body = to_bytes(message, tp)
    if len(body) > cap:
        raise BlobProtocolError(f"control frame of {len(body)} bytes exceeds {cap}")
    return _struct.pack(">I", len(body)) + body


async def read_frame(stream: ByteStream, tp: Any, cap: int = MAX_CONTROL_FRAME) -> Any:
    return _decode(await _read_frame_body(stream, cap), tp)


async def read_request(stream: ByteStream, cap: int = MAX_CONTROL_FRAME) -> AnyRequest:
    """A requester's next request, told apart by its frame's length (at most `cap` bytes)."""
    body = await _read_frame_body(stream, cap)
    tp = {GET_CONFIG_BYTES: GetConfig, GET_BYTES: Get}.get(len(body), GetTickets)
    request: AnyRequest = _decode(body, tp)
    if isinstance(request, GetTickets) and len(request.names) > MAX_TICKETS_NAMES:
        raise BlobProtocolError(f"{len(request.names)} names in one request")
    return request


def tickets_request(signature: bytes, names: list[str]) -> GetTickets:
    """`GetTickets` for `names`, padded when its frame would be a `Get`'s length."""
    request = GetTickets(signature, names, b"")
    if len(to_bytes(request, GetTickets)) == GET_BYTES:
        request = GetTickets(signature, names, b"\0")
    return request


async def _read_frame_body(stream: ByteStream, cap: int) -> bytearray:
    (length,) = _struct.unpack(">I", await read_exactly(stream, 4))
    if length > cap:
        raise BlobProtocolError(f"control frame of {length} bytes exceeds {cap}")
    try:
        return await read_exactly(stream, length)
    except BlobSessionEnded:
        raise StreamClosed("connection closed inside a control frame") from None


def _decode(body: bytearray, tp: Any) -> Any:
    try:
        return from_bytes(body, tp)
    except PostcardError as e:
        raise BlobProtocolError(f"malformed {getattr(tp, '__name__', tp)}: {e}") from e


# ----------------------------------------------------------------------------------------------
# Provider side


BlobLookup = Callable[[bytes], "bytes | bytearray | None"]
AllowCheck = Callable[[bytes], bool]


class ModelAnswers(Protocol):
    """What a provider answers `GetConfig` and `GetTickets` from (the model it shares)."""

    async def config(self) -> ConfigFound | None:
        """Where the model configuration is, or None when it serves none now."""
        ...

    async def tickets(self, names: list[str]) -> TicketsFound:
        """One answer per name, in order."""
        ...


@dataclass(frozen=True)
class Request:
    """A verified request: who asks, what (`message`), and the signature every later request
    of the session must repeat."""

    requester: bytes
    message: AnyRequest
    signature: bytes

    @property
    def hash(self) -> bytes | None:
        """The blob a `Get` asks for (None for the other requests)."""
        return bytes(self.message.hash) if isinstance(self.message, Get) else None


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
    if request is None or request.hash is None:
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
    `MAX_CONTROL_FRAME` bytes and send one; nothing else (a stranger one frame: its `Hello`)."""
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
        first = await read_request(stream)
        if not verify_signature(
            hello.requester, transcript(_REQUESTER_DOMAIN, hello, nonce), first.signature
        ):
            await send_frame(stream, Reply.Refused("bad signature"), Reply)
            return None
    return Request(bytes(hello.requester), first, bytes(first.signature))


async def next_request(stream: ByteStream, session: Request) -> Request | None:
    """The session's next request (of at most `MAX_REQUEST_FRAME` bytes: its requester is
    verified), or None when the requester ends the session. A request without the session's
    signature is a protocol error."""
    try:
        request = await read_request(stream, MAX_REQUEST_FRAME)
    except BlobSessionEnded:
        return None
    if not hmac.compare_digest(bytes(request.signature), session.signature):
        raise BlobProtocolError("a later request of the session is not signed by its requester")
    return Request(session.requester, request, session.signature)


async def send_model_answer(
    stream: ByteStream,
    answers: ModelAnswers,
    request: GetConfig | GetTickets,
    *,
    stall_timeout: float | None = None,
) -> None:
    """Answer `GetConfig` (`Config`, or `NotFound`) or `GetTickets` (`Tickets`, at most
    `MAX_TICKETS_REPLY` bytes)."""
    if isinstance(request, GetConfig):
        found = await answers.config()
        frame = encode_frame(Reply.NotFound() if found is None else Reply.Config(found), Reply)
    else:
        tickets = await answers.tickets(list(request.names))
        frame = encode_frame(Reply.Tickets(tickets), Reply, MAX_TICKETS_REPLY)
    with trio.fail_after(stall_timeout if stall_timeout is not None else math.inf):
        await stream.send_all(frame)


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
_T = TypeVar("_T")
_TICKETS_OVERHEAD = 4 + 64 + 3 + 2
"""A `GetTickets` frame's bytes beside its names (length prefix, signature, the names'
count, padding) at most."""


def _string_bytes(name: str) -> int:
    """A name's bytes in postcard (its length's varint and its UTF-8)."""
    data = len(name.encode())
    return data + (data.bit_length() + 6) // 7 if data else 1


def _cause(group: BaseExceptionGroup) -> BaseException:
    """What failed a group of a session's requests: its first error other than the
    cancellations and `SessionBroken`s it caused (the first of those when there is none), so
    the caller sees why the session broke (`NoModelAnswers` among them)."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        error = pending.pop(0)
        if isinstance(error, BaseExceptionGroup):
            pending.extend(error.exceptions)
        else:
            leaves.append(error)
    caused = (trio.Cancelled, SessionBroken)
    return next(
        (e for e in leaves if not isinstance(e, caused)),
        next((e for e in leaves if not isinstance(e, trio.Cancelled)), leaves[0]),
    )


def _unexpected(reply: Reply, what: str) -> NoReturn:
    if isinstance(reply, Reply.Refused):
        raise BlobRefused(f"provider refused the request: {reply.value}")
    raise BlobProtocolError(f"{what} answered by {reply!r}")


class SessionBroken(StreamClosed):
    """An earlier request of a pipelined session failed, so the replies behind it can no longer
    be read in step: the request was never answered (ask again on another session)."""


def _merged_version(parts: list[TicketsFound]) -> int | None:
    """The version of a split `GetTickets`'s parts taken together: the one every part with at
    least one ticket (`TicketAnswer.Ok`) names, None when they name two (tickets of two models,
    refused by the requester as today) or when no part has a ticket. A part whose answers are
    all errors names no version (a provider notes a version only for the names it answered
    Ok), so it does not count: as one unsplit batch's reply, the version is that of the
    tickets."""
    versions = {
        part.version
        for part in parts
        if any(isinstance(answer, TicketAnswer.Ok) for answer in part.answers)
    }
    return next(iter(versions)) if len(versions) == 1 else None


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
        self.requests = 0
        """Requests sent so far (the first is read before the provider checks who asks)."""
        self._send_lock = trio.Lock()
        self._turns: deque[trio.Event] = deque()

    async def fetch(self, digest: bytes, expected_size: int, on_progress: ProgressFn) -> bytearray:
        """Fetch and verify one blob; raises a `BlobProtocolError` on any deviation."""
        buf = await self._exchange(
            lambda signature: Get(signature, digest),
            lambda: self._read_reply(expected_size, on_progress),
            expected_size,
        )
        actual = await verify_hash(buf)
        if actual != digest:
            self.broken = "the provider sent corrupted bytes"
            raise HashMismatch(
                f"received bytes hash to {actual.hex()[:10]}, expected {digest.hex()[:10]}"
            )
        self.fetched += 1
        return buf

    async def config(self, timeout: float) -> ConfigFound | None:
        """Where the provider's model configuration is (`GetConfig`), or None when it serves
        none now; a provider older than `GetConfig` closes the session (`StreamClosed`). The
        reply must come within `timeout` seconds of the request's turn."""
        return await self._exchange(GetConfig, lambda: self._read_config(timeout), 0)

    async def tickets(self, names: list[str], timeout: float) -> TicketsFound:
        """The tickets of `names` (`GetTickets`), one answer per name in order, split into
        as many requests as the frame caps need (all sent at once, so the split costs no
        round trip), each reply within `timeout` seconds of its turn. The version is the one
        the parts with a ticket name (`_merged_version`), as one batch's would be. A provider
        older than `GetTickets` closes the session (`StreamClosed`)."""
        parts = self._split(names)
        found: list[TicketsFound | None] = [None] * len(parts)

        async def ask(index: int, part: list[str], sent: trio.Event | None = None) -> None:
            found[index] = await self._exchange(
                lambda signature: tickets_request(signature, part),
                lambda: self._read_tickets(len(part), timeout),
                0,
                sent,
            )

        if len(parts) == 1:
            await ask(0, parts[0])
        else:
            try:
                async with trio.open_nursery() as nursery:
                    for index, part in enumerate(parts):
                        sent = trio.Event()
                        nursery.start_soon(ask, index, part, sent)
                        await sent.wait()  # in order: the first fits the first frame's cap
            except BaseExceptionGroup as group:
                raise _cause(group) from None
        replies = [f for f in found if f is not None]
        return TicketsFound(_merged_version(replies), [a for f in replies for a in f.answers])

    def _split(self, names: list[str]) -> list[list[str]]:
        """`names` in parts whose `GetTickets` frames fit their caps: the session's first
        request `MAX_CONTROL_FRAME`, later ones `MAX_REQUEST_FRAME` and `MAX_TICKETS_NAMES`.
        A name too long for a later request's frame is a `BlobProtocolError`."""
        parts: list[list[str]] = []
        cap = MAX_CONTROL_FRAME if self.requests == 0 else MAX_REQUEST_FRAME
        size = _TICKETS_OVERHEAD
        for name in names:
            entry = _string_bytes(name)
            if not parts or size + entry > cap or len(parts[-1]) == MAX_TICKETS_NAMES:
                if parts:
                    cap = MAX_REQUEST_FRAME
                if _TICKETS_OVERHEAD + entry > cap:
                    raise BlobProtocolError(f"a parameter name of {len(name)} characters")
                parts.append([])
                size = _TICKETS_OVERHEAD
            parts[-1].append(name)
            size += entry
        return parts

    async def _exchange(
        self,
        request: Callable[[bytes], AnyRequest],
        read_reply: Callable[[], Awaitable[_T]],
        expected_size: int,
        sent: trio.Event | None = None,
    ) -> _T:
        """Send `request(signature)` at once (after the handshake, on the session's first),
        set `sent`, and read its reply in turn (`read_reply`)."""
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
                    frame = request(self.signature)
                    cap = MAX_CONTROL_FRAME if self.requests == 0 else MAX_REQUEST_FRAME
                    await send_frame(self.stream, frame, type(frame), cap)
                    self.requests += 1
            if sent is not None:
                sent.set()
            await turn.wait()
            if self.broken is not None:
                raise SessionBroken(self.broken)
            return await read_reply()
        except BaseException as e:
            if started and self.broken is None and not isinstance(e, BlobNotFound):
                self.broken = f"an earlier request of the session failed: {e!r}"
            raise
        finally:
            self.pending -= 1
            self.queued_bytes -= expected_size
            self._hand_on(turn)

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
                case other:
                    _unexpected(other, "a blob request")
        if size != expected_size:
            raise BlobProtocolError(
                f"provider offers {size} bytes, the ticket says {expected_size}"
            )
        return await receive_growing(self.stream, size, on_progress)

    async def _read_model_answer(self, cap: int = MAX_CONTROL_FRAME) -> Reply:
        """The reply to a `GetConfig` or `GetTickets`; `NoModelAnswers` when the provider
        closed the session instead."""
        try:
            reply: Reply = await read_frame(self.stream, Reply, cap)
        except NoModelAnswers:
            raise
        except BlobSessionEnded as e:
            raise NoModelAnswers(f"the provider closed the session on a model request: {e}") from e
        return reply

    async def _read_config(self, timeout: float) -> ConfigFound | None:
        with trio.fail_after(timeout):
            match await self._read_model_answer():
                case Reply.Config(found):
                    answer: ConfigFound = found
                    return answer
                case Reply.NotFound():
                    return None
                case other:
                    _unexpected(other, "a configuration request")

    async def _read_tickets(self, names: int, timeout: float) -> TicketsFound:
        with trio.fail_after(timeout):
            match await self._read_model_answer(MAX_TICKETS_REPLY):
                case Reply.Tickets(found):
                    answer: TicketsFound = found
                case other:
                    _unexpected(other, "a ticket request")
        if len(answer.answers) != names:
            raise BlobProtocolError(f"{len(answer.answers)} tickets for {names} names")
        return answer

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
