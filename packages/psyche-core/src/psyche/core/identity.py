"""ed25519 keys: what a client signs its challenge response with, and how signatures are checked.

A key file is exactly the 32 raw bytes of the secret key, as upstream writes and reads it. Keys
typed by people (`RAW_IDENTITY_SECRET_KEY`, allowlists, endpoint ids) are hex, parsed by
`parse_hex_key` alone, so every such input accepts the same forms and fails with the same words.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from psyche.core.atomic_file import write_atomically
from psyche.core.ed25519_strict import (
    PUBLIC_KEY_LEN,
    SIGNATURE_LEN,
    is_ed25519_point,
    verify_strict,
)

SECRET_KEY_LEN = 32

PublicKey = bytes
"""A 32-byte ed25519 public key (upstream `PublicKey` / `EndpointId`)."""

_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def parse_hex_key(text: str, what: str = "the key", length: int = SECRET_KEY_LEN) -> bytes:
    """`length` bytes written as `2 * length` hex digits, optionally `0x`-prefixed, surrounding
    whitespace ignored. A ValueError names `what` and says exactly what is wrong: the first
    character that is not a hex digit (and where), or how many digits there were."""
    body = text.strip()
    offset = 2 if body[:2] in ("0x", "0X") else 0
    for position, char in enumerate(body[offset:], offset + 1):
        if char not in _HEX_DIGITS:
            raise ValueError(
                f"{what} is not hexadecimal: {char!r} at position {position} is not a hex digit"
            )
    digits = len(body) - offset
    if digits != 2 * length:
        raise ValueError(f"{what} must be {2 * length} hex digits ({length} bytes), got {digits}")
    return bytes.fromhex(body[offset:])


class SecretKey:
    __slots__ = ("_key", "_public")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self._public = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def generate(cls) -> SecretKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, raw: bytes) -> SecretKey:
        if len(raw) != SECRET_KEY_LEN:
            raise ValueError(f"an ed25519 secret key is {SECRET_KEY_LEN} bytes, got {len(raw)}")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(raw)))

    @classmethod
    def from_hex(cls, text: str, what: str = "the secret key") -> SecretKey:
        """64 hex digits, optionally `0x`-prefixed (`parse_hex_key`)."""
        return cls.from_bytes(parse_hex_key(text, what, SECRET_KEY_LEN))

    @classmethod
    def read_file(cls, path: str | os.PathLike[str]) -> SecretKey:
        raw = Path(path).read_bytes()
        if len(raw) != SECRET_KEY_LEN:
            raise ValueError(
                f"{path}: a key file holds exactly {SECRET_KEY_LEN} raw bytes, found {len(raw)}"
            )
        return cls.from_bytes(raw)

    def write_file(self, path: str | os.PathLike[str]) -> None:
        """Write the 32 raw bytes atomically (the temporary file is created owner-only)."""
        write_atomically(Path(path), self.to_bytes())

    def to_bytes(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    @property
    def public_key(self) -> bytes:
        return self._public

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(bytes(message))

    def __repr__(self) -> str:
        return f"SecretKey(public={self._public.hex()})"


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Whether `signature` is `public_key`'s signature of `message` under ed25519-dalek's
    `verify_strict` rules, as upstream checks every signature (iroh's `PublicKey::verify`):
    besides RFC 8032's checks, a key or `R` of small order is refused, so no signature verifies
    under a small-order key (`psyche.core.ed25519_strict`). False for any malformed input."""
    return verify_strict(public_key, message, signature)


__all__ = [
    "PUBLIC_KEY_LEN",
    "SECRET_KEY_LEN",
    "SIGNATURE_LEN",
    "PublicKey",
    "SecretKey",
    "is_ed25519_point",
    "parse_hex_key",
    "verify_signature",
]
