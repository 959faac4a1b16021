"""An encrypted, mutually authenticated byte stream: Noise XX keyed by the nodes' ed25519 identities.

The blob side channel runs inside it, so a blob's bytes cross the network encrypted, a peer that
is not a run member is refused before it sends or reads a byte of the blob protocol, and a
stream tampered with on the way fails its authentication tag.

Handshake: `Noise_XX_25519_AESGCM_SHA256` (the `noiseprotocol` package), prologue
`psyche-secure/0`, each handshake message framed by a 2-byte big-endian length:

    initiator -> responder   e
    responder -> initiator   e, ee, s, es, payload(responder identity)
    initiator -> responder   s, se, payload(initiator identity)

A payload is the node's ed25519 public key (32 bytes) and its signature (64 bytes) over
`psyche-noise-static-key:` followed by the sender's static X25519 key, which binds the Noise
static key (and through it the whole handshake) to the node's identity, as libp2p's Noise does.
The static X25519 key is fresh per process. The initiator stops before its last message unless
the responder proved the identity it dialled, so it never reveals itself to an impostor; the
responder closes the connection unless the initiator's identity is allowed (a run member).

Transport: Noise transport messages, each at most 65535 bytes (AES-256-GCM with the keys of
Noise's `Split()`, nonce `0^32 || n` big-endian, empty associated data) behind the same 2-byte
length. They are encrypted and decrypted in place with `cryptography`'s `encrypt_into` and
`decrypt_into`, byte for byte what `noiseprotocol`'s own `encrypt` produces, without its copies.
Several messages are sent per socket write and read per socket read.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from noise.connection import Keypair, NoiseConnection
from noise.exceptions import NoiseHandshakeError, NoiseInvalidMessage, NoiseValueError

from psyche.core.identity import PUBLIC_KEY_LEN, SecretKey, verify_signature
from psyche.network.identity import fmt_short

PROTOCOL_NAME = b"Noise_XX_25519_AESGCM_SHA256"
PROLOGUE = b"psyche-secure/0"
STATIC_KEY_DOMAIN = b"psyche-noise-static-key:"
MAX_NOISE_MESSAGE = 65535
TAG_LENGTH = 16
MAX_PLAINTEXT = MAX_NOISE_MESSAGE - TAG_LENGTH
SIGNATURE_LENGTH = 64
PAYLOAD_LENGTH = PUBLIC_KEY_LEN + SIGNATURE_LENGTH
MAX_HANDSHAKE_MESSAGE = 1024
"""Handshake messages are under 200 bytes; a peer announcing more is refused at once."""
SEND_BATCH_MESSAGES = 4
"""Transport messages encrypted into one buffer and written with one socket call (~256 KiB)."""
RECEIVE_AHEAD = 4 * (MAX_NOISE_MESSAGE + 2)
"""Ciphertext read per socket call: up to this many bytes of whole messages wait decrypted only
when the reader asks (memory per connection: this buffer, the send batch and one message)."""

_LENGTH = struct.Struct(">H")
_WELCOME = b"\x00"
_REFUSED = b"\x01"

AllowCheck = Callable[[bytes], bool]


class SecureChannelError(ConnectionError):
    """The secure channel failed: a broken handshake, a failed tag (a tampered stream) or a
    connection closed inside a message."""


class PeerRefused(SecureChannelError):
    """The peer is not who we dialled, or not allowed to talk to us."""


class StaticKey:
    """This node's Noise static key and the payload binding it to the node's identity."""

    def __init__(self, identity: SecretKey) -> None:
        self.identity = identity
        private = X25519PrivateKey.generate()
        self.private_bytes = private.private_bytes_raw()
        public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.payload = identity.public_key + identity.sign(STATIC_KEY_DOMAIN + public)


def _nonce(n: int) -> bytes:
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "big")


class _Cipher:
    """One direction of a Noise transport: AES-256-GCM with a message counter."""

    __slots__ = ("_aead", "n")

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self.n = 0

    def encrypt_into(self, plaintext: memoryview, out: memoryview) -> None:
        self._aead.encrypt_into(_nonce(self.n), plaintext, None, out)
        self.n += 1

    def decrypt_into(self, ciphertext: memoryview, out: memoryview) -> None:
        try:
            self._aead.decrypt_into(_nonce(self.n), ciphertext, None, out)
        except InvalidTag:
            raise SecureChannelError("a message failed authentication (tampered stream)") from None
        self.n += 1


class SecureStream:
    """A `ByteStream` (`send_all`, `receive_into`, `aclose`) whose bytes travel as Noise
    transport messages; `remote` is the peer's verified ed25519 public key."""

    def __init__(
        self, stream: trio.SocketStream, remote: bytes, send_key: bytes, receive_key: bytes
    ) -> None:
        self.stream = stream
        self.remote = remote
        self._send = _Cipher(send_key)
        self._receive = _Cipher(receive_key)
        self._out: bytearray | None = None
        self._in = bytearray()
        self._in_start = 0
        self._in_end = 0
        self._plain = bytearray()
        self._plain_start = 0
        self._eof = False

    # sending ----------------------------------------------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with memoryview(data) as view:
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            total = len(view)
            if total == 0:
                return
            if self._out is None:
                self._out = bytearray(SEND_BATCH_MESSAGES * (2 + MAX_NOISE_MESSAGE))
            out = memoryview(self._out)
            try:
                start = 0
                while start < total:
                    used = 0
                    for _ in range(SEND_BATCH_MESSAGES):
                        if start >= total:
                            break
                        chunk = view[start : start + MAX_PLAINTEXT]
                        length = len(chunk) + TAG_LENGTH
                        _LENGTH.pack_into(out, used, length)
                        self._send.encrypt_into(chunk, out[used + 2 : used + 2 + length])
                        used += 2 + length
                        start += len(chunk)
                    await self.stream.send_all(out[:used])
            finally:
                out.release()

    # receiving --------------------------------------------------------------------------------

    async def receive_into(self, view: memoryview) -> int:
        """Decrypt into `view`; returns how many bytes (0 at a clean end of stream)."""
        want = len(view)
        if want == 0:
            return 0
        if self._plain_start < len(self._plain):
            n = min(want, len(self._plain) - self._plain_start)
            view[:n] = self._plain[self._plain_start : self._plain_start + n]
            self._plain_start += n
            return n
        while True:
            written = self._decrypt_available(view)
            if written:
                return written
            if self._eof:
                if self._in_end > self._in_start:
                    raise SecureChannelError("connection closed inside a message")
                return 0
            await self._fill()

    def _decrypt_available(self, view: memoryview) -> int:
        """Decrypt whole messages already read: straight into `view` while they fit, else the
        first one into the leftover buffer. Returns the bytes written into `view`."""
        written = 0
        buf = self._in
        with memoryview(buf) as raw:
            while self._in_end - self._in_start >= 2:
                (length,) = _LENGTH.unpack_from(buf, self._in_start)
                if length < TAG_LENGTH:
                    raise SecureChannelError(f"transport message of {length} bytes")
                if self._in_end - self._in_start < 2 + length:
                    break
                body = raw[self._in_start + 2 : self._in_start + 2 + length]
                size = length - TAG_LENGTH
                if written + size <= len(view):
                    self._receive.decrypt_into(body, view[written : written + size])
                    written += size
                elif written:
                    break
                else:
                    self._plain = bytearray(size)
                    self._receive.decrypt_into(body, memoryview(self._plain))
                    n = len(view)
                    view[:] = self._plain[:n]
                    self._plain_start = n
                    written = n
                    self._in_start += 2 + length
                    break
                self._in_start += 2 + length
        return written

    async def _fill(self) -> None:
        buf = self._in
        if self._in_start == self._in_end:
            self._in_start = self._in_end = 0
        elif self._in_start and len(buf) - self._in_end < MAX_NOISE_MESSAGE + 2:
            pending = self._in_end - self._in_start
            buf[:pending] = buf[self._in_start : self._in_end]
            self._in_start, self._in_end = 0, pending
        if not buf:
            buf.extend(bytes(RECEIVE_AHEAD))
        with memoryview(buf) as raw:
            got = await self.stream.socket.recv_into(raw[self._in_end :])
        if got == 0:
            self._eof = True
        self._in_end += got

    async def receive_message(self) -> bytes:
        """One whole transport message (b"" at a clean end of stream)."""
        if self._plain_start < len(self._plain):
            raise SecureChannelError("a message was read in part")
        while True:
            if self._in_end - self._in_start >= 2:
                (length,) = _LENGTH.unpack_from(self._in, self._in_start)
                if length >= TAG_LENGTH and self._in_end - self._in_start >= 2 + length:
                    buf = bytearray(length - TAG_LENGTH)
                    with memoryview(buf) as view:
                        self._decrypt_available(view)
                    return bytes(buf)
            if self._eof:
                if self._in_end > self._in_start:
                    raise SecureChannelError("connection closed inside a message")
                return b""
            await self._fill()

    async def aclose(self) -> None:
        await self.stream.aclose()


