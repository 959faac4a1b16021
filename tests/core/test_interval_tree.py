from __future__ import annotations

import pytest

from psyche.core.interval_tree import ClosedInterval, IntervalTree
from psyche.core.serde import from_bytes, to_bytes


def test_interval_new() -> None:
    interval = ClosedInterval.new(1, 5)
    assert (interval.start, interval.end) == (1, 5)


def test_interval_new_invalid() -> None:
    with pytest.raises(ValueError, match="Start must be less than or equal to end"):
        ClosedInterval.new(5, 1)


def test_interval_contains() -> None:
    interval = ClosedInterval.new(1, 5)
    assert all(interval.contains(p) for p in (1, 3, 5))
    assert not interval.contains(0)
    assert not interval.contains(6)


def test_interval_overlaps() -> None:
    a, b, c = ClosedInterval.new(1, 5), ClosedInterval.new(3, 7), ClosedInterval.new(6, 8)
    assert a.overlaps(b)
    assert b.overlaps(a)
    assert b.overlaps(c)
    assert not a.overlaps(c)


def test_interval_tree_insert() -> None:
    tree: IntervalTree[str] = IntervalTree()
    tree.insert(ClosedInterval.new(1, 5), "A")
    tree.insert(ClosedInterval.new(7, 10), "B")
    with pytest.raises(ValueError, match="Overlapping interval"):
        tree.insert(ClosedInterval.new(3, 6), "C")


def test_interval_tree_get() -> None:
    tree: IntervalTree[str] = IntervalTree()
    tree.insert(ClosedInterval.new(1, 5), "A")
    tree.insert(ClosedInterval.new(7, 10), "B")
    assert tree.get(3) == "A"
    assert tree.get(8) == "B"
    assert tree.get(6) is None
    assert tree.get(0) is None
    assert tree.get(11) is None


def test_interval_tree_remove() -> None:
    tree: IntervalTree[str] = IntervalTree()
    tree.insert(ClosedInterval.new(1, 5), "A")
    tree.insert(ClosedInterval.new(7, 10), "B")
    assert tree.remove(ClosedInterval.new(1, 5)) == "A"
    assert tree.remove(ClosedInterval.new(1, 5)) is None
    assert tree.get(3) is None
    assert tree.get(8) == "B"


def test_interval_tree_iter() -> None:
    tree: IntervalTree[str] = IntervalTree()
    tree.insert(ClosedInterval.new(7, 10), "B")
    tree.insert(ClosedInterval.new(1, 5), "A")
    assert list(tree.iter()) == [(ClosedInterval(1, 5), "A"), (ClosedInterval(7, 10), "B")]


def test_remove_quirk_drops_same_start_entry() -> None:
    tree: IntervalTree[str] = IntervalTree()
    tree.insert(ClosedInterval.new(1, 5), "A")
    assert tree.remove(ClosedInterval.new(1, 3)) is None
    assert tree.get(2) is None
    assert len(tree) == 0


def test_insert_edges() -> None:
    tree: IntervalTree[str] = IntervalTree()
    tree.insert(ClosedInterval.new(5, 5), "A")
    for bad in [(5, 5), (4, 5), (5, 9), (0, 10)]:
        with pytest.raises(ValueError, match="Overlapping interval"):
            tree.insert(ClosedInterval.new(*bad), "X")
    tree.insert(ClosedInterval.new(6, 9), "B")
    tree.insert(ClosedInterval.new(0, 4), "C")
    assert [v for _, v in tree] == ["C", "A", "B"]
    tree.clear()
    assert len(tree) == 0
    assert tree.get(5) is None


def test_display() -> None:
    assert str(ClosedInterval(3, 3)) == "3"
    assert str(ClosedInterval(1, 5)) == "[1, 5]"
    tree: IntervalTree[str] = IntervalTree()
    assert str(tree) == "IntervalTree {}"
    tree.insert(ClosedInterval.new(1, 5), "A")
    tree.insert(ClosedInterval.new(6, 6), "B")
    tree.insert(ClosedInterval.new(7, 9), "A")
    assert str(tree) == "IntervalTree { A: [1, 5], [7, 9], B: 6 }"


def test_ordering_and_wire() -> None:
    items = [ClosedInterval(3, 4), ClosedInterval(1, 9), ClosedInterval(1, 2)]
    assert sorted(items) == [ClosedInterval(1, 2), ClosedInterval(1, 9), ClosedInterval(3, 4)]
    assert to_bytes(ClosedInterval(1, 300)) == bytes([1, 0xAC, 0x02])
    # the wire does not check start <= end (upstream's derive does not either)
    assert from_bytes(bytes([5, 1]), ClosedInterval) == ClosedInterval(5, 1)
