"""Which checkpoints a client writes and keeps (a port addition beside upstream's keep-last-N).

Three kinds, decided when an epoch's cooldown checkpoint is due (functional core: no I/O):

* **permanent**: a step policy (`--keep-every`, Levanter's `keep` list: every N steps up to a
  step, then the next interval) keeps the first checkpoint at or after each multiple of N.
  Epochs end at steps the coordinator picks, so a checkpoint is permanent when a multiple of
  N of its interval lies after the previous cooldown's step and at or before its own. Never
  deleted.
* **temporary** (`--temporary-checkpoint-interval`, Levanter's `save_interval`): with a time
  interval set, a non-permanent checkpoint is written only once the interval has passed since
  the last checkpoint written (the run's final one always is); when any newer checkpoint
  lands, the previous temporary one is deleted.
* **recent**: without a time interval, every other checkpoint; upstream's `--keep-steps` newest
  of them stay when `--delete-old-steps` is on.

A checkpoint still uploading is never deleted here: the caller passes the steps it protects and
asks again once they are released.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class KeepPolicyError(ValueError):
    pass


class Kind(enum.Enum):
    permanent = "permanent"
    temporary = "temporary"
    recent = "recent"


@dataclass(frozen=True)
class StepInterval:
    every: int
    until: int | None = None


@dataclass(frozen=True)
class KeepPolicy:
    permanent: tuple[StepInterval, ...] = ()
    temporary_interval_secs: float | None = None
    keep_steps: int = 3
    delete_old_steps: bool = True


@dataclass(frozen=True)
class Kept:
    """A checkpoint this client holds: its step, kind and when it was written (unix seconds)."""

    step: int
    kind: Kind
    written_at: float


def parse_keep_every(text: str) -> tuple[StepInterval, ...]:
    """`EVERY[:UNTIL],...`, e.g. `1000:10000,5000`: every 1000 steps up to step 10000, then
    every 5000. Intervals must be in increasing `until` order and only the last may be open."""
    intervals: list[StepInterval] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        every_text, _, until_text = item.partition(":")
        try:
            every = int(every_text)
            until = int(until_text) if until_text else None
        except ValueError:
            raise KeepPolicyError(f"expected EVERY[:UNTIL], found {item!r}") from None
        if every <= 0 or (until is not None and until < 0):
            raise KeepPolicyError(f"EVERY must be > 0 and UNTIL >= 0, found {item!r}")
        last = intervals[-1].until if intervals else -1
        if last is None or (until is not None and until <= last):
            raise KeepPolicyError(
                f"intervals must be in increasing UNTIL order with only the last open: {text!r}"
            )
        intervals.append(StepInterval(every, until))
    if not intervals:
        raise KeepPolicyError("--keep-every needs at least one EVERY[:UNTIL]")
    return tuple(intervals)


def is_permanent(policy: KeepPolicy, step: int, previous_step: int | None) -> bool:
    """Whether a multiple of an interval's `every` (within that interval's steps) lies in
    `(previous_step, step]`; `previous_step` None: the run's start (step 0)."""
    after = 0 if previous_step is None else previous_step
    low = 0
    for interval in policy.permanent:
        high = step if interval.until is None else min(step, interval.until)
        start = max(after, low)
        if high > start and high // interval.every > start // interval.every:
            return True
        if interval.until is None:
            break
        low = interval.until
    return False


def classify(
    policy: KeepPolicy,
    step: int,
    previous_step: int | None,
    now: float,
    last_written_at: float | None,
    final: bool,
) -> Kind | None:
    """The kind of the checkpoint of `step`, or None when it is not to be written (a temporary
    checkpoint whose interval has not passed; `last_written_at` None: nothing written yet).
    `previous_step`: the step of the previous cooldown (None for the first)."""
    if is_permanent(policy, step, previous_step):
        return Kind.permanent
    interval = policy.temporary_interval_secs
    if interval is None:
        return Kind.recent
    if final or last_written_at is None or now - last_written_at >= interval:
        return Kind.temporary
    return None


def to_delete(policy: KeepPolicy, kept: Sequence[Kept], protected: Iterable[int] = ()) -> list[int]:
    """The steps of `kept` (every checkpoint held, the newest included) to delete now, oldest
    first: temporaries older than the newest checkpoint, and recent ones beyond the newest
    `keep_steps` when `delete_old_steps`. Steps in `protected` are left for later."""
    if not kept:
        return []
    shielded = set(protected)
    newest = max(k.step for k in kept)
    doomed = {k.step for k in kept if k.kind is Kind.temporary and k.step != newest}
    if policy.delete_old_steps:
        recent = sorted(k.step for k in kept if k.kind is Kind.recent)
        excess = len(recent) - policy.keep_steps
        if excess > 0:
            doomed.update(recent[:excess])
    return sorted(doomed - shielded)
