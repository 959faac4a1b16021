"""A verifier's recompute and comparison (`psyche.modeling.verification`) against honest and
hostile trainers: tiny Llamas built from a config, trained as clients train them
(`train_exact`, `prepare_result`, the payload decoded by the verifier as every client does it),
the verifier holding the run's weights (`psyche.modeling.verification_sim`). The recompute is
exact (the same bits from two verifiers); the comparison passes every honest result, including
a verifier with another thread count, and refuses each attack it is for from the round the
attack starts."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

import pytest
import torch

from psyche.core.batch_id import BatchId
from psyche.modeling.diloco.codec import decode
from psyche.modeling.distro import DistroResult
from psyche.modeling.hostile import Attack, DilocoFormat, HostileMember, payload_format
from psyche.modeling.trainer import TrainOutput
from psyche.modeling.verification import (
    Evidence,
    Measures,
    RecomputeCancelled,
    VerificationSettings,
    VerificationVerdict,
    recompute,
    save_weights,
    split_rows,
    swap_weights,
    verification_settings,
    verify_result,
)
from psyche.modeling.verification_sim import VerificationRun, tiny_trainer

from .verification_members import (
    MEMBERS,
    ROWS,
    corpus_batches,
    same_bits,
    state,
    trained_one_step,
)


@pytest.mark.parametrize("form", ["distro", "bf16", "sparse"])
def test_two_verifiers_recompute_the_same_bits_and_leave_their_trainer_alone(form: str) -> None:
    batch = corpus_batches(3)
    # the verifier has a history of its own (optimizer state, a pending own update)
    trainer, out = trained_one_step(form, batch)
    other = tiny_trainer(form)
    other.optimize(1, distro_results=[out.distro_results or []])
    before = state(trainer)
    a = recompute(trainer, batch(2, 1), step=2)
    b = recompute(other, batch(2, 1), step=2)
    # DisTrO: two parts (its balance check); DiLoCo: the trainer's round on the whole batch
    parts = split_rows(ROWS, trainer.micro_batch_size) if form == "distro" else [ROWS]
    assert a.rows == b.rows == parts == ([2, 2] if form == "distro" else [4])
    for x, y in zip(a.parts, b.parts):
        assert same_bits(x, y)
    assert any(bool(t.abs().sum() > 0) for t in a.update)
    published = trainer.results_from_payload(
        trainer.prepare_result(out, step=1, batch_id=BatchId(0, 0)).payload
    )
    verdict = verify_result(trainer, batch(2, 1), published, step=2, decoy=batch(2, 2))
    assert same_bits(state(trainer), before)
    # and the two verifiers' verdicts agree bit for bit, every statistic
    again = verify_result(other, batch(2, 1), published, step=2, decoy=batch(2, 2))
    assert verdict.measures == again.measures
    assert (verdict.matches, verdict.score, verdict.check) == (
        again.matches,
        again.score,
        again.check,
    )


class _Ended:
    """A round that has ended (`TrainingStep.cancel`)."""

    def is_set(self) -> bool:
        return True


@pytest.mark.parametrize("form", ["distro", "bf16"])
def test_a_recompute_the_round_ends_stops_and_leaves_its_trainer_alone(form: str) -> None:
    # a verifier that also trains checks in the round's idle time: the round's end must stop a
    # recompute (between micro-batches or inner steps) instead of holding the next round
    batch = corpus_batches(2)
    trainer, out = trained_one_step(form, batch)
    before = state(trainer)
    with pytest.raises(RecomputeCancelled):
        recompute(trainer, batch(2, 1), step=2, cancel=_Ended())
    assert same_bits(state(trainer), before)
    # and the trainer's next recompute is the one it would have made
    other = tiny_trainer(form)
    other.optimize(1, distro_results=[out.distro_results or []])
    for x, y in zip(
        recompute(trainer, batch(2, 1), step=2).parts, recompute(other, batch(2, 1), step=2).parts
    ):
        assert same_bits(x, y)


@pytest.mark.parametrize("form", ["distro", "bf16"])
def test_a_tie_breaker_recomputes_from_its_saved_weights_a_round_later(form: str) -> None:
    # round 2's weights saved; the model moves on (round 3's apply); the saved weights swapped
    # in give round 2's recompute bit for bit, and swapped back the model is as it was
    batch = corpus_batches(3)
    trainer = tiny_trainer(form)
    out = trainer.train_exact(
        1, batch(1, 0), warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[]
    )
    at_round = recompute(trainer, batch(2, 1), step=2)
    saved = save_weights(trainer)
    trainer.optimize(2, distro_results=[out.distro_results or []])
    moved = state(trainer)
    optimizer = trainer.distro or trainer.diloco
    assert optimizer is not None
    now = [p.detach().clone() for _, p in optimizer.variables]
    assert not same_bits(now, saved.tensors)  # it did move on
    swap_weights(trainer, saved)
    later = recompute(trainer, batch(2, 1), step=2)
    swap_weights(trainer, saved)
    assert all(same_bits(x, y) for x, y in zip(at_round.parts, later.parts, strict=True))
    assert same_bits(state(trainer), moved)
    # the next round's copy goes into the same tensors (one copy, never two)
    again = save_weights(trainer, saved)
    assert again is saved
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(again.tensors, saved.tensors))


def _whole_tensor_measures(
    reader: Any, own: Any, decoy: Any, published: list[DistroResult]
) -> tuple[float, float | None, float | None, float]:
    """The comparison's statistics as they were computed until 2026-11-28: each domain's whole
    update and parts' difference formed over whole tensors, then read at the payload's
    positions (one gather per statistic)."""
    from psyche.modeling.screening import _at, agreement

    def whole_and_halves(d: Any) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if not d.halved:
            return d.parts[0], None
        a, b = d.shares
        x, y = d.parts
        return [u * a + v * b for u, v in zip(x, y)], [u - v for u, v in zip(x, y)]

    flat = reader.flat(published)
    whole, halves = whole_and_halves(own)
    other, _ = whole_and_halves(decoy)
    t = agreement(
        (_at(whole[i], pos).sub_(_at(other[i], pos)), v) for i, (pos, v) in enumerate(flat.parts)
    )
    balance = parts = None
    if halves is not None:
        balance = agreement((_at(halves[i], pos), v) for i, (pos, v) in enumerate(flat.parts))
        signs = (own.shares[1], -own.shares[0])
        parts = min(
            agreement(
                (
                    _at(whole[i], pos)
                    .add_(_at(halves[i], pos), alpha=signs[k])
                    .sub_(_at(other[i], pos)),
                    v,
                )
                for i, (pos, v) in enumerate(flat.parts)
            )
            for k in (0, 1)
        )
    at = torch.cat([_at(w, pos) for w, (pos, _) in zip(whole, flat.parts)])
    norm = float(torch.linalg.vector_norm(flat.values))
    reference = float(torch.linalg.vector_norm(at))
    cosine = float(torch.dot(at, flat.values)) / (reference * norm)
    return t, balance, parts, cosine


@pytest.mark.parametrize("form", ["distro", "bf16", "sparse"])
def test_the_comparison_at_the_payloads_positions_gives_the_whole_tensors_bits(form: str) -> None:
    # compare() forms the whole update and the parts' difference at the payload's positions
    # only; every statistic must keep the bits it had when they were formed over whole tensors
    # (an honest verifier's verdict unchanged, and the same on every verifier)
    from psyche.modeling.verification import compare, domain_of, result_reader

    batch = corpus_batches(2)
    trainer, verifier = tiny_trainer(form), tiny_trainer(form)
    out = trainer.train_exact(
        1, batch(1, 0), warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[]
    )
    published = verifier.results_from_payload(
        trainer.prepare_result(out, step=1, batch_id=BatchId(0, 0)).payload
    )
    own = domain_of(verifier, recompute(verifier, batch(1, 0), step=1))
    decoy = domain_of(verifier, recompute(verifier, batch(1, 1), step=1))
    reader = result_reader(verifier)
    verdict = compare(reader, own, decoy, published, verification_settings(verifier))
    m = verdict.measures
    t, balance, parts, cosine = _whole_tensor_measures(reader, own, decoy, published)
    assert (m.agreement, m.balance, m.parts, m.cosine) == (t, balance, parts, cosine)
    assert (m.balance is None) == (form != "distro")
    assert verdict.matches


@pytest.mark.parametrize("form", ["distro", "bf16"])
def test_an_honest_result_matches_and_one_of_another_batch_does_not(form: str) -> None:
    batch = corpus_batches(2)
    trainer, verifier = tiny_trainer(form), tiny_trainer(form)
    out = trainer.train_exact(
        1, batch(1, 0), warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[]
    )
    payload = trainer.prepare_result(out, step=1, batch_id=BatchId(0, 0)).payload
    published = verifier.results_from_payload(payload)
    honest = verify_result(verifier, batch(1, 0), published, step=1, decoy=batch(1, 1))
    assert honest.matches, honest.detail
    assert honest.check is None
    assert honest.score >= honest.threshold
    # the same result claimed for another batch: it does not carry that batch
    claimed = verify_result(verifier, batch(1, 2), published, step=1, decoy=batch(1, 1))
    assert not claimed.matches
    assert claimed.check == "agreement"
    assert claimed.score < claimed.threshold


def run_rounds(
    form: str,
    hostile: dict[int, HostileMember],
    rounds: int,
    verifier_threads: int | None = None,
    sits_out: Callable[[int, int], bool] | None = None,
    settings: VerificationSettings | None = None,
) -> tuple[list[dict[int, bool]], int]:
    """Each round's verdicts (member -> matched); and how many honest ones were refused."""
    run = VerificationRun(
        [tiny_trainer(form) for _ in range(MEMBERS)],
        tiny_trainer(form),
        corpus_batches(rounds),
        hostile,
        verifier_threads=verifier_threads,
        sits_out=sits_out,
        settings=settings,
    )
    out, refused = [], 0
    for step in range(1, rounds + 1):
        verdicts = run.round(step).verdicts
        out.append({i: v.matches for i, v in verdicts.items()})
        refused += sum(1 for i, v in verdicts.items() if i not in hostile and not v.matches)
    return out, refused


