"""A round judged more than once (`RoundScreen.judge`): a client judges its held checks in a
worker thread before it sends its witness and again, inline, where a held check came in after
that judgement (`psyche.client.round.payloads.settle_blind_votes`). The round must end where
one judgement of the same checks ends, or what later rounds screen against depends on timing.

Before, a judgement with an update of the witness's own took a check it refused out of the
round's accepted results and passed level for good: with the leave-one-out level loosened by a
later check, a result refused first and passed finally got the witness's vote but stayed out
of its aggregate and counted as refused in the level the round lends.

The checks go through the witness's own decision (`WitnessScreen._decide`, as
`RoundScreen.check` calls it) with given measures: the judgement reads only the measures, and
these are the reviewer's (DiLoCo, `t` 40, 40, 12, 9, then a fifth at 12)."""

from __future__ import annotations

from typing import cast

import torch

from psyche.modeling.screening import (
    DILOCO_SCREENING,
    Fingerprint,
    Flat,
    Measure,
    ResultReader,
    RoundScreen,
    WitnessScreen,
    _Own,
    _round_level,
)

FIRST = [("A", 40.0), ("C", 40.0), ("E", 12.0), ("B", 9.0)]
LATE = ("D", 12.0)
SKETCH = 8


def _round() -> RoundScreen:
    """A witness's first round (no level yet: every check held) with an update of its own of
    norm 1."""
    no_reader = cast(ResultReader, None)  # the judgement of given measures reads no result
    screen = WitnessScreen(no_reader, DILOCO_SCREENING).open_round()
    screen.reference = _Own([], 1.0, 1.0)
    return screen


def _check(screen: RoundScreen, sender: str, t: float) -> None:
    """What `RoundScreen.check` does once the result is measured: `t` along the own update,
    the own update's norm, a fingerprint unlike every other's (no copy)."""
    w = screen.witness
    k = len(screen.seen)
    fingerprint = Fingerprint(torch.eye(SKETCH)[k], 1.0)
    flat = Flat(None, torch.zeros(1), [])
    with w._lock:
        screen.checks += 1
        verdict = w._decide(sender, Measure(t, 1.0, fingerprint), screen, True, screen.reference)
        assert verdict.passed
        assert verdict.index is not None
        screen.blind[verdict.index].flat = flat
        screen.accepted.append(flat)


def _checked(checks: list[tuple[str, float]]) -> RoundScreen:
    screen = _round()
    for sender, t in checks:
        _check(screen, sender, t)
    return screen


def _state(screen: RoundScreen) -> tuple[object, ...]:
    """What the round folds into the witness's memory and lends the next round."""
    position = {id(c.flat): c.sender for c in screen.blind}
    return (
        [position[id(f)] for f in screen.accepted],
        sorted(screen.accepted_norms),
        sorted(screen.agreements),
        sorted(screen.refused_agreements),
        [(c.sender, c.passed) for c in screen.blind],
        _round_level(screen, DILOCO_SCREENING.level_min_results),
    )


def test_judging_again_after_a_late_check_ends_where_one_judgement_does() -> None:
    twice = _checked(FIRST)
    before = _state(twice)
    first = twice.judge()
    # over four checks the leave-one-out level refuses B: 9 < 0.4 x 40 - 6
    assert [v.passed for v in first] == [True, True, True, False]
    assert _state(twice) == before  # a judgement alone changes nothing
    _check(twice, *LATE)
    final = twice.judge()
    twice.commit(final)
    once = _checked([*FIRST, LATE])
    single = once.judge()
    once.commit(single)
    # over five B passes (its others' lower median is 12): every verdict bit as one judgement's
    assert [(v.index, v.problem, v.measure.agreement, v.measure.norm) for v in final] == [
        (v.index, v.problem, v.measure.agreement, v.measure.norm) for v in single
    ]
    assert all(v.passed for v in final)
    assert _state(twice) == _state(once)
    assert 9.0 in twice.agreements
    assert twice.refused_agreements == []
    assert len(twice.accepted) == len(FIRST) + 1


def test_a_committed_judgement_takes_a_refused_check_out_once() -> None:
    """One judgement committed, as before: B, passed at its check, is refused over the round
    and leaves its accepted results and passed level; a second commit changes nothing."""
    screen = _checked(FIRST)
    verdicts = screen.judge()
    screen.commit(verdicts)
    state = _state(screen)
    assert state[0] == ["A", "C", "E"]
    assert state[3] == [9.0]
    assert state[5] == 40.0  # the median of the passed ones: 12, 40, 40
    screen.commit(screen.judge())
    assert _state(screen) == state
