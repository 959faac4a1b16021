from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.numeric import U64_MAX
from psyche.core.swap_or_not import compute_shuffled_index, compute_shuffled_indices


def test_compute_shuffled_index_basic() -> None:
    for i in range(10):
        assert compute_shuffled_index(i, 10, bytes(32)) < 10


def test_compute_shuffled_index_deterministic() -> None:
    seed = bytes([1] * 32)
    for i in range(100):
        assert compute_shuffled_index(i, 100, seed) == compute_shuffled_index(i, 100, seed)


def test_compute_shuffled_index_different_seeds() -> None:
    a = compute_shuffled_index(5, 100, bytes([1] * 32))
    b = compute_shuffled_index(5, 100, bytes([2] * 32))
    assert (a, b) == (79, 19)


def test_compute_shuffled_index_out_of_bounds() -> None:
    with pytest.raises(ValueError, match="index < index_count"):
        compute_shuffled_index(10, 10, bytes(32))
    with pytest.raises(ValueError, match="index < index_count"):
        compute_shuffled_index(0, 0, bytes(32))


def test_known_permutations() -> None:
    assert [compute_shuffled_index(i, 10, bytes(32)) for i in range(10)] == [
        9, 7, 4, 1, 8, 0, 5, 6, 3, 2,
    ]  # fmt: skip
    seed = bytes([1] * 32)
    assert [compute_shuffled_index(i, 100, seed) for i in range(20)] == [
        57, 43, 2, 9, 75, 79, 41, 28, 67, 17, 85, 26, 78, 77, 25, 55, 38, 96, 86, 95,
    ]  # fmt: skip
    assert compute_shuffled_indices(10, bytes(32)) == [9, 7, 4, 1, 8, 0, 5, 6, 3, 2]


def test_rejects_bad_seed() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        compute_shuffled_index(0, 10, bytes(31))
    with pytest.raises(ValueError, match="32 bytes"):
        compute_shuffled_indices(10, bytes(33))


def test_huge_counts_stay_in_range() -> None:
    # near 2^64 the u64 sum `pivot + count - index` wraps as in upstream's release build
    for count in (U64_MAX, 2**63 + 1):
        for index in (0, count // 2, count - 1):
            assert 0 <= compute_shuffled_index(index, count, bytes([7] * 32)) < count


@pytest.mark.parametrize("count", [1, 2, 3, 255, 256, 257, 512, 513])
def test_batch_matches_per_index_across_block_edges(count: int) -> None:
    seed = hashlib.sha256(count.to_bytes(4, "little")).digest()
    expected = [compute_shuffled_index(i, count, seed) for i in range(count)]
    assert compute_shuffled_indices(count, seed) == expected
    assert sorted(expected) == list(range(count))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 200), st.binary(min_size=32, max_size=32))
def test_batch_matches_per_index(count: int, seed: bytes) -> None:
    batch = compute_shuffled_indices(count, seed)
    assert batch == [compute_shuffled_index(i, count, seed) for i in range(count)]
    assert sorted(batch) == list(range(count))


def test_batch_of_nothing() -> None:
    assert compute_shuffled_indices(0, bytes(32)) == []
