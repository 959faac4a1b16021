"""DisTrO's consensus-outlier test as shipped (`OutlierTest`: both statistics low, a gate on the
round's levels, evidence over rounds), through a witness's public round API (`open_round`,
`set_reference`, `check`, `settle`, `close`) on real 1-bit DisTrO results of the tiny Llama's
shapes: each round's results are the encodings (`DistroFormat.encode_dense`: DCT, top-k, signs)
of a direction the round's honest members share plus each member's own noise, the witness's
reference the DCT of its own. Seconds, no training: the statistics are what matter here, and
`scripts/bench/poison.py` measures them in real runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest
import torch

from psyche.modeling.distro import DistroResult
from psyche.modeling.hostile import DistroFormat
from psyche.modeling.screening import (
    DISTRO_SCREENING,
    Reference,
    ResultReader,
    ScreeningSettings,
    Verdict,
    WitnessScreen,
)

from .screening_rounds import distro_member

pytestmark = pytest.mark.usefixtures("single_thread")

WITNESS = 0
SHIPPED = DISTRO_SCREENING
BEFORE = dataclasses.replace(DISTRO_SCREENING, consensus_outlier=None)
"""The shipped settings before this test was on (what the old default was)."""


@pytest.fixture(scope="module")
def member() -> tuple[ResultReader, DistroFormat]:
    trainer = distro_member()
    assert trainer.distro is not None
    reader = trainer.screening_reader()
    assert reader is not None
    return reader, DistroFormat(trainer.distro, quantize_1bit=True)


class Rounds:
    """Rounds of `members` results: member `m`'s update is `signal x` the round's shared
    direction plus its own unit noise (`weak`: members whose updates share only that part of
    the signal with the round's), encoded as a client sends it."""

    def __init__(self, fmt: DistroFormat, members: int, seed: int = 0) -> None:
        self.fmt = fmt
        self.members = members
        self.g = torch.Generator().manual_seed(seed)
        self.shapes = [fmt.shape(i) for i in range(len(fmt.distro.variables))]

    def updates(
        self, signal: float, weak: Mapping[int, float] | None = None
    ) -> list[list[torch.Tensor]]:
        shared = [torch.randn(s, generator=self.g) for s in self.shapes]
        share = weak or {}
        return [
            [
                share.get(m, 1.0) * signal * d + torch.randn(s, generator=self.g)
                for d, s in zip(shared, self.shapes)
            ]
            for m in range(self.members)
        ]

    def sent(self, update: list[torch.Tensor]) -> list[DistroResult]:
        return [self.fmt.encode_dense(x, i) for i, x in enumerate(update)]

    def reference(self, update: list[torch.Tensor]) -> Reference:
        transform = self.fmt.distro.transform
        return Reference([transform.encode(x) for x in update])


def _round(
    witness: WitnessScreen,
    rounds: Rounds,
    results: list[list[DistroResult]],
    own: list[torch.Tensor],
) -> dict[int, Verdict]:
    """One round at the witness, voted as the client votes (`settle`)."""
    rnd = witness.open_round()
    rnd.set_reference(rounds.reference(own), results[WITNESS])
    checked = {i: rnd.check(i, results[i]) for i in range(rounds.members) if i != WITNESS}
    verdicts = rnd.settle(checked)
    rnd.close()
    return verdicts


def _random_signs(rounds: Rounds, results: list[DistroResult]) -> list[DistroResult]:
    return [rounds.fmt.random_signs(r, i, rounds.g) for i, r in enumerate(results)]


MEMBERS = 8
SIGNAL = 0.3
"""Honest results of these rounds agree at `t` about 5 to 10 along a witness's update and 5 to
8 along the consensus: above the gate, and weakly enough that the own update's level test
(0.7 x level - 6) passes a result at `t` 0 in most rounds, as late in the tiny run."""
LAST = MEMBERS - 1
WEAK = 0.25
"""The share of the round's signal a member on other data has in its weak round: its `t`s
about a quarter of the others' along both, as the tiny run's member on another bigram chain
(0.2 to 0.5 of the others' along the consensus, 0.2 to 0.45 along a witness's update)."""


def _run(
    settings: ScreeningSettings, reader: ResultReader, fmt: DistroFormat, signals: list[float]
) -> list[dict[int, Verdict]]:
    """Eight members, the last sending random signs on its honest positions, one round per
    signal."""
    rounds = Rounds(fmt, MEMBERS)
    witness = WitnessScreen(reader, settings)
    out = []
    for signal in signals:
        updates = rounds.updates(signal)
        results = [rounds.sent(u) for u in updates]
        results[LAST] = _random_signs(rounds, results[LAST])
        out.append(_round(witness, rounds, results, updates[WITNESS]))
    return out


def test_a_sender_whose_results_carry_nothing_is_refused_once_the_rounds_show_it(
    member: tuple[ResultReader, DistroFormat],
) -> None:
    """Random signs on a member's honest positions agree with neither the round's consensus
    nor the witness's update (`t` about N(0, 1) along both, where the honest results of these
    rounds score well above the gate): an outlier in its first round, passed there (one
    round is not evidence), refused in every round after while it goes on (by the own
    update's level where it reaches, by the outlier test's evidence where it does not); the
    honest results never. With the settings shipped before (no outlier test) it passes
    rounds after its first: the own update's floor, level and window let it through (fails
    on the old code's default)."""
    reader, fmt = member
    judged = _run(SHIPPED, reader, fmt, [SIGNAL] * 4)
    assert judged[0][LAST].outlier, judged[0][LAST]
    assert judged[0][LAST].passed, judged[0][LAST]
    assert [v[LAST].passed for v in judged[1:]] == [False] * 3, [v[LAST] for v in judged]
    assert any("open rounds here" in str(v[LAST].problem) for v in judged), judged
    assert all(v[i].passed for v in judged for i in range(1, LAST)), judged
    before = _run(BEFORE, reader, fmt, [SIGNAL] * 4)
    assert any(v[LAST].passed for v in before[1:]), [v[LAST] for v in before]


def test_no_outlier_is_judged_where_the_round_does_not_clearly_agree(
    member: tuple[ResultReader, DistroFormat],
) -> None:
    """Late in a run honest DisTrO results agree weakly (the consensus `t` 1.7 to 3.4 on the
    tiny run), and there the weighted form refused honest results: the test is closed while
    either lower median is under the gate, and such a round is no evidence either way."""
    reader, fmt = member
    judged = _run(SHIPPED, reader, fmt, [0.02] * 3)
    assert all(v[i].outlier is None for v in judged for i in range(1, MEMBERS)), judged
    assert all(v[i].passed for v in judged for i in range(1, MEMBERS)), judged


def test_an_honest_member_on_other_data_is_not_refused_for_one_weak_round(
    member: tuple[ResultReader, DistroFormat],
) -> None:
    """A member whose update shares nothing with the round's in one round (a batch of another
    kind) is an outlier of that round, and not refused: a refusal needs `outliers` of the
    sender's last `rounds` open rounds."""
    reader, fmt = member
    rounds = Rounds(fmt, MEMBERS)
    witness = WitnessScreen(reader, SHIPPED)
    flags = []
    for r in range(4):
        updates = rounds.updates(SIGNAL, {LAST: WEAK} if r == 1 else None)
        verdicts = _round(witness, rounds, [rounds.sent(u) for u in updates], updates[WITNESS])
        assert all(v.passed for v in verdicts.values()), {
            i: v.problem for i, v in verdicts.items() if not v.passed
        }
        flags.append(verdicts[LAST].outlier)
    assert flags == [False, True, False, False]


def test_two_colluders_cannot_get_an_honest_member_refused(
    member: tuple[ResultReader, DistroFormat],
) -> None:
    """Two colluders of eight put a third of their entries on the target's positions with the
    target's signs negated: the target's `t` along the round's consensus falls below zero,
    but its `t` along an honest witness's own update is the colluders' to change only through
    the consensus, so it is no outlier (both must be low) and not refused, in the witness's
    first round (its sum test also asks the own update's `t` to be low now: it refused the
    target there before) and every round after."""
    reader, fmt = member
    rounds = Rounds(fmt, MEMBERS)
    target, colluders = 1, (6, 7)
    for settings in (SHIPPED, BEFORE):
        witness = WitnessScreen(reader, settings)
        for r in range(4):
            updates = rounds.updates(SIGNAL)
            results = [rounds.sent(u) for u in updates]
            for c in colluders:
                results[c] = [
                    _frame(mine, theirs) for mine, theirs in zip(results[c], results[target])
                ]
            verdicts = _round(witness, rounds, results, updates[WITNESS])
            assert verdicts[target].passed, (settings is SHIPPED, r, verdicts[target].problem)
            assert all(verdicts[i].passed for i in range(2, 6)), verdicts


def _frame(mine: DistroResult, theirs: DistroResult) -> DistroResult:
    """`mine` with a third of each block's entries (at least one) moved to `theirs`'s
    positions, `theirs`'s signs negated there (1-bit values: True is -1)."""
    assert mine.sparse_idx.dtype == torch.uint8
    assert mine.sparse_val.dtype == torch.bool
    idx, val = mine.sparse_idx.clone(), mine.sparse_val.clone()
    m = max(1, round(idx.shape[-1] / 3))
    idx[..., :m] = theirs.sparse_idx[..., :m]
    val[..., :m] = ~theirs.sparse_val[..., :m]
    return DistroResult(idx, val, list(mine.xshape), mine.totalk)
