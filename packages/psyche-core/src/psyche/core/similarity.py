"""Distances between two f32 vectors, computed in f32 as upstream does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psyche.core.numeric import to_f32


@dataclass(frozen=True)
class DistanceThresholds:
    jaccard_threshold: float
    manhattan_threshold: float
    hamming_threshold: float


def _f32s(values: Sequence[float]) -> list[float]:
    return [to_f32(v) for v in values]


def _check_pair(a: Sequence[float], b: Sequence[float]) -> None:
    if len(a) != len(b):
        raise ValueError("Input arrays must have the same length")
    if not a:
        raise ValueError("Input arrays must not be empty")


def jaccard_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """1 - |b ∩ a| / (|a| + |b \\ a|), counting b's elements with multiplicity (upstream's)."""
    a32, b32 = _f32s(a), _f32s(b)
    members = set(a32)
    # `v == v` keeps NaN out: it equals nothing in Rust, but may be found by identity in a set.
    intersection = sum(1 for v in b32 if v == v and v in members)
    union = len(a32) + len(b32) - intersection
    if union == 0:
        return 0.0
    return to_f32(1.0 - to_f32(to_f32(intersection) / to_f32(union)))


def manhattan_distance(a: Sequence[float], b: Sequence[float]) -> float:
    _check_pair(a, b)
    total = 0.0
    for x, y in zip(_f32s(a), _f32s(b)):
        total = to_f32(total + abs(to_f32(x - y)))
    return total


def hamming_distance(a: Sequence[float], b: Sequence[float]) -> float:
    _check_pair(a, b)
    count = sum(1 for x, y in zip(_f32s(a), _f32s(b)) if x != y)
    return to_f32(to_f32(count) / to_f32(len(a)))


def is_similar(a: Sequence[float], b: Sequence[float], thresholds: DistanceThresholds) -> bool:
    """All three distances within their thresholds; checked in upstream's order."""
    if manhattan_distance(a, b) > to_f32(thresholds.manhattan_threshold):
        return False
    if hamming_distance(a, b) > to_f32(thresholds.hamming_threshold):
        return False
    return not jaccard_distance(a, b) > to_f32(thresholds.jaccard_threshold)