# ----------------------------------------------------------------------------------------------
# Handshake


async def _send_message(stream: trio.SocketStream, message: bytes | bytearray) -> None:
    await stream.send_all(_LENGTH.pack(len(message)) + bytes(message))


async def _receive_message(stream: trio.SocketStream) -> bytes:
    header = await _receive_exactly(stream, 2)
    (length,) = _LENGTH.unpack(header)
    if length > MAX_HANDSHAKE_MESSAGE:
        raise SecureChannelError(f"handshake message of {length} bytes")
    return await _receive_exactly(stream, length)


async def _receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise SecureChannelError("connection closed during the secure handshake")
        buf += chunk
    return bytes(buf)


def _new_state(static: StaticKey, *, initiator: bool) -> NoiseConnection:
    noise = NoiseConnection.from_name(PROTOCOL_NAME)
    if initiator:
        noise.set_as_initiator()
    else:
        noise.set_as_responder()
    noise.set_keypair_from_private_bytes(Keypair.STATIC, static.private_bytes)
    noise.set_prologue(PROLOGUE)
    noise.start_handshake()
    return noise


def _remote_identity(handshake: Any, payload: bytes) -> bytes:
    """The ed25519 key a handshake payload proves, checked against the remote static key."""
    if len(payload) != PAYLOAD_LENGTH or handshake.rs is None:
        raise SecureChannelError("malformed identity payload")
    identity, signature = payload[:PUBLIC_KEY_LEN], payload[PUBLIC_KEY_LEN:]
    static = handshake.rs.public.public_bytes(Encoding.Raw, PublicFormat.Raw)
    if not verify_signature(identity, STATIC_KEY_DOMAIN + static, signature):
        raise SecureChannelError("identity signature does not match the Noise static key")
    return bytes(identity)


