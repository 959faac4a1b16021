"""A witness's first round with a fresh momentum (issue 25: 0 honest results refused). In a
real four-process run (`tests/e2e/test_training.py`) a member that had just joined judged its
first round as a witness with its own update from a reset momentum: its update opposed all three
honest DisTrO results of the round (`t` -7.6 to -10), and the floor (`min_agreement` -6) refused
them. It was not that round's witness; had it been the only one (`witness_nodes = 1` in the tiny
configs), three honest batches would have lost consensus and their trainers been health-checked
out. Its update is one member's, fresh: the round's consensus (the others' results) agreed with
each of them."""

from __future__ import annotations

import copy

import pytest

from psyche.modeling.hostile import DistroFormat
from psyche.modeling.research import PeerSimulation
from psyche.modeling.screening import DISTRO_SCREENING, ResultReader, Verdict, WitnessScreen

from .conftest import SEQ, bigram_corpus
from .screening_rounds import constant, witness_simulation

pytestmark = pytest.mark.usefixtures("single_thread")

ROWS, JOIN_AT = 4, 4


def _fresh_witness_round(opposed: bool, flip: bool) -> dict[object, Verdict]:
    """Three DisTrO members (c16 k8) train `JOIN_AT - 1` rounds; in the next a fourth joins with
    the first one's weights and a fresh momentum, trains one row and, in its first round as a
    witness (a new `WitnessScreen`), judges the three members' results (with `flip`, and a
    sign flip of the second one's) as a client does (`RoundScreen.settle`). `opposed`: the
    joiner's batch loss is ascended, so its own update opposes the round's as the e2e joiner's
    did (on its own rows it agrees with the members at `t` 5.6 to 9.6)."""
    ws = witness_simulation()
    sim, sent_by_round = ws.sim, ws.sent_by_round
    data = bigram_corpus(4 * JOIN_AT * ROWS, SEQ, seed=1)
    joiner = PeerSimulation([copy.deepcopy(sim.models[0])], ws.settings, lr=constant(3e-3))
    joined: list[list] = []  # type: ignore[type-arg]
    joiner._exchange = lambda sent, step: joined.append(sent[0]) or sent  # type: ignore[method-assign]
    distro = joiner.peers[0].distro
    distro.keep_encoded = True
    for step in range(1, JOIN_AT + 1):
        models = sim.models
        if step == JOIN_AT:  # from the weights the members train this round from
            joiner.models[0].load_state_dict(sim.models[0].state_dict())
            joiner.zero_grad(step)
            models = [*models, joiner.models[0]]
        sim.zero_grad(step)
        for i, m in enumerate(models):
            start = ((step - 1) * 4 + i) * ROWS
            ids = data[start : start + (1 if i == 3 else ROWS)]
            loss = m(ids, labels=ids, use_cache=False).loss
            (-loss if i == 3 and opposed else loss).backward()
        sim.step(step)
    joiner.step(JOIN_AT)
    sent = [*sent_by_round[-1], joined[-1]]
    reader = ResultReader.of(distro)
    screen = WitnessScreen(reader, DISTRO_SCREENING).open_round()
    screen.set_reference(reader.reference(distro), sent[3])
    checked: dict[object, Verdict] = {i: screen.check(i, sent[i]) for i in range(3)}
    if flip:
        form = DistroFormat(distro, quantize_1bit=True)
        checked["flip"] = screen.check("flip", [form.negate(r, k) for k, r in enumerate(sent[1])])
    return screen.settle(checked)


def test_a_fresh_witness_whose_update_opposes_the_round_passes_its_honest_results() -> None:
    """The joiner's own update opposes every honest result of its first round (`t` -5.6, -7.3
    and -9.6, as the e2e joiner's -7.6 to -10): the floor refused the two below -6 before (and
    with one witness a round, their batches would have lost consensus). Judged with the round's
    consensus (the others' results), along which each agrees, none is refused."""
    verdicts = _fresh_witness_round(opposed=True, flip=False)
    honest = {i: verdicts[i] for i in range(3)}
    ts = {i: v.measure.agreement for i, v in honest.items()}
    assert all(t < 0.0 for t in ts.values()), ts
    assert sum(t < DISTRO_SCREENING.min_agreement for t in ts.values()) >= 2, ts
    refused = {i: v.problem for i, v in honest.items() if not v.passed}
    assert refused == {}, (ts, refused)


def test_a_fresh_witness_still_refuses_a_sign_flip_in_its_first_round() -> None:
    """A joiner whose fresh update agrees with the round (`t` 5.6 to 9.6) refuses a sign flip
    of an honest result there (below the floor along its update, and opposed to the round's
    consensus too) and passes the three honest results. (Where the joiner's update opposes
    the round, the flip agrees with it, and this witness passes it before and after the
    change: the members' own updates refuse it.)"""
    verdicts = _fresh_witness_round(opposed=False, flip=True)
    assert not verdicts["flip"].passed, verdicts["flip"].measure
    assert verdicts["flip"].measure.agreement < DISTRO_SCREENING.min_agreement
    refused = {i: verdicts[i].problem for i in range(3) if not verdicts[i].passed}
    assert refused == {}, refused
