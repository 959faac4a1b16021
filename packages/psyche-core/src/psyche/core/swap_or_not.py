"""Swap-or-not shuffle (as in Ethereum's committee selection): a seeded permutation of 0..count.

`compute_shuffled_index` gives one index's position; `compute_shuffled_indices` gives every
index's position at once, bit-identical but far cheaper: each round's pivot and source hashes are
computed once per round instead of once per index.
"""

from __future__ import annotations

import hashlib

from psyche.core.constants import SHUFFLE_ROUND_COUNT
from psyche.core.numeric import U64_MAX


def _check(index_count: int, seed: bytes) -> None:
    if len(seed) != 32:
        raise ValueError(f"swap-or-not seed must be 32 bytes, got {len(seed)}")
    if not 0 <= index_count <= U64_MAX:
        raise ValueError(f"index_count {index_count} is not a u64")


def _source_input(prefix: bytes, position: int) -> bytes:
    # The low 4 bytes of the little-endian u64 `position / 256`.
    return prefix + ((position >> 8) & 0xFFFF_FFFF).to_bytes(4, "little")


def compute_shuffled_index(index: int, index_count: int, seed: bytes) -> int:
    """Position of `index` in the permutation of `0..index_count` chosen by `seed`."""
    _check(index_count, seed)
    if not 0 <= index < index_count:
        # upstream: `assert!(index < index_count)`
        raise ValueError(f"assertion failed: index < index_count ({index} >= {index_count})")
    sha256 = hashlib.sha256
    current = index
    for current_round in range(SHUFFLE_ROUND_COUNT):
        prefix = seed + bytes((current_round,))
        pivot = int.from_bytes(sha256(prefix).digest()[:8], "little") % index_count
        # u64 arithmetic: wraps (release build) only when index_count is near 2^64.
        flip = ((pivot + index_count - current) & U64_MAX) % index_count
        position = max(current, flip)
        source = sha256(_source_input(prefix, position)).digest()
        byte = source[(position % 256) // 8]
        if (byte >> (position % 8)) & 1:
            current = flip
    return current


def compute_shuffled_indices(index_count: int, seed: bytes) -> list[int]:
    """`[compute_shuffled_index(i, index_count, seed) for i in range(index_count)]`, fast.

    Each round is a fixed map of the current position, so all positions advance together; the
    round's source hashes are computed once for each block of 256 positions.
    """
    _check(index_count, seed)
    n = index_count
    if n == 0:
        return []
    if n >= 1 << 62:
        raise ValueError(f"index_count {n} is too large to list every position")
    sha256 = hashlib.sha256
    current = list(range(n))
    blocks = (n + 255) // 256
    for current_round in range(SHUFFLE_ROUND_COUNT):
        prefix = seed + bytes((current_round,))
        pivot = int.from_bytes(sha256(prefix).digest()[:8], "little") % n
        # Block b of `sources` holds the hash for positions 256*b .. 256*b+255, so the bit for
        # position p is bit p % 8 of byte p // 8.
        sources = b"".join(
            sha256(_source_input(prefix, block << 8)).digest() for block in range(blocks)
        )
        nxt: list[int] = []
        append = nxt.append
        for c in current:
            flip = (pivot - c) % n
            position = c if c > flip else flip
            append(flip if (sources[position >> 3] >> (position & 7)) & 1 else c)
        current = nxt
    return current
