"""Exact shadow verification (`psyche.modeling.verification.Shadow`, `follow`, `verify_exact`):
a verifier that follows each trainer from the trainer's first round keeps the trainer's own
optimizer state and rebuilds its payload bit for bit, so that any lie (the 1 % bias included)
is caught the round it starts. Tiny Llamas trained as clients train them, in the verification
simulation (`psyche.modeling.verification_sim`)."""

from __future__ import annotations

import random

import pytest
import torch

from psyche.core.batch_id import BatchId
from psyche.modeling.hostile import Attack, HostileMember
from psyche.modeling.trainer import OwnState, Trainer, TrainerError
from psyche.modeling.verification import Shadow, compare_exact, follow
from psyche.modeling.verification_sim import VerificationRun, tiny_trainer

from .verification_members import MEMBERS, corpus_batches, same_bits, state, trained_one_step


def shadow_run(
    form: str,
    rounds: int,
    hostile: dict[int, HostileMember] | None = None,
    **options: object,
) -> tuple[VerificationRun, list[dict[int, bool]], list[dict[int, bool]]]:
    """A run whose verifier follows every member from round `shadow_from` (default 1); each
    round's exact verdicts and statistical ones (member -> matched)."""
    options.setdefault("shadow_from", 1)
    run = VerificationRun(
        [tiny_trainer(form) for _ in range(MEMBERS)],
        tiny_trainer(form),
        corpus_batches(rounds),
        hostile or {},
        **options,  # type: ignore[arg-type]
    )
    exact, statistical = [], []
    for step in range(1, rounds + 1):
        verified = run.round(step)
        exact.append({i: v.matches for i, v in verified.exact.items()})
        statistical.append({i: v.matches for i, v in verified.verdicts.items()})
    return run, exact, statistical


def weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach() for _, p in trainer.model.variables()]


@pytest.mark.parametrize("form", ["distro", "bf16", "sparse"])
def test_an_honest_trainers_shadow_rebuilds_its_payload_bit_for_bit_every_round(
    form: str,
) -> None:
    """Members sit rounds out (a verifier's or tie-breaker's round: the shadow does not move,
    the owed results wait), so the shadow's state goes through a client's paths; every honest
    payload is the shadow's, and the verifier's own weights and state are left exact (it ends
    with the members' weights, bit for bit)."""

    def sits_out(step: int, i: int) -> bool:
        return i in random.Random(step).sample(range(MEMBERS), 1)

    run, exact, statistical = shadow_run(form, 5, sits_out=sits_out)
    assert statistical == [{}] * 5  # every member followed: no statistical comparison
    assert sum(len(r) for r in exact) == 5 * (MEMBERS - 1)
    assert all(all(r.values()) for r in exact)
    assert same_bits(weights(run.verifier), weights(run.trainers[0]))
    if form == "distro":
        # the verifier trained nothing of its own: its momentum is still zero
        distro = run.verifier.distro
        assert distro is not None
        assert all(not bool(d.any()) for d in distro.deltas)


@pytest.mark.parametrize("form", ["distro", "bf16"])
def test_a_one_percent_bias_is_caught_the_round_it_starts_and_every_round_after(
    form: str,
) -> None:
    member = HostileMember(Attack.Bias, start=1, seed=7)
    _, exact, _ = shadow_run(form, 4, {MEMBERS - 1: member})
    assert member.lies == [1, 2, 3]
    assert [r[MEMBERS - 1] for r in exact] == [True, False, False, False]
    assert all(r[i] for r in exact for i in range(MEMBERS - 1))


@pytest.mark.parametrize("attack", [Attack.Lazy, Attack.OtherData])
def test_a_trainer_that_trains_on_other_rows_is_caught_the_round_it_starts(
    attack: Attack,
) -> None:
    """The lie is in the training, not the payload (its own state diverges too)."""
    member = HostileMember(attack, start=1, lazy_fraction=0.5, seed=7)
    _, exact, _ = shadow_run("distro", 3, {0: member})
    assert [r[0] for r in exact] == [True, False, False]
    assert all(r[i] for r in exact for i in range(1, MEMBERS))


