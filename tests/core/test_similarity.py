from __future__ import annotations

import pytest

from psyche.core.numeric import to_f32
from psyche.core.similarity import (
    DistanceThresholds,
    hamming_distance,
    is_similar,
    jaccard_distance,
    manhattan_distance,
)


def close(value: float, expected: float) -> bool:
    return abs(value - expected) < 1e-6


def test_zero_length_inputs() -> None:
    assert jaccard_distance([], []) == 0.0
    with pytest.raises(ValueError, match="Input arrays must not be empty"):
        manhattan_distance([], [])
    with pytest.raises(ValueError, match="Input arrays must not be empty"):
        hamming_distance([], [])


def test_mismatched_lengths() -> None:
    a, b = [1.0, 2.0, 3.0], [1.0, 2.0]
    assert close(jaccard_distance(a, b), 0.33333334)
    assert jaccard_distance(a, b) == to_f32(1.0 - to_f32(2 / 3))  # f32 all the way
    with pytest.raises(ValueError, match="Input arrays must have the same length"):
        manhattan_distance(a, b)
    with pytest.raises(ValueError, match="Input arrays must have the same length"):
        hamming_distance(a, b)


def test_no_intersection() -> None:
    a, b = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]
    assert jaccard_distance(a, b) == 1.0
    assert manhattan_distance(a, b) == 9.0
    assert hamming_distance(a, b) == 1.0


def test_partial_intersection() -> None:
    a, b = [1.0, 2.0, 5.0], [1.0, 2.0, 3.0]
    assert jaccard_distance(a, b) == 0.5
    assert manhattan_distance(a, b) == 2.0
    assert close(hamming_distance(a, b), 0.333333)
    assert hamming_distance(a, b) == to_f32(1 / 3)


def test_complete_overlap() -> None:
    a = [1.0, 2.0, 3.0]
    assert (jaccard_distance(a, a), manhattan_distance(a, a), hamming_distance(a, a)) == (0, 0, 0)


def test_partial_match_floats() -> None:
    a, b = [0.1, 0.2, 0.3], [0.1, 0.3, 1.0]
    assert jaccard_distance(a, b) == 0.5
    assert close(manhattan_distance(a, b), 0.8)
    # f32 arithmetic: |0.2-0.3| + |0.3-1.0| summed in f32
    assert manhattan_distance(a, b) == to_f32(
        to_f32(0.0 + abs(to_f32(to_f32(0.2) - to_f32(0.3)))) + abs(to_f32(to_f32(0.3) - 1.0))
    )
    assert close(hamming_distance([0.0, 0.0, 0.0], [0.0, 0.0, 1.0]), 0.333333)


def test_no_match_floats() -> None:
    a, b = [0.1, 0.2, 0.3], [0.4, 0.5, 9.1]
    assert jaccard_distance(a, b) == 1.0
    assert close(manhattan_distance(a, b), 9.4)
    assert close(hamming_distance([0.0, 0.0, 0.0], [0.0, 0.0, 9.0]), 0.333333)


def test_some_intersection() -> None:
    a, b = [1.5, 2.5, 3.5, 4.5], [2.5, 3.5, 5.5, 1.1]
    assert close(jaccard_distance(a, b), 0.6666666)
    assert close(manhattan_distance(a, b), 7.4)
    assert hamming_distance([1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 5.0, 1.0]) == 1.0


def test_partial_overlap_large_numbers() -> None:
    a, b = [100.0, 200.0, 300.0, 1000.0], [100.0, 150.0, 250.0, 300.0]
    assert close(jaccard_distance(a, b), 0.6666666)
    assert manhattan_distance(a, b) == 800.0
    assert hamming_distance(a, b) == 0.75


def test_jaccard_counts_b_with_multiplicity_and_nan_never_matches() -> None:
    # upstream quirk: b's repeats each count as intersections, so the distance can go negative
    assert jaccard_distance([1.0], [1.0, 1.0]) == -1.0
    assert jaccard_distance([float("nan")], [float("nan")]) == 1.0  # union 2, intersection 0
    assert jaccard_distance([0.0], [-0.0]) == 0.0


def test_is_similar_complete_match() -> None:
    t = DistanceThresholds(jaccard_threshold=0.1, manhattan_threshold=1.0, hamming_threshold=0.1)
    assert is_similar([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], t)


def test_is_similar_partial_match() -> None:
    t = DistanceThresholds(jaccard_threshold=0.6, manhattan_threshold=3.0, hamming_threshold=0.5)
    assert is_similar([1.0, 2.0, 3.0], [1.0, 2.0, 5.0], t)


def test_is_similar_exceeds_manhattan() -> None:
    t = DistanceThresholds(jaccard_threshold=0.8, manhattan_threshold=2.0, hamming_threshold=0.8)
    assert not is_similar([1.0, 2.0, 3.0], [1.0, 5.0, 7.0], t)


def test_is_similar_exceeds_hamming() -> None:
    t = DistanceThresholds(jaccard_threshold=1.0, manhattan_threshold=10.0, hamming_threshold=0.3)
    assert not is_similar([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], t)


def test_is_similar_exceeds_jaccard() -> None:
    t = DistanceThresholds(jaccard_threshold=0.5, manhattan_threshold=10.0, hamming_threshold=1.0)
    assert not is_similar([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], t)


def test_is_similar_propagates_errors() -> None:
    t = DistanceThresholds(1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="same length"):
        is_similar([1.0], [1.0, 2.0], t)