def _transport_keys(noise: NoiseConnection) -> tuple[bytes, bytes]:
    protocol = noise.noise_protocol
    return protocol.cipher_state_encrypt.k, protocol.cipher_state_decrypt.k


async def secure_outbound(
    stream: trio.SocketStream, static: StaticKey, expected: bytes
) -> SecureStream:
    """The initiator's handshake: raises `PeerRefused` unless the responder is `expected` and
    lets us in, `SecureChannelError` on a broken handshake."""
    noise = _new_state(static, initiator=True)
    handshake = noise.noise_protocol.handshake_state
    try:
        await _send_message(stream, noise.write_message())
        try:
            payload = noise.read_message(await _receive_message(stream))
        except SecureChannelError as e:
            raise PeerRefused(f"the peer closed the secure handshake ({e})") from None
        remote = _remote_identity(handshake, bytes(payload))
        if remote != expected:
            raise PeerRefused(f"dialled {fmt_short(expected)}, reached {fmt_short(remote)}")
        await _send_message(stream, noise.write_message(static.payload))
    except (NoiseHandshakeError, NoiseInvalidMessage, NoiseValueError, ValueError, InvalidTag) as e:
        raise SecureChannelError(f"secure handshake failed: {e}") from e
    send_key, receive_key = _transport_keys(noise)
    secure = SecureStream(stream, remote, send_key, receive_key)
    verdict = await secure.receive_message()
    if verdict != _WELCOME:
        reason = bytes(verdict[1:]).decode("utf-8", "replace") if verdict else "no verdict"
        raise PeerRefused(f"{fmt_short(remote)} refused us: {reason}")
    return secure


async def secure_inbound(
    stream: trio.SocketStream, static: StaticKey, allowed: AllowCheck
) -> SecureStream:
    """The responder's handshake: raises `PeerRefused` for a peer that `allowed` refuses (the
    caller closes the connection), `SecureChannelError` on a broken handshake."""
    noise = _new_state(static, initiator=False)
    handshake = noise.noise_protocol.handshake_state
    try:
        noise.read_message(await _receive_message(stream))
        await _send_message(stream, noise.write_message(static.payload))
        payload = noise.read_message(await _receive_message(stream))
        remote = _remote_identity(handshake, bytes(payload))
    except (NoiseHandshakeError, NoiseInvalidMessage, NoiseValueError, ValueError, InvalidTag) as e:
        raise SecureChannelError(f"secure handshake failed: {e}") from e
    send_key, receive_key = _transport_keys(noise)
    secure = SecureStream(stream, remote, send_key, receive_key)
    if not allowed(remote):
        await secure.send_all(_REFUSED + b"not in allowlist")
        raise PeerRefused(f"{fmt_short(remote)} is not in the allowlist")
    await secure.send_all(_WELCOME)
    return secure


__all__ = [
    "MAX_NOISE_MESSAGE",
    "PeerRefused",
    "SecureChannelError",
    "SecureStream",
    "StaticKey",
    "secure_inbound",
    "secure_outbound",
]
