"""The linear congruential generator behind every deterministic shuffle of the coordinator."""

from __future__ import annotations

from psyche.core.constants import LCG_A, LCG_C
from psyche.core.numeric import U64_MAX


class LCG:
    """`state = state * A + C (mod 2^64)`; each draw returns the new state."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        if not 0 <= seed <= U64_MAX:
            raise ValueError(f"LCG seed {seed} is not a u64")
        self.state = seed

    def next_u64(self) -> int:
        self.state = (self.state * LCG_A + LCG_C) & U64_MAX
        return self.state

    def next_range(self, max: int) -> int:
        """A draw reduced modulo `max` (biased, as upstream's; every node draws the same)."""
        if max <= 0:
            # upstream panics on a zero divisor
            raise ValueError(f"LCG.next_range needs max > 0, got {max}")
        return self.next_u64() % max
