"""In-memory content-addressed blob store with named tags and garbage collection of the untagged.

Mirrors iroh-blobs' `MemStore` as upstream uses it: every blob is keyed by the BLAKE3 hash of its
bytes, named tags keep blobs alive (`distro-result_{step}`, `model-{param}`, `model-config`), and a
periodic GC drops blobs no tag points at. A tag may name a hash before its blob arrives, which is
how a download in flight is protected from the collector.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from psyche.network.ticket import blob_hash

logger = logging.getLogger(__name__)

DEFAULT_GC_INTERVAL_SECS = 10.0
GC_INTERVAL_ENV = "BLOBS_GC_INTERVAL_MILLIS"


def gc_interval_from_env(environ: dict[str, str]) -> float:
    """Upstream reads the GC period from `BLOBS_GC_INTERVAL_MILLIS` (default 10 s)."""
    raw = environ.get(GC_INTERVAL_ENV)
    if raw is None:
        return DEFAULT_GC_INTERVAL_SECS
    try:
        return int(raw) / 1000.0
    except ValueError:
        logger.warning("ignoring %s=%r: not an integer", GC_INTERVAL_ENV, raw)
        return DEFAULT_GC_INTERVAL_SECS


Blob = bytes | bytearray
"""Blob bytes; a received blob stays in its receive buffer (never mutated) to avoid a copy."""


@dataclass(frozen=True)
class AddOutcome:
    hash: bytes
    size: int


class BlobStore:
    """Blobs are immutable `bytes`, so serving one is a zero-copy `memoryview`."""

    def __init__(self) -> None:
        self._blobs: dict[bytes, Blob] = {}
        self._tags: dict[str, bytes] = {}

    # blobs ------------------------------------------------------------------------------------

    def add_bytes(self, data: bytes, tag: str | None = None) -> AddOutcome:
        return self.put(blob_hash(data), data, tag)

    def put(self, digest: bytes, data: Blob, tag: str | None = None) -> AddOutcome:
        """Insert bytes whose BLAKE3 hash the caller has just computed or checked."""
        self._blobs.setdefault(digest, data)
        if tag is not None:
            self._tags[tag] = digest
        return AddOutcome(digest, len(data))

    def get(self, digest: bytes) -> Blob | None:
        return self._blobs.get(digest)

    def has(self, digest: bytes) -> bool:
        return digest in self._blobs

    def release(self, tag: str, digest: bytes) -> None:
        """Drop `tag` if it names `digest`, and the blob too unless another tag keeps it (at
        once, not at the next GC): what a download of unusable bytes leaves behind. A blob
        someone else tagged (our own model's, say) stays whatever hash a peer names."""
        if self._tags.get(tag) == digest:
            del self._tags[tag]
        if digest not in self._tags.values():
            self._blobs.pop(digest, None)

    def __len__(self) -> int:
        return len(self._blobs)

    # tags -------------------------------------------------------------------------------------

    def set_tag(self, name: str, digest: bytes) -> None:
        self._tags[name] = digest

    def delete_tag(self, name: str) -> bool:
        return self._tags.pop(name, None) is not None

    def delete_prefix(self, prefix: str) -> int:
        doomed = [name for name in self._tags if name.startswith(prefix)]
        for name in doomed:
            del self._tags[name]
        return len(doomed)

    def tags(self) -> dict[str, bytes]:
        return dict(self._tags)

    # collection -------------------------------------------------------------------------------

    def gc(self) -> int:
        """Drop every blob no tag names; returns how many were dropped."""
        live = set(self._tags.values())
        doomed = [digest for digest in self._blobs if digest not in live]
        for digest in doomed:
            del self._blobs[digest]
        return len(doomed)


def remove_staled_tags(store: BlobStore, target_distro_result_step: int) -> int:
    """Upstream `remove_staled_tags`: drop all `model-` tags and DisTrO tags of older steps.

    A remaining tag's step is the `_`-separated element 1 of its name (`distro-result_{step}`);
    a tag without a parseable step is kept and logged, as upstream (it may leak memory).
    """
    removed = store.delete_prefix("model-")
    for name in list(store.tags()):
        parts = name.split("_")
        if len(parts) < 2:
            logger.warning("Step not present in tag name: %s. This may lead to a memory leak", name)
            continue
        try:
            step = _parse_u32(parts[1])
        except ValueError:
            logger.warning(
                "Distro result step could not be parsed: %s. This may lead to a memory leak",
                parts[1],
            )
            continue
        if step < target_distro_result_step:
            store.delete_tag(name)
            removed += 1
    return removed


def _parse_u32(text: str) -> int:
    # Rust's `str::parse::<u32>`: optional '+', ASCII digits only, in range.
    digits = text[1:] if text.startswith("+") else text
    if not digits or not digits.isascii() or not digits.isdigit():
        raise ValueError(text)
    value = int(digits)
    if value > 0xFFFFFFFF:
        raise ValueError(text)
    return value
