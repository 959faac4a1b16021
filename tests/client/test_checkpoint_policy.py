"""Keep policies (`psyche.client.checkpoints.keep_policy`): permanent step intervals, temporary checkpoints
by time, upstream's keep-last-N, and checkpoints still uploading left alone."""

from __future__ import annotations

import pytest

from psyche.client.checkpoints.keep_policy import (
    KeepPolicy,
    KeepPolicyError,
    Kept,
    Kind,
    StepInterval,
    classify,
    is_permanent,
    parse_keep_every,
    to_delete,
)


def test_parse_keep_every() -> None:
    assert parse_keep_every("1000:10000,5000") == (
        StepInterval(1000, 10000),
        StepInterval(5000, None),
    )
    assert parse_keep_every(" 50 ") == (StepInterval(50, None),)
    for bad in ("", "0", "x", "10:5:3", "100,200:1000", "100:1000,50:500", "-1"):
        with pytest.raises(KeepPolicyError):
            parse_keep_every(bad)


def test_permanent_is_the_first_checkpoint_at_or_after_each_multiple() -> None:
    policy = KeepPolicy(permanent=parse_keep_every("100:300,250"))
    # epochs end at steps the coordinator picks: 39, 79, 119, ...
    steps = list(range(39, 800, 40))
    previous = [None, *steps[:-1]]
    permanent = [s for s, p in zip(steps, previous, strict=True) if is_permanent(policy, s, p)]
    # multiples of 100 up to 300 (100, 200, 300), then of 250 above 300 (500, 750)
    assert permanent == [119, 239, 319, 519, 759]
    assert not is_permanent(KeepPolicy(), 100, 0)
    assert is_permanent(KeepPolicy(permanent=(StepInterval(10),)), 10, None)
    assert not is_permanent(KeepPolicy(permanent=(StepInterval(10),)), 9, None)


def test_temporary_checkpoints_follow_the_interval() -> None:
    policy = KeepPolicy(permanent=(StepInterval(100),), temporary_interval_secs=60)
    assert classify(policy, 39, None, 1000.0, None, False) is Kind.temporary  # nothing yet
    assert classify(policy, 79, 39, 1030.0, 1000.0, False) is None  # too soon
    assert classify(policy, 79, 39, 1030.0, 1000.0, True) is Kind.temporary  # the final one
    assert classify(policy, 119, 79, 1031.0, 1000.0, False) is Kind.permanent  # crosses 100
    assert classify(policy, 159, 119, 1060.0, 1000.0, False) is Kind.temporary
    assert classify(KeepPolicy(), 159, 119, 0.0, 0.0, False) is Kind.recent


def test_what_is_deleted() -> None:
    kept = [
        Kept(19, Kind.permanent, 1),
        Kept(39, Kind.temporary, 2),
        Kept(59, Kind.recent, 3),
        Kept(79, Kind.recent, 4),
        Kept(99, Kind.temporary, 5),
    ]
    policy = KeepPolicy(keep_steps=1)
    # the older temporary and the recent ones beyond the newest one; never the permanent one
    assert to_delete(policy, kept) == [39, 59]
    # a newer checkpoint of any kind ends the newest temporary
    assert to_delete(policy, [*kept, Kept(119, Kind.permanent, 6)]) == [39, 59, 99]
    assert to_delete(policy, kept, protected={39}) == [59]
    assert to_delete(KeepPolicy(keep_steps=1, delete_old_steps=False), kept) == [39]
    assert to_delete(policy, []) == []
