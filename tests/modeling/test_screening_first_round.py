"""A witness's first round and a witness whose level would come from too few results
(`psyche.modeling.screening`): clients' trainers (`Trainer`, a tiny Llama, DisTrO 1-bit c16 k4,
as `scripts/bench/honest_checks.py` builds them) through their real payloads, each witness
judging the round as the client does (`RoundScreen.settle`)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Literal

import pytest

from psyche.core.batch_id import BatchId
from psyche.modeling.hostile import Attack, HostileMember, make_hostile
from psyche.modeling.screening import (
    DISTRO_SCREENING,
    Measure,
    Verdict,
    WitnessScreen,
    screening_settings,
)
from psyche.modeling.serialized_distro import decode_transmittable
from psyche.modeling.trainer import Batch

from .conftest import SEQ, bigram_corpus
from .screening_rounds import HOSTILE, MEMBERS, distro_member

pytestmark = pytest.mark.usefixtures("single_thread")


def _first_round(held_consensus: Literal["refuses"] | None) -> dict[int, dict[int, Verdict]]:
    """Four members' first round, the last one sign-flipping: each honest witness's verdicts
    (what it votes by) on the others' results."""
    data = bigram_corpus(2 * MEMBERS * 2, SEQ)
    trainers = [distro_member() for _ in range(MEMBERS)]
    make_hostile(trainers[HOSTILE], HostileMember(Attack.SignFlip, seed=HOSTILE))
    readers = [t.screening_reader() for t in trainers]
    outs = [
        t.train_exact(
            1,
            Batch(data[i * 2 : i * 2 + 2]),
            warmup_lr_between=None,
            zero_optim=False,
            prev_self_distro_results=[],
        )
        for i, t in enumerate(trainers)
    ]
    sent = [
        t.prepare_result(o, step=1, batch_id=BatchId(i, i))
        for i, (t, o) in enumerate(zip(trainers, outs))
    ]
    received = [
        trainers[0].results_from_payload(decode_transmittable(p.payload.to_bytes())) for p in sent
    ]
    # the control without the consensus turns off both tests that read it
    outlier = DISTRO_SCREENING.consensus_outlier if held_consensus else None
    settings = dataclasses.replace(
        DISTRO_SCREENING, held_consensus=held_consensus, consensus_outlier=outlier
    )
    verdicts = {}
    for w in range(MEMBERS):
        if w == HOSTILE:
            continue
        reader = readers[w]
        assert reader is not None
        assert screening_settings(reader) == DISTRO_SCREENING
        rnd = WitnessScreen(reader, settings).open_round()
        reference = trainers[w].screening_reference()
        assert reference is not None
        rnd.set_reference(reference, sent[w].sent)
        checked = {i: rnd.check(i, received[i]) for i in range(MEMBERS) if i != w}
        verdicts[w] = rnd.settle(checked)
    return verdicts


def test_a_distro_sign_flip_is_refused_by_every_witness_in_the_round_it_starts() -> None:
    """A 1-bit DisTrO sign flip in a witness's first round (no level yet): along one small
    batch's update alone it scored `t` -4.2 and -4.5 at two witnesses of three, above their
    thresholds (0.7 x 0.5 x the lower median of the others - 6), and with the hostile member's
    own vote one attestation is a quorum of four (`honest_checks.py`: applied in round 1).
    Judged also by its agreement with the round's consensus (the other members' results and
    the witness's own), every witness refuses it, and no honest result."""
    verdicts = _first_round(held_consensus="refuses")
    for w, judged in verdicts.items():
        assert not judged[HOSTILE].passed, (w, judged[HOSTILE].measure.agreement)
        honest = {i: v.problem for i, v in judged.items() if i != HOSTILE and not v.passed}
        assert honest == {}, (w, honest)
    problems = [str(judged[HOSTILE].problem) for judged in verdicts.values()]
    assert any("round's other results together" in p for p in problems), problems
    # the own update's test alone passes it at some witness (what the consensus is for)
    alone = _first_round(held_consensus=None)
    assert any(judged[HOSTILE].passed for judged in alone.values())


def test_a_level_from_one_result_a_round_does_not_refuse_an_honest_result() -> None:
    """A two-member run's witness checks one result a round, so its level was that one
    result's `t` of the rounds before, no median at all: an honest DisTrO result at `t` 9.39
    was refused under 0.7 x 24.13 - 6 = 10.89 (`tests/client/test_hostile_strangers.py`, one
    run in four). A round of fewer than `level_min_results` results sets no level; the floor
    and the window still judge."""
    data = bigram_corpus(4, SEQ)
    trainer = distro_member()
    reader = trainer.screening_reader()
    assert reader is not None
    witness = WitnessScreen(reader, DISTRO_SCREENING)
    out = trainer.train_exact(
        1, Batch(data[:2]), warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[]
    )
    sent = trainer.prepare_result(out, step=1, batch_id=BatchId(0, 0))
    reference = trainer.screening_reference()
    assert reference is not None
    # the recorded rounds: the other member's result at t 24.13, one a round
    for _ in range(DISTRO_SCREENING.level_rounds):
        rnd = witness.open_round()
        rnd.set_reference(reference, sent.sent)
        rnd.agreements.append(24.13)
        rnd.checks += 1
        rnd.close()
    rnd = witness.open_round()
    levels = witness._level_list(rnd)
    fingerprint = witness.reader.describe(witness.reader.flat(sent.sent), 64)[1]
    honest = Measure(9.39, 1.0, fingerprint)
    problem = witness._first_order_problem(honest, 1.0, [24.13, 24.13, 9.39], levels)
    assert problem is None, problem
    assert levels == []
    # a round of two results still sets its level (their median), and it judges
    rnd.set_reference(reference, sent.sent)
    rnd.agreements += [24.13, 24.13]
    rnd.checks += 2
    rnd.close()
    levels = witness._level_list(witness.open_round())
    assert levels == [statistics.median([24.13, 24.13])]
    assert witness._first_order_problem(honest, 1.0, [], levels) is not None
    # a sign flip is still refused there by the floor
    flipped = Measure(-9.39, 1.0, fingerprint)
    assert witness._first_order_problem(flipped, 1.0, [], []) is not None
