from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.deterministic_shuffle import deterministic_shuffle
from psyche.core.numeric import U64_MAX


def shuffled(items: list[int], seed: int) -> list[int]:
    out = list(items)
    deterministic_shuffle(out, seed)
    return out


def test_deterministic_shuffle_same_seed() -> None:
    assert shuffled([1, 2, 3, 4, 5], 42) == shuffled([1, 2, 3, 4, 5], 42)


def test_deterministic_shuffle_different_seeds() -> None:
    assert shuffled([1, 2, 3, 4, 5], 42) != shuffled([1, 2, 3, 4, 5], 43)


def test_deterministic_shuffle_all_elements_present() -> None:
    out = shuffled([1, 2, 3, 4, 5], 42)
    assert sorted(out) == [1, 2, 3, 4, 5]


def test_deterministic_shuffle_empty_vec() -> None:
    assert shuffled([], 42) == []


def test_deterministic_shuffle_single_element() -> None:
    assert shuffled([1], 42) == [1]


def test_deterministic_shuffle_large_vec() -> None:
    original = list(range(1, 1000))
    out = shuffled(original, 42)
    assert out != original
    assert sorted(out) == original


def test_deterministic_shuffle_known_outputs() -> None:
    assert shuffled([1, 2, 3, 4, 5], 42) == [2, 5, 3, 1, 4]
    assert shuffled([1, 2, 3, 4, 5], 43) == [3, 5, 1, 2, 4]
    assert shuffled(list(range(10)), 0) == [6, 3, 8, 5, 0, 9, 2, 1, 4, 7]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(), max_size=60), st.integers(0, U64_MAX))
def test_deterministic_shuffle_is_a_permutation(items: list[int], seed: int) -> None:
    out = shuffled(items, seed)
    assert sorted(out) == sorted(items)
    assert out == shuffled(items, seed)
