"""ed25519 keys: what a client signs its challenge response with, and how signatures are checked.

A key file is exactly the 32 raw bytes of the secret key, as upstream writes and reads it.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from psyche.core.atomic_file import write_atomically

SECRET_KEY_LEN = 32
PUBLIC_KEY_LEN = 32
SIGNATURE_LEN = 64


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
    def from_hex(cls, text: str) -> SecretKey:
        try:
            raw = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError("secret key hex is not valid hexadecimal") from None
        return cls.from_bytes(raw)

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
    """Whether `signature` is `public_key`'s signature of `message`; False for any malformed input."""
    try:
        if len(public_key) != PUBLIC_KEY_LEN or len(signature) != SIGNATURE_LEN:
            return False
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(
            bytes(signature), bytes(message)
        )
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True
