from __future__ import annotations

import pytest

from psyche.core.bounded_queue import BoundedQueue


def test_new_queue() -> None:
    queue: BoundedQueue[int] = BoundedQueue(4)
    assert len(list(queue.iter())) == 0
    assert queue.is_empty()


def test_push_within_limit() -> None:
    queue: BoundedQueue[int] = BoundedQueue(4)
    for x in (1, 2, 3):
        queue.push(x)
    assert list(queue.iter()) == [1, 2, 3]


def test_iter() -> None:
    queue: BoundedQueue[int] = BoundedQueue(3)
    for x in (1, 2, 3):
        queue.push(x)
    it = queue.iter()
    assert [next(it), next(it), next(it)] == [1, 2, 3]
    with pytest.raises(StopIteration):
        next(it)


def test_into_iter() -> None:
    queue: BoundedQueue[int] = BoundedQueue(3)
    for x in (1, 2, 3):
        queue.push(x)
    assert list(queue) == [1, 2, 3]


def test_push_to_full_queue() -> None:
    queue: BoundedQueue[int] = BoundedQueue(3)
    for x in (1, 2, 3, 4):
        queue.push(x)
    assert list(queue) == [2, 3, 4]
    assert len(queue) == 3


def test_queue_with_max_len_zero() -> None:
    queue: BoundedQueue[int] = BoundedQueue(0)
    queue.push(1)
    queue.push(2)
    assert len(list(queue)) == 0


def test_queue_with_max_len_one() -> None:
    queue: BoundedQueue[int] = BoundedQueue(1)
    for x in (1, 2, 3):
        queue.push(x)
    assert list(queue) == [3]


def test_negative_max_len_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_len must be >= 0, got -1"):
        BoundedQueue(-1)
