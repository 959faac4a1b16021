"""DisTrO results whose signs carry nothing, refused once two rounds show it
(`ScreeningSettings.consensus_outlier`, `WitnessScreen._outlier_problem`): clients' trainers
(the tiny Llama, DisTrO 1-bit c16 k4, as `scripts/bench/honest_checks.py` builds them) through
their real payloads, four members, the last one hostile, every honest witness voting as the
client does (`RoundScreen.settle`) and the run applying what a quorum vouched for."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from psyche.coordinator.consensus import witness_quorum_for
from psyche.core.batch_id import BatchId
from psyche.modeling.hostile import Attack, HostileMember, make_hostile
from psyche.modeling.screening import (
    _ENTRIES,
    DISTRO_SCREENING,
    Flat,
    ScreeningSettings,
    WitnessScreen,
    agreement,
)
from psyche.modeling.serialized_distro import decode_transmittable
from psyche.modeling.trainer import Batch

from .conftest import SEQ, bigram_corpus
from .screening_rounds import HOSTILE, MEMBERS, distro_member

pytestmark = pytest.mark.usefixtures("single_thread")

ROUNDS = 4
WITH = DISTRO_SCREENING  # the shipped settings: the outlier test is on
WITHOUT = dataclasses.replace(DISTRO_SCREENING, consensus_outlier=None)


def _run(attack: Attack) -> tuple[dict[str, list[int]], dict[str, list[str]]]:
    """`ROUNDS` rounds; each honest witness screens with the opt-in outlier test and, beside
    it on the same results, with the shipped settings (without it). Returns, per settings, the rounds
    (from 1) whose quorum held the hostile result, and why honest results were refused. The run
    applies what the outlier test lets through."""
    data = bigram_corpus(ROUNDS * MEMBERS * 2, SEQ)
    trainers = [distro_member() for _ in range(MEMBERS)]
    make_hostile(trainers[HOSTILE], HostileMember(attack, seed=HOSTILE))
    settings: dict[str, ScreeningSettings] = {"with": WITH, "without": WITHOUT}
    screens = {
        name: {w: WitnessScreen(trainers[w].screening_reader(), s) for w in range(HOSTILE)}  # type: ignore[arg-type]
        for name, s in settings.items()
    }
    quorum = witness_quorum_for(0, MEMBERS)
    applied: dict[str, list[int]] = {name: [] for name in settings}
    refused: dict[str, list[str]] = {name: [] for name in settings}
    prev: list[list[object]] = [[] for _ in trainers]
    for step in range(1, ROUNDS + 1):
        outs = [
            t.train_exact(
                step,
                Batch(data[((step - 1) * MEMBERS + i) * 2 : ((step - 1) * MEMBERS + i) * 2 + 2]),
                warmup_lr_between=None,
                zero_optim=False,
                prev_self_distro_results=prev[i],  # type: ignore[arg-type]
            )
            for i, t in enumerate(trainers)
        ]
        sent = [
            t.prepare_result(o, step=step, batch_id=BatchId(i, i))
            for i, (t, o) in enumerate(zip(trainers, outs))
        ]
        received = [
            trainers[0].results_from_payload(decode_transmittable(p.payload.to_bytes()))
            for p in sent
        ]
        votes = {name: [1] * MEMBERS for name in settings}  # the hostile member's own votes
        for name in settings:
            for w in range(HOSTILE):
                rnd = screens[name][w].open_round()
                reference = trainers[w].screening_reference()
                assert reference is not None
                rnd.set_reference(reference, sent[w].sent)
                checked = {i: rnd.check(i, received[i]) for i in range(MEMBERS) if i != w}
                for i, verdict in rnd.settle(checked).items():
                    votes[name][i] += verdict.passed
                    if i != HOSTILE and not verdict.passed:
                        refused[name].append(f"round {step}, {w} on {i}: {verdict.problem}")
                votes[name][w] += 1  # its own result
                rnd.close()
            if votes[name][HOSTILE] >= quorum:
                applied[name].append(step)
        aggregate = [received[i] for i in range(MEMBERS) if votes["with"][i] >= quorum]
        for i, t in enumerate(trainers):
            t.optimize(step, distro_results=aggregate)
            prev[i] = [outs[i].distro_results]
    return applied, refused


def test_random_signs_are_refused_once_two_rounds_show_them() -> None:
    """Random signs on the honest positions score `t` about N(0, 1.4^2) along a witness's
    update and along the round's consensus, where honest results of this run score 6 to 12
    and 3 to 7: the own update's tests (floor, level, window) passed them at one witness of
    three at least in every round of this run, a quorum of four with the hostile member's own
    vote. With the outlier test they were an outlier of round 1 at every witness (no evidence
    yet: applied) and refused in round 2 by the witnesses the own update's level let them pass
    (their second outlier round); in rounds 3 and 4 their consensus `t` was 1.62 and 3.76
    (0.33 to 0.36 and 0.6 of the others'), no outlier at some witness, and applied: the test
    refuses a sender only on evidence, and one round of chance agreement passes. No honest
    result is refused. (Fails on the module before `consensus_outlier` was on by default:
    applied in every round.)"""
    applied, refused = _run(Attack.RandomSigns)
    assert applied["with"] == [1, 3, 4], applied
    assert refused["with"] == [], refused
    assert applied["without"] == [1, 2, 3, 4], applied  # what the test is for


def test_the_round_sum_in_windows_has_the_bits_of_a_model_sized_one() -> None:
    """`WitnessScreen._round_agreements` sums a round's results window by window
    (`_windowed_agreements`): each result's `t` along the others' sum is the same to the bit
    as through one model-sized sum (the way it was computed before), for results of 64 entries
    per block of 256 (random positions in every block, values of several magnitudes)."""
    reader = distro_member().screening_reader()
    assert reader is not None
    blocks = reader.size // 256
    g = torch.Generator().manual_seed(0)

    def result() -> Flat:
        within = torch.rand(blocks, 256, generator=g).argsort(dim=1)[:, :64]
        positions = (torch.arange(blocks).unsqueeze(1) * 256 + within).reshape(-1)
        values = torch.randn(positions.numel(), generator=g) * 10.0 ** torch.randint(
            -3, 3, (positions.numel(),), generator=g
        )
        return Flat(positions, values, [(positions, values)])

    flats, own = [result() for _ in range(4)], result()
    total = torch.zeros(reader.size)
    for flat in [own, *flats]:
        total.index_add_(0, flat.positions, flat.values)
    expected = [
        agreement([(total.index_select(0, f.positions).sub_(f.values), f.values)]) for f in flats
    ]
    assert flats[0].positions.numel() > _ENTRIES  # more than one window
    screen = WitnessScreen(reader, WITH)
    assert screen._round_agreements(flats, also=[own]) == expected
