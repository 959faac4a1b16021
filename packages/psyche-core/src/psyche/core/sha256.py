"""SHA-256 of one byte string, or of several as if they were concatenated."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def sha256v(parts: Iterable[bytes]) -> bytes:
    """Hash of the concatenation of `parts`: no separators, so the split does not matter."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part)
    return hasher.digest()
