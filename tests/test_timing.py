"""The tests' timer scaling (tests/timing.py): what it stretches and what it leaves alone."""

from __future__ import annotations

import pytest

from . import timing
from .timing import TIMER_FIELDS, Deadline, scaled_timer, scaled_timers

CONFIG = {
    "warmup_time": 8,
    "cooldown_time": 3,
    "epoch_time": 12,
    "max_round_train_time": 10,
    "round_witness_time": 1,
    "waiting_for_members_extra_time": 1,
    "min_clients": 1,
    "init_min_clients": 2,
    "total_steps": 10,
}


def test_only_timers_stretch_rounded_up_to_whole_seconds() -> None:
    assert scaled_timers(CONFIG, 1.0) == CONFIG
    stretched = scaled_timers(CONFIG, 1.5)
    assert {k: stretched[k] for k in TIMER_FIELDS} == {
        "warmup_time": 12,
        "cooldown_time": 5,
        "epoch_time": 18,
        "max_round_train_time": 15,
        "round_witness_time": 2,
        "waiting_for_members_extra_time": 2,
    }
    assert {k: stretched[k] for k in ("min_clients", "init_min_clients", "total_steps")} == {
        "min_clients": 1,
        "init_min_clients": 2,
        "total_steps": 10,
    }
    assert scaled_timer(10, 1.1) == 11  # 11.000000000000002 is still 11 s


@pytest.mark.parametrize("scale", [1.0, 1.01, 1.37, 2.0, 3.3, 7.9])
def test_the_order_of_timers_is_kept(scale: float) -> None:
    """The coordinator's checks compare timers (warmup < epoch, train < epoch): whole seconds at
    least one apart stay apart, as the factor is at least 1."""
    for a in range(1, 40):
        assert scaled_timer(a, scale) < scaled_timer(a + 1, scale)


def test_the_factor_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    timing.time_scale.cache_clear()
    try:
        monkeypatch.setenv(timing.SCALE_ENV, "2.5")
        assert timing.time_scale() == 2.5
        assert scaled_timers({"epoch_time": 12}) == {"epoch_time": 30}
        timing.time_scale.cache_clear()
        monkeypatch.setenv(timing.SCALE_ENV, "0")
        with pytest.raises(ValueError, match="positive"):
            timing.time_scale()
    finally:
        timing.time_scale.cache_clear()


def test_the_measured_factor_is_between_1_and_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(timing.SCALE_ENV, raising=False)
    for step, factor in ((0.001, 1.0), (timing.REFERENCE_STEP_SECONDS * 2, 2.0), (60.0, 4.0)):
        timing.time_scale.cache_clear()
        monkeypatch.setattr(timing, "tiny_step_seconds", lambda step=step: step)
        try:
            assert timing.time_scale() == pytest.approx(factor)
        finally:
            timing.time_scale.cache_clear()
    assert timing.MAX_SCALE == 4.0


def test_a_deadline_stretches_only_once_its_own_time_is_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[bool] = []

    def scale() -> float:
        measured.append(True)
        return 100.0

    monkeypatch.setattr(timing, "time_scale", scale)
    deadline = Deadline(60)
    assert not deadline.expired()
    assert not measured
    deadline.start -= 61  # as if 61 s had passed
    assert not deadline.expired()
    assert measured
    deadline.start -= 6000
    assert deadline.expired()
