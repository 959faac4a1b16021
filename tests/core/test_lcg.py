from __future__ import annotations

import itertools

import pytest

from psyche.core.constants import LCG_A, LCG_C
from psyche.core.lcg import LCG
from psyche.core.numeric import U64_MAX


def test_lcg_initialization() -> None:
    assert LCG(12345).state == 12345


def test_lcg_next() -> None:
    lcg = LCG(12345)
    assert lcg.next_u64() != lcg.next_u64()


def test_lcg_sequence() -> None:
    lcg = LCG(12345)
    sequence = [lcg.next_u64() for _ in range(5)]
    assert len(sequence) == 5
    assert all(a != b for a, b in itertools.pairwise(sequence))


def test_lcg_reproducibility() -> None:
    a, b = LCG(12345), LCG(12345)
    for _ in range(100):
        assert a.next_u64() == b.next_u64()


def test_lcg_next_range() -> None:
    lcg = LCG(12345)
    for _ in range(1000):
        assert lcg.next_range(10) < 10


def test_lcg_next_range_distribution() -> None:
    lcg = LCG(12345)
    counts = [0] * 10
    for _ in range(10000):
        counts[lcg.next_range(10)] += 1
    assert all(count > 0 for count in counts)


def test_lcg_next_range_edge_cases() -> None:
    lcg = LCG(12345)
    assert lcg.next_range(1) == 0
    assert lcg.next_range(U64_MAX) < U64_MAX


def test_lcg_constants() -> None:
    assert (LCG_A, LCG_C) == (6364136223846793005, 1442695040888963407)


def test_lcg_known_sequences() -> None:
    lcg = LCG(12345)
    assert [lcg.next_u64() for _ in range(5)] == [
        2021368500568277588,
        4895494634720187923,
        16336879138292273062,
        15416634109187857277,
        6006832857977215304,
    ]
    lcg = LCG(0)
    assert [lcg.next_u64() for _ in range(3)] == [
        1442695040888963407,
        1876011003808476466,
        11166244414315200793,
    ]


def test_lcg_wraps_at_u64() -> None:
    lcg = LCG(U64_MAX)
    assert lcg.next_u64() == (U64_MAX * LCG_A + LCG_C) % 2**64


def test_lcg_rejects_zero_range_and_bad_seed() -> None:
    with pytest.raises(ValueError, match="max > 0"):
        LCG(1).next_range(0)
    with pytest.raises(ValueError, match="LCG seed -1 is not a u64"):
        LCG(-1)
    with pytest.raises(ValueError, match=f"LCG seed {2**64} is not a u64"):
        LCG(2**64)
