from __future__ import annotations

import threading

import pytest

from psyche.core.running_average import RunningAverage


def test_average_over_window() -> None:
    avg = RunningAverage()
    avg.add_entry_if_needed("loss", 3)
    assert avg.sample("loss") is None  # empty, min_samples 0
    for v in (1.0, 2.0, 3.0):
        avg.push("loss", v)
    assert avg.sample("loss") == 2.0
    avg.push("loss", 10.0)  # evicts 1.0
    assert avg.sample("loss") == 5.0
    assert avg.all_time_pushes("loss") == 4


def test_min_samples() -> None:
    avg = RunningAverage()
    avg.add_entry_if_needed("x", 10, min_samples=2)
    avg.push("x", 1.0)
    avg.push("x", 2.0)
    assert avg.sample("x") is None
    avg.push("x", 3.0)
    assert avg.sample("x") == 2.0


def test_add_entry_only_once() -> None:
    avg = RunningAverage()
    avg.add_entry_if_needed("x", 1)
    avg.push("x", 4.0)
    avg.add_entry_if_needed("x", 10)
    avg.push("x", 6.0)  # still a window of one
    assert avg.sample("x") == 6.0


def test_running_sum_matches_upstream_float_order() -> None:
    avg = RunningAverage()
    avg.add_entry_if_needed("x", 2)
    values = [0.1, 0.2, 0.3, 0.7]
    for v in values:
        avg.push("x", v)
    total = 0.0
    total += 0.1
    total += 0.2
    total -= 0.1
    total += 0.3
    total -= 0.2
    total += 0.7
    assert avg.sample("x") == total / 2


def test_missing_entries() -> None:
    avg = RunningAverage()
    with pytest.raises(KeyError, match="Missing RunningAverage entry"):
        avg.push("nope", 1.0)
    assert avg.sample("nope") is None
    assert avg.all_time_pushes("nope") is None


def test_get_all_averages_and_threads() -> None:
    avg = RunningAverage()
    avg.add_entry_if_needed("a", 1000)
    avg.add_entry_if_needed("b", 5, min_samples=5)

    def worker() -> None:
        for _ in range(200):
            avg.push("a", 1.0)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert avg.all_time_pushes("a") == 800
    assert avg.get_all_averages() == {"a": 1.0, "b": None}