@pytest.mark.parametrize("form", ["distro", "bf16"])
def test_a_verifier_with_another_thread_count_rebuilds_the_same_bits(form: str) -> None:
    """The members train on torch's default intra-op threads, the verifier on one more (at
    the tiny size the CPU's bits do not depend on it; docs/reliability.md has a larger
    model's, where they do)."""
    threads = torch.get_num_threads() + 1
    _, exact, _ = shadow_run(form, 4, verifier_threads=threads)
    assert sum(len(r) for r in exact) == 4 * MEMBERS
    assert all(all(r.values()) for r in exact)


def test_a_shadow_cannot_start_mid_life_so_that_trainer_is_compared_statistically() -> None:
    """From round 2 the verifier follows only a member whose first round it sees (member 0 sat
    round 1 out); the others trained before and are compared statistically. A fresh shadow of a
    member with a history does not rebuild its payload: its momentum is not published."""
    run, exact, statistical = shadow_run(
        "distro", 3, shadow_from=2, sits_out=lambda step, i: i == 0 and step == 1
    )
    assert exact == [{}, {0: True}, {0: True}]
    assert statistical[0] == {1: True, 2: True, 3: True}
    assert statistical[1] == statistical[2] == {1: True, 2: True, 3: True}
    # member 1 trained rounds 1 to 3: its round 4 against a shadow started now
    trainer, late = run.trainers[1], Shadow.fresh(run.verifier)
    batch = corpus_batches(4)(4, 1)
    out = trainer.train_exact(
        4, batch, warmup_lr_between=None, zero_optim=False,
        prev_self_distro_results=[run._prev[1]],
    )  # fmt: skip
    published = trainer.prepare_result(out, step=4, batch_id=BatchId(1, 1)).payload
    rebuilt = follow(run.verifier, late, batch, step=4, batch_id=BatchId(1, 1))
    verdict = compare_exact(rebuilt, published)
    assert not verdict.matches
    assert verdict.differing > 0


@pytest.mark.parametrize("form", ["distro", "bf16"])
def test_following_leaves_a_verifier_with_its_own_history_alone(form: str) -> None:
    """A verifier that trains too (its own momentum or residual, inner AdamW state, a pending
    own update) follows a trainer: its weights, gradients, own state and nonce are as before, and
    the shadow holds the trainer's state, not the verifier's."""
    batch = corpus_batches(3)
    verifier, _ = trained_one_step(form, batch)
    before, nonce = state(verifier), verifier.nonce
    shadow = Shadow.fresh(verifier)
    follow(verifier, shadow, batch(2, 1), step=2, batch_id=BatchId(1, 1))
    assert same_bits(state(verifier), before)
    assert verifier.nonce == nonce
    assert shadow.followed == 2
    with pytest.raises(RuntimeError, match="not after it"):
        follow(verifier, shadow, batch(2, 1), step=2, batch_id=BatchId(1, 1))


def test_a_state_of_another_optimizer_leaves_the_trainer_untouched() -> None:
    """`swap_own_state` checks every key of the state before it swaps any: a state holding a
    component this trainer lacks (here DisTrO's momentum beside DiLoCo's residual, given to a
    DisTrO trainer) raises and leaves the trainer's own state and the state given as they
    were. Before, the keys were checked one by one as they were swapped: DisTrO's momentum was
    swapped in before the DiLoCo key raised, leaving the trainer half-swapped."""
    batch = corpus_batches(2)
    trainer, _ = trained_one_step("distro", batch)
    assert trainer.distro is not None
    deltas, before = trainer.distro.deltas, state(trainer)
    mixed = OwnState(
        {**trainer.fresh_own_state().values, **tiny_trainer("bf16").fresh_own_state().values}
    )
    given = dict(mixed.values)
    with pytest.raises(TrainerError, match="diloco"):
        trainer.swap_own_state(mixed)
    assert trainer.distro.deltas is deltas
    assert same_bits(state(trainer), before)
    assert all(mixed.values[key] is value for key, value in given.items())
