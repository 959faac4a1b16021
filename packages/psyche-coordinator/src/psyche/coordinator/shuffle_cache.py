"""Swap-or-not positions for committee selection, with each seed's hashes computed once.

Upstream recomputes `compute_shuffled_index` (two SHA-256 per round, 90 rounds) for every witness
and every health check. All clients of a round share one seed, and for up to 256 nodes every
round needs only two hashes whatever the index, so `ShuffleRounds` hashes once per (seed, count)
and then answers each index with integer arithmetic only. Once many indices of one seed are asked
for (a client checking every node's health), it computes the whole permutation at once: for up
to 256 nodes a round is a byte-to-byte map, applied to all positions by `bytes.translate`.
Results are bit-identical to `psyche.core.compute_shuffled_index` (tested); the cache is a memo
of a pure function.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any

from psyche.core.constants import SHUFFLE_ROUND_COUNT
from psyche.core.swap_or_not import compute_shuffled_index

# Beyond this many nodes the per-round source hashes (one per 256 positions) are not worth
# precomputing; such counts fall back to the per-index function.
MAX_PRECOMPUTED_COUNT = 4096
# After this many single lookups of one permutation of at most 256 nodes, the whole permutation
# is cheaper (one table costs about as much as 45 single positions).
TABLE_AFTER_LOOKUPS = 48
_CACHE_SIZE = 128
_IDENTITY = bytes(range(256))
_BIT_CHARS = bytes.maketrans(b"01", b"\x00\x01")


class ShuffleRounds:
    """The 90 rounds of one swap-or-not permutation of `0..count`: pivots and source bits."""

    __slots__ = ("_lookups", "_rounds", "_single_block", "_table", "count", "seed")

    def __init__(self, seed: bytes, count: int) -> None:
        if len(seed) != 32:
            raise ValueError(f"swap-or-not seed must be 32 bytes, got {len(seed)}")
        if not 0 < count <= MAX_PRECOMPUTED_COUNT:
            raise ValueError(f"count {count} is outside 1..={MAX_PRECOMPUTED_COUNT}")
        self.seed = seed
        self.count = count
        sha256 = hashlib.sha256
        from_bytes = int.from_bytes
        blocks = (count + 255) // 256
        block_suffixes = [block.to_bytes(4, "little") for block in range(blocks)]
        rounds: list[tuple[int, Any]] = []
        for current_round in range(SHUFFLE_ROUND_COUNT):
            prefix = seed + bytes((current_round,))
            pivot = from_bytes(sha256(prefix).digest()[:8], "little") % count
            # Source block b covers positions 256b..256b+255; as a little-endian integer, bit
            # p % 256 is bit p % 8 of byte (p % 256) / 8, which is how upstream reads it.
            sources = tuple(
                from_bytes(sha256(prefix + suffix).digest(), "little") for suffix in block_suffixes
            )
            rounds.append((pivot, sources[0] if blocks == 1 else sources))
        self._rounds = tuple(rounds)
        self._single_block = blocks == 1
        self._table: bytes | None = None
        self._lookups = 0

    def position(self, index: int) -> int:
        """`compute_shuffled_index(index, count, seed)`."""
        n = self.count
        if not 0 <= index < n:
            raise ValueError(f"assertion failed: index < index_count ({index} >= {n})")
        if self._table is not None:
            return self._table[index]
        if self._single_block:
            self._lookups += 1
            if self._lookups > TABLE_AFTER_LOOKUPS:
                return self._permutation()[index]
        current = index
        # count <= 4096, so upstream's u64 `pivot + count - current` cannot wrap: the flip is
        # `(pivot - current) mod count`.
        if self._single_block:
            for pivot, bits in self._rounds:
                flip = pivot - current
                if flip < 0:
                    flip += n
                if (bits >> (current if current > flip else flip)) & 1:
                    current = flip
            return current
        for pivot, sources in self._rounds:
            flip = pivot - current
            if flip < 0:
                flip += n
            position = current if current > flip else flip
            if (sources[position >> 8] >> (position & 255)) & 1:
                current = flip
        return current

    def positions(self) -> list[int]:
        """Every index's position, in index order."""
        if self._single_block:
            return list(self._permutation())
        return [self.position(i) for i in range(self.count)]

    def _permutation(self) -> bytes:
        """All positions at once (count <= 256): byte i of the result is index i's position.

        In a round, index c moves to `flip(c) = (pivot - c) mod n` when the source bit at
        `max(c, flip(c))` is set. As c runs over 0..n, that maximum runs over four contiguous
        ranges (up or down), so the round's selected bits are four slices of its 256 source
        bits; the round's map is then a byte table applied with `bytes.translate`.
        """
        if self._table is not None:
            return self._table
        n = self.count
        identity = _IDENTITY[:n]
        identity_int = int.from_bytes(identity, "big")
        state = identity
        for pivot, bits in self._rounds:
            source = format(bits, "0256b")[::-1].encode().translate(_BIT_CHARS)  # [p] = bit p
            flips = _IDENTITY[pivot::-1] + _IDENTITY[n - 1 : pivot : -1]  # [c] = flip(c)
            low = (pivot + 1) // 2  # c < low: flip(c) = pivot - c > c
            high = (n + pivot + 1) // 2  # pivot < c < high: flip(c) = n + pivot - c > c
            selected = (
                source[pivot - low + 1 : pivot + 1][::-1]
                + source[low : pivot + 1]
                + source[n + pivot - high + 1 : n][::-1]
                + source[high:n]
            )
            # 0xFF where the bit is set: choose flip(c) there, c elsewhere
            mask = int.from_bytes(selected, "big") * 0xFF
            chosen = identity_int ^ ((identity_int ^ int.from_bytes(flips, "big")) & mask)
            state = state.translate(chosen.to_bytes(n, "big") + _IDENTITY[n:])
        self._table = state
        return state


@lru_cache(maxsize=_CACHE_SIZE)
def shuffle_rounds(seed: bytes, count: int) -> ShuffleRounds:
    return ShuffleRounds(seed, count)


def shuffled_index(index: int, count: int, seed: bytes) -> int:
    """`psyche.core.compute_shuffled_index`, memoizing the seed's hashes for small counts."""
    if 0 < count <= MAX_PRECOMPUTED_COUNT:
        return shuffle_rounds(bytes(seed), count).position(index)
    return compute_shuffled_index(index, count, seed)
