"""ChaCha8Rng and rand 0.9's algorithms, against golden vectors and straightforward reference
loops (the vectorized versions must agree with them exactly)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.rng import (
    ChaCha8Rng,
    apply_backward_swaps,
    apply_forward_swaps,
    backward_fisher_yates_permutation,
    calculate_bound_u32,
    random_below,
    random_below_many,
    random_range_inclusive,
    shuffle_permutation,
)

from .rand_reference import reference_shuffle

SEED_1_TO_32 = bytes(range(1, 33))
SEED_42 = bytes([42] * 32)


def reference_backward(items: list[int], rng: ChaCha8Rng) -> list[int]:
    items = list(items)
    for i in range(len(items) - 1, 0, -1):
        j = random_range_inclusive(rng, 0, i)
        items[i], items[j] = items[j], items[i]
    return items


def test_chacha8_golden_words() -> None:
    rng = ChaCha8Rng(SEED_1_TO_32)
    assert [rng.next_u32() for _ in range(4)] == [2947029050, 31235183, 2985115977, 1313868222]
    # eSTREAM ChaCha8 with the all-zero key: keystream 3e00ef2f 895f40d6 ...
    zero = ChaCha8Rng(bytes(32))
    assert [zero.next_u32() for _ in range(4)] == [0x2FEF003E, 0xD6405F89, 0xE8B85B7F, 0xA1A5091F]


def test_chacha8_block_boundaries_and_peek() -> None:
    a, b = ChaCha8Rng(SEED_42), ChaCha8Rng(SEED_42)
    singles = [a.next_u32() for _ in range(5000)]
    assert b.peek_words(3).tolist() == singles[:3]
    chunks = np.concatenate([b.words(17), b.words(1), b.words(4982)])
    assert chunks.tolist() == singles


def test_shuffle_golden_vectors() -> None:
    assert shuffle_permutation(10, ChaCha8Rng(SEED_1_TO_32)).tolist() == [
        3,
        1,
        2,
        6,
        7,
        9,
        8,
        4,
        5,
        0,
    ]
    assert shuffle_permutation(10, ChaCha8Rng(SEED_42)).tolist() == [3, 1, 8, 4, 5, 6, 0, 9, 2, 7]
    assert shuffle_permutation(4, ChaCha8Rng(SEED_42)).tolist() == [3, 1, 2, 0]
    assert shuffle_permutation(1, ChaCha8Rng(SEED_42)).tolist() == [0]
    assert shuffle_permutation(0, ChaCha8Rng(SEED_42)).tolist() == []


def test_calculate_bound() -> None:
    assert calculate_bound_u32(1) == (479001600, 12)  # 12! fits in u32, 13! does not
    assert calculate_bound_u32(65535) == (65535 * 65536, 2)
    assert calculate_bound_u32(65536) == (65536, 1)


def test_random_below_many_matches_scalar_draws() -> None:
    gen = np.random.default_rng(7)
    for case in range(12):
        seed = gen.bytes(32)
        if case % 3 == 0:
            bounds = gen.integers(1, 2**32 - 1, size=2000, dtype=np.uint64)  # many second draws
        elif case % 3 == 1:
            bounds = gen.integers(1, 40, size=2000).astype(np.uint64)
        else:
            bounds = np.arange(2**32 - 2000, 2**32 - 1, dtype=np.uint64)[::-1]
        fast = random_below_many(ChaCha8Rng(seed), bounds)
        rng = ChaCha8Rng(seed)
        slow = [random_below(rng, int(b)) for b in bounds]
        assert fast.tolist() == slow
        assert all(v < b for v, b in zip(slow, bounds.tolist()))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 10**6), max_size=80))
def test_pointer_jumping_equals_performing_the_swaps(raw: list[int]) -> None:
    index = [r % (i + 1) for i, r in enumerate(raw)]
    forward = list(range(len(index)))
    for i, j in enumerate(index):
        forward[i], forward[j] = forward[j], forward[i]
    backward = list(range(len(index)))
    for i in range(len(index) - 1, 0, -1):
        backward[i], backward[index[i]] = backward[index[i]], backward[i]
    assert apply_forward_swaps(np.array(index, dtype=np.int64)).tolist() == forward
    assert apply_backward_swaps(np.array(index, dtype=np.int64)).tolist() == backward


@settings(max_examples=30, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.integers(0, 300))
def test_shuffles_match_reference_small(seed: bytes, n: int) -> None:
    assert shuffle_permutation(n, ChaCha8Rng(seed)).tolist() == reference_shuffle(
        list(range(n)), ChaCha8Rng(seed)
    )
    assert backward_fisher_yates_permutation(n, ChaCha8Rng(seed)).tolist() == reference_backward(
        list(range(n)), ChaCha8Rng(seed)
    )


def test_shuffle_matches_reference_across_the_single_index_boundary() -> None:
    # Beyond 65536 items every draw picks one index: the vectorized path takes over there.
    n = 70_000
    assert shuffle_permutation(n, ChaCha8Rng(SEED_42)).tolist() == reference_shuffle(
        list(range(n)), ChaCha8Rng(SEED_42)
    )
    assert backward_fisher_yates_permutation(n, ChaCha8Rng(SEED_1_TO_32)).tolist() == (
        reference_backward(list(range(n)), ChaCha8Rng(SEED_1_TO_32))
    )


def test_independent_instances_agree_bit_for_bit() -> None:
    a = shuffle_permutation(200_000, ChaCha8Rng(SEED_42))
    b = shuffle_permutation(200_000, ChaCha8Rng(SEED_42))
    assert np.array_equal(a, b)
    assert np.array_equal(np.sort(a), np.arange(200_000))
    assert not np.array_equal(a, shuffle_permutation(200_000, ChaCha8Rng(SEED_1_TO_32)))