# Lazy (half a batch, its first half) is caught by DisTrO's parts check: the half it skipped is
# not carried (verification.DISTRO_VERIFICATION); DiLoCo has no half-batch check.
DISTRO_ATTACKS = [
    Attack.Lazy,
    Attack.OtherData,
    Attack.SignFlip,
    Attack.RandomSigns,
    Attack.Targeted,
    Attack.Zero,
    Attack.Replay,
]
DILOCO_ATTACKS = [
    Attack.OtherData,
    Attack.SignFlip,
    Attack.RandomSigns,
    Attack.Scaled,
    Attack.Targeted,
    Attack.Zero,
    Attack.Replay,
]


@pytest.mark.parametrize(
    ("form", "attack"),
    [("distro", a) for a in DISTRO_ATTACKS] + [("bf16", a) for a in DILOCO_ATTACKS],
    ids=lambda x: getattr(x, "value", x),
)
def test_every_lying_round_is_refused_and_no_honest_one(form: str, attack: Attack) -> None:
    start = 3 if attack is Attack.Replay else 1  # a replayer needs a past to replay
    member = HostileMember(attack, start=start, lazy_fraction=0.5, seed=7)
    rounds, refused = run_rounds(form, {MEMBERS - 1: member}, rounds=start + 3)
    assert refused == 0
    assert member.lies == list(range(start, start + 3))
    assert [r[MEMBERS - 1] for r in rounds] == [True] * start + [False] * 3


