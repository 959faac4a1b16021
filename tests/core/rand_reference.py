"""rand 0.9's `SliceRandom::shuffle` written as plainly as possible: the independent reference
that the vectorized shuffles (`psyche.core.rng.shuffle_permutation`) and the evaluations'
few-shot order are checked against."""

from __future__ import annotations

from typing import TypeVar

from psyche.core.rng import ChaCha8Rng, calculate_bound_u32, random_below

T = TypeVar("T")


def reference_shuffle(items: list[T], rng: ChaCha8Rng) -> list[T]:
    """A shuffled copy of `items`: forward Fisher-Yates whose indices come from
    `IncreasingUniform`, several packed in one draw."""
    items = list(items)
    if len(items) <= 1:
        return items
    n, chunk, remaining = 0, 0, 1
    for i in range(len(items)):
        next_n = n + 1
        if remaining == 0:
            bound, count = calculate_bound_u32(next_n)
            chunk = random_below(rng, bound)
            remaining = count - 1
        else:
            remaining -= 1
        if remaining == 0:
            index = chunk
        else:
            index, chunk = chunk % next_n, chunk // next_n
        n = next_n
        items[i], items[index] = items[index], items[i]
    return items
