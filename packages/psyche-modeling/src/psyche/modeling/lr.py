"""The learning rate a trainer uses at a step, including the cold-start warmup ramp."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Schedule(Protocol):
    def get_lr(self, step: int) -> float: ...


def lr_function(lr: float | Schedule | Callable[[int], float]) -> Callable[[int], float]:
    """The learning rate at a step, from a constant, a schedule (its `get_lr`) or a function."""
    if isinstance(lr, int | float):
        value = float(lr)
        return lambda _step: value
    if isinstance(lr, Schedule):
        return lr.get_lr
    return lr


def get_lr(
    schedule: Schedule, step: int, warmup_lr_between: tuple[int, int] | None = None
) -> float:
    """`schedule.get_lr(step)`, scaled by `(step - start) / (end - start)` inside the warmup bounds.

    The factor is 0 at `start`, so the first step of a cold-start epoch does not move the model.
    """
    factor = 1.0
    if warmup_lr_between is not None:
        start, end = warmup_lr_between
        if start <= step <= end:
            factor = (step - start) / (end - start)
    return schedule.get_lr(step) * factor


def prev_lr(
    schedule: Schedule, step: int, warmup_lr_between: tuple[int, int] | None = None
) -> float:
    """LR of the previous step (of step 0 at step 0): what the lookahead used."""
    return get_lr(schedule, 0 if step == 0 else step - 1, warmup_lr_between)