def test_no_honest_result_is_refused_by_a_verifier_with_other_threads() -> None:
    """A bounded false-positive count (the benchmark runs 500 and more): 4 members x 12
    rounds, the verifier on two intra-op threads where the members use one."""
    rounds, refused = run_rounds("distro", {}, rounds=12, verifier_threads=2)
    assert len(rounds) * MEMBERS == 48
    assert refused == 0


def test_no_honest_result_is_refused_when_trainers_switch_roles() -> None:
    """The e2e run's case (an honest trainer's first round after rounds as a verifier): 2 of
    the 4 members sit each round out, drawn from a seed, and subtract the own results of the
    last round they trained, as clients do; the verifier on two threads."""

    def sits_out(step: int, i: int) -> bool:
        return i in random.Random(step).sample(range(MEMBERS), 2)

    rounds, refused = run_rounds("distro", {}, rounds=12, verifier_threads=2, sits_out=sits_out)
    assert sum(len(r) for r in rounds) == 24
    assert any(sits_out(s, i) and not sits_out(s + 1, i) for s in range(1, 12) for i in range(4))
    assert refused == 0


def test_a_member_back_from_sitting_out_subtracts_the_last_round_it_trained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As a client (`psyche.client.round.train.own_results_to_subtract`): member 0 sits round 2
    out (a verifier's or tie-breaker's round) and trains round 3 subtracting what it sent in
    round 1, not nothing (its momentum still holds that)."""
    run = VerificationRun(
        [tiny_trainer("distro") for _ in range(MEMBERS)],
        tiny_trainer("distro"),
        corpus_batches(3),
        sits_out=lambda step, i: i == 0 and step == 2,
    )
    trainer = run.trainers[0]
    train_exact = trainer.train_exact
    sent: list[list[DistroResult]] = []
    subtracted: list[list[list[DistroResult]]] = []

    def spy(*args: Any, **kwargs: Any) -> TrainOutput:
        subtracted.append(kwargs["prev_self_distro_results"])
        out = train_exact(*args, **kwargs)
        sent.append(out.distro_results or [])
        return out

    monkeypatch.setattr(trainer, "train_exact", spy)
    for step in (1, 2, 3):
        run.round(step)
    assert len(sent) == 2  # rounds 1 and 3
    assert subtracted[0] == []
    assert sent[0]
    assert subtracted[1] == [sent[0]]


def test_the_thresholds_are_the_run_optimizers() -> None:
    distro, diloco = tiny_trainer("distro"), tiny_trainer("bf16")
    assert verification_settings(distro).min_agreement > 0.0
    assert verification_settings(distro).max_balance == 0.0  # off: see DISTRO_VERIFICATION
    assert verification_settings(distro).min_part_agreement > 0.0  # a half batch is caught
    assert verification_settings(diloco).max_norm_ratio > 0.0


@pytest.mark.parametrize("form", ["distro", "bf16"])
def test_the_bias_attack_moves_the_update_one_percent_of_its_norm_along_its_direction(
    form: str,
) -> None:
    """The issue's hardest lie, as `hostile` plays it: per parameter, the decoded update moves
    `bias_fraction` of its norm along one fixed unit direction (1-bit DisTrO: by setting signs,
    so by at least that much)."""
    trainer = tiny_trainer(form)
    out = trainer.train_exact(
        1, corpus_batches(1)(1, 0), warmup_lr_between=None, zero_optim=False,
        prev_self_distro_results=[],
    )  # fmt: skip
    honest = trainer.prepare_result(out, step=1, batch_id=BatchId(0, 0)).sent
    member = HostileMember(Attack.Bias, seed=3)
    fmt = payload_format(trainer)
    biased = member.tamper(honest, fmt)
    directions = member._fixed_direction(fmt, len(honest))
    moved = []
    for i, (h, b, d) in enumerate(zip(honest, biased, directions)):
        if isinstance(fmt, DilocoFormat):
            decoded = [decode(x, fmt.layouts[i], torch.device("cpu")) for x in (h, b)]
        else:
            distro = trainer.distro
            assert distro is not None
            # one entry's decoded update (`_decode_results` reads slot 0 of each list)
            decoded = [distro._decode_results([[x]], 0, distro.variables[i][1]) for x in (h, b)]
        size = float(torch.linalg.vector_norm(decoded[0].float()))
        if size > 0.0:
            moved.append(float(((decoded[1] - decoded[0]).float() * d).sum()) / size)
    assert statistics.median(moved) >= 0.0099
    assert max(moved) < 0.2


def test_evidence_refuses_a_trainer_whose_window_of_agreements_is_too_low() -> None:
    settings = VerificationSettings(min_agreement=-6.0, min_window_agreement=5.0, window_rounds=3)

    def verdict(t: float) -> VerificationVerdict:
        return VerificationVerdict(True, t, -6.0, None, "", Measures(t, None, 0.0, None))

    low, recovering = Evidence(settings), Evidence(settings)
    # each round alone passes; three rounds of t = 2 sum to 2 x sqrt(3) = 3.46 < 5
    assert [low.add(verdict(2.0)).matches for _ in range(3)] == [True, True, False]
    refused = low.add(verdict(2.0))
    assert refused.check == "window"
    assert refused.score < refused.threshold == 5.0
    # (-1 + 3 + 3) / sqrt(3) = 2.9 is refused; once the low round leaves the window,
    # 3 x 3 / sqrt(3) = 5.2 passes
    ts = (-1.0, 3.0, 3.0, 3.0)
    assert [recovering.add(verdict(t)).matches for t in ts] == [True, True, False, True]
