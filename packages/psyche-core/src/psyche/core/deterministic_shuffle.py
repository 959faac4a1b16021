"""Fisher-Yates shuffle driven by `LCG`: the order trainers receive data in each round."""

from __future__ import annotations

from typing import Any

from psyche.core.lcg import LCG


def deterministic_shuffle(items: list[Any], seed: int) -> None:
    """Shuffle `items` in place; the draw order (i from the end down to 1) is part of the result."""
    rng = LCG(seed)
    for i in range(len(items) - 1, 0, -1):
        j = rng.next_range(i + 1)
        items[i], items[j] = items[j], items[i]
