"""A witness with no update of its own judged over the whole round (`RoundScreen.judge`): what
it votes for no longer depends on the order the results came in. Hostile members beside honest
ones (`psyche.modeling.hostile`), real tiny-Llama DiLoCo rounds (`screening_rounds.honest_results`).

Before, such a witness judged each result against the ones checked before it: a hostile result
that came first passed against nothing, several hostile ones first set the level every honest
one after them was judged by, and a witness in its very first round (no aggregate) checked only
norms and copies."""

from __future__ import annotations

import pytest
import torch

from psyche.modeling.hostile import DilocoFormat
from psyche.modeling.screening import DILOCO_SCREENING, ResultReader, Verdict, WitnessScreen

from .screening_rounds import honest_results

pytestmark = pytest.mark.usefixtures("single_thread")


def judged(verdicts: list[Verdict], final: list[Verdict]) -> list[Verdict]:
    """Each check's verdict of the whole round, in the order of `verdicts`."""
    assert all(v.blind and v.index is not None for v in verdicts)
    return [final[v.index] for v in verdicts if v.index is not None]


def test_a_hostile_result_first_at_a_new_blind_witness_is_refused_once_honest_ones_follow() -> None:
    """A result at the format's bound, first at a witness with neither an update of its own
    nor a closed round, passes its check (nothing to compare it with yet); judged over the
    whole round it stands out against the median norm of the others and is refused, and every
    honest result passes."""
    diloco, sent = honest_results("int8", members=5)
    reader = ResultReader.of(diloco)
    fmt = DilocoFormat(diloco.layouts())
    scaled = [fmt.at_bound(r, i) for i, r in enumerate(sent[4])]
    rnd = WitnessScreen(reader, DILOCO_SCREENING).open_round()
    first = rnd.check("hostile", scaled)
    honest = [rnd.check(i, sent[i]) for i in range(4)]
    assert first.passed  # as before: checked against nothing
    final = rnd.judge()
    hostile_final, *honest_final = judged([first, *honest], final)
    assert not hostile_final.passed
    assert "norm" in str(hostile_final.problem)
    assert all(v.passed for v in honest_final), [v.problem for v in honest_final]


@pytest.mark.parametrize("first", [True, False], ids=["hostile-first", "hostile-last"])
def test_a_new_blind_witness_measures_agreement_along_the_rounds_other_results(first: bool) -> None:
    """A witness in its very first round, with no update of its own, had no direction at all:
    a sign-flipped result at an honest norm passed it (norms and copies only). Judged over the
    whole round, each result's agreement is measured along the sum of the round's other
    results: the sign flip is refused wherever it came, every honest result passes."""
    diloco, sent = honest_results("bf16", members=5)
    reader = ResultReader.of(diloco)
    fmt = DilocoFormat(diloco.layouts())
    flipped = [fmt.negate(r, i) for i, r in enumerate(sent[4])]
    rnd = WitnessScreen(reader, DILOCO_SCREENING).open_round()
    order: list[tuple[object, list]] = [(i, sent[i]) for i in range(4)]  # type: ignore[type-arg]
    order.insert(0 if first else 4, ("hostile", flipped))
    verdicts = {sender: rnd.check(sender, r) for sender, r in order}
    assert all(v.passed and not v.checked for v in verdicts.values())  # as before
    final = dict(zip(verdicts, judged(list(verdicts.values()), rnd.judge())))
    assert not final["hostile"].passed
    assert final["hostile"].checked
    assert "agreement" in str(final["hostile"].problem)
    honest = [v for sender, v in final.items() if sender != "hostile"]
    assert all(v.passed and v.checked for v in honest), [v.problem for v in honest]
    assert min(v.measure.agreement for v in honest) > 0 > final["hostile"].measure.agreement


def test_several_hostile_results_first_no_longer_set_a_blind_witness_baseline() -> None:
    """Two colluding members of seven send results at the format's bound first, at a witness
    with neither an update of its own nor a closed round: both pass their checks (one other
    result or none before them) and, once three others were checked, their norms dominate the
    in-round median, so honest results after them were refused (their votes withheld). Judged
    over the whole round, each result's others' median is honest (the colluders are two of
    six): both hostile results are refused and every honest one passes, the same verdicts
    whatever order the results came in."""
    diloco, sent = honest_results("int8", members=7)
    reader = ResultReader.of(diloco)
    fmt = DilocoFormat(diloco.layouts())
    hostile = {f"hostile-{m}": [fmt.at_bound(r, i) for i, r in enumerate(sent[m])] for m in (5, 6)}
    finals = []
    for hostile_first in (True, False):
        rnd = WitnessScreen(reader, DILOCO_SCREENING).open_round()
        order = [*hostile.items(), *enumerate(sent[:5])]
        if not hostile_first:
            order = order[2:] + order[:2]
        verdicts = {sender: rnd.check(sender, r) for sender, r in order}
        if hostile_first:
            # the gap: both hostile results passed, honest ones after them were refused
            assert all(verdicts[s].passed for s in hostile)
            assert any(not v.passed for s, v in verdicts.items() if s not in hostile)
        final = dict(zip(verdicts, judged(list(verdicts.values()), rnd.judge())))
        assert not any(final[s].passed for s in hostile)
        honest = [v for s, v in final.items() if s not in hostile]
        assert all(v.passed for v in honest), [v.problem for v in honest]
        finals.append({s: (v.passed, v.measure.norm) for s, v in final.items()})
    assert finals[0] == finals[1]


def test_a_judged_blind_round_folds_what_passed_over_the_whole_round() -> None:
    """What a judged blind round adds to the witness's aggregate and norm level is what passed
    the judgement it took (`RoundScreen.commit`: the round's fold follows the vote): a result at the bound that passed its
    check first and was refused over the whole round is not folded in."""
    diloco, sent = honest_results("int8", members=5)
    reader = ResultReader.of(diloco)
    fmt = DilocoFormat(diloco.layouts())
    scaled = [fmt.at_bound(r, i) for i, r in enumerate(sent[4])]
    witness = WitnessScreen(reader, DILOCO_SCREENING)
    rnd = witness.open_round()
    assert rnd.check("hostile", scaled).passed
    for i in range(4):
        rnd.check(i, sent[i])
    rnd.commit(rnd.judge())  # as the client casts its votes
    rnd.close()
    honest_norms = sorted(reader.describe(reader.flat(r), 64)[0] for r in sent[:4])
    assert witness._norm_level == pytest.approx((honest_norms[1] + honest_norms[2]) / 2)
    assert witness._aggregate is not None
    want = sum(reader.flat(r).values for r in sent[:4])
    assert torch.allclose(witness._aggregate * witness._aggregate_scale, want, atol=1e-5)
