"""A verifier's plan of its round (`psyche.client.round.verify`): its duties are the
coordinator's, and each duty's decoy is a batch of the round that another trainer trained. A
tie-breaker's next-round work is only the disputed batches (and their decoys), after every
verifier's report or its wait's bound."""

from __future__ import annotations

import dataclasses

import trio
import trio.testing

from psyche.client.round.fetch import DataFetcher
from psyche.client.round.state import RoundState
from psyche.client.round.train import OwnResult, TrainingStep, run_round
from psyche.client.round.verify import (
    HeldRound,
    Recomputations,
    VerifyJob,
    decoy_for,
    disputes,
    plan_verification,
    recompute_disputes,
    round_reports_when_settled,
)
from psyche.coordinator import Coordinator, RunState, TickResult
from psyche.coordinator.data_selection import verification_duties_for_state
from psyche.coordinator.testing import (
    integration_test_coordinator,
    keyed_identity,
    simulated_identity,
    simulated_key,
)
from psyche.coordinator.verification import (
    NO_DRAW,
    Finding,
    RoundDuties,
    RoundVerification,
    VerificationDuty,
    VerificationReport,
)
from psyche.core import BatchId
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.core.token_size import TokenSize
from psyche.data_provider.dummy import DummyDataProvider
from psyche.modeling.verification import save_weights

from ..modeling.tiny_trainer import make_trainer
from .support import train_job

IDS = [simulated_identity(i) for i in range(6)]


def round_of(percent: int) -> Coordinator:
    coordinator = integration_test_coordinator(6, 12, 0)
    coordinator.config.verification_percent = percent
    assert coordinator.tick(IDS, 100, 1) == TickResult.Ticked()
    assert coordinator.tick(IDS, 125, 42) == TickResult.Ticked()
    assert coordinator.run_state is RunState.RoundTrain
    return coordinator


def test_no_duties_in_an_upstream_run() -> None:
    coordinator = round_of(0)
    assert all(plan_verification(coordinator, i, None) is None for i in IDS)


def test_the_plan_is_the_coordinators_duties_with_decoys_of_other_trainers() -> None:
    coordinator = round_of(40)
    duties = verification_duties_for_state(coordinator)
    trainers = dict(duties.assigned)
    plans = {i: plan_verification(coordinator, i, None) for i in IDS}
    planned = [p for p in plans.values() if p is not None]
    assert sum(p.tie_breaker for p in planned) == 1
    assert len(planned) == 1 + len({d.verifier for d in duties.verifiers})
    for identity, plan in plans.items():
        if plan is None:
            assert not duties.of(identity)
            continue
        assert list(plan.duties) == duties.of(identity)
        for duty in plan.duties:
            decoy = plan.decoys[duty.batch_id]
            assert decoy in trainers
            assert trainers[decoy] != duty.trainer
        # each batch recomputed once, decoys included
        assert len(plan.batches()) == len(set(plan.batches()))
        if len({d.trainer for d in plan.duties}) > 1:  # its duties are each other's decoys
            assert set(plan.batches()) == {d.batch_id for d in plan.duties}


def test_a_lone_trainers_decoy_is_the_data_after_the_round() -> None:
    duty = VerificationDuty(BatchId(8, 11), IDS[0], IDS[1])
    assert decoy_for(duty, {BatchId(8, 11): IDS[0]}) == BatchId(12, 15)
    two = {BatchId(0, 3): IDS[0], BatchId(4, 7): IDS[0], BatchId(8, 11): IDS[2]}
    assert decoy_for(VerificationDuty(BatchId(4, 7), IDS[0], IDS[1]), two) == BatchId(8, 11)
    assert decoy_for(VerificationDuty(BatchId(8, 11), IDS[2], IDS[1]), two) == BatchId(0, 3)


def test_a_verifiers_own_duties_are_its_decoys_first() -> None:
    # two duties of two trainers: each the other's decoy (no third recompute), although another
    # trainer's batch comes first in ascending order
    three = {BatchId(0, 3): IDS[0], BatchId(4, 7): IDS[2], BatchId(8, 11): IDS[3]}
    own = [BatchId(0, 3), BatchId(8, 11)]
    assert decoy_for(VerificationDuty(BatchId(0, 3), IDS[0], IDS[1]), three, own) == own[1]
    assert decoy_for(VerificationDuty(BatchId(8, 11), IDS[3], IDS[1]), three, own) == own[0]
    # its own duties all one trainer's: the round's next batch of another trainer
    one = [BatchId(0, 3)]
    assert decoy_for(VerificationDuty(BatchId(0, 3), IDS[0], IDS[1]), three, one) == BatchId(4, 7)


def _tie_breakers_plan() -> tuple[VerifyJob, RoundDuties]:
    coordinator = round_of(40)
    duties = verification_duties_for_state(coordinator)
    plans = [plan_verification(coordinator, i, None) for i in IDS]
    (job,) = [p for p in plans if p is not None and p.tie_breaker]
    return job, duties


def test_a_tie_breaker_recomputes_only_the_disputed_batches_with_their_decoys() -> None:
    job, duties = _tie_breakers_plan()
    accused = duties.verifiers[0]
    silent = {
        d.verifier: VerificationReport(duties.step, [Finding(d.batch_id, True, 20.0)])
        for d in duties.verifiers
    }
    assert disputes(job, silent).duties == ()  # no dispute: nothing to recompute
    accusing = dict(silent)
    accusing[accused.verifier] = VerificationReport(
        duties.step, [Finding(accused.batch_id, False, 1.0)]
    )
    # a tie-breaker's own report is no accusation
    tie = job.duties[0].verifier
    accusing[tie] = VerificationReport(duties.step, [Finding(job.duties[-1].batch_id, False, 1.0)])
    disputed = disputes(job, accusing)
    assert [d.batch_id for d in disputed.duties] == [accused.batch_id]
    assert disputed.tie_breaker
    decoy = disputed.decoys[accused.batch_id]
    assert dict(duties.assigned)[decoy] != accused.trainer
    assert len(disputed.batches()) == 2  # the batch and its decoy: two recomputes


def test_the_tie_breaker_waits_for_every_verifiers_report_but_no_longer_than_its_bound() -> None:
    job, duties = _tie_breakers_plan()
    verifiers = list(dict.fromkeys(d.verifier for d in duties.verifiers))
    heard: dict[NodeIdentity, VerificationReport] = {}
    reads: list[float] = []

    async def read(step: int) -> dict[NodeIdentity, VerificationReport]:
        assert step == job.step
        reads.append(trio.current_time())
        return dict(heard)

    async def main() -> None:
        start = trio.current_time()
        # nobody reported: it waits its bound, then goes on with what it has (nothing)
        assert await round_reports_when_settled(job, read, start + 3.0) == {}
        assert 3.0 <= trio.current_time() - start < 3.5
        # every verifier reported: one read, no wait
        heard.update({v: VerificationReport(job.step, []) for v in verifiers})
        reads.clear()
        start = trio.current_time()
        assert set(await round_reports_when_settled(job, read, start + 3.0)) == set(verifiers)
        assert trio.current_time() == start
        assert len(reads) == 1

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_tie_breaker_that_trains_recomputes_its_disputes_and_still_trains_its_batches() -> None:
    # the last round's tie-breaker is a trainer of this one: its disputes are recomputed (from
    # the saved weights) right after the apply, while its own batches are already being fetched
    job, duties = _tie_breakers_plan()
    accused = duties.verifiers[0]
    reports = {
        accused.verifier: VerificationReport(duties.step, [Finding(accused.batch_id, False, 1.0)])
    }
    trainer = make_trainer()
    assigned = [BatchId(200, 201), BatchId(202, 203)]
    recomputed = Recomputations()
    published: list[OwnResult] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            fetcher = DataFetcher(DummyDataProvider(TokenSize.FourBytes, 16, 256), nursery)
            held = HeldRound(job, RoundState(), save_weights(trainer))
            handle = TrainingStep()

            async def verify() -> None:
                disputed = await recompute_disputes(
                    handle, trainer, held, reports, fetcher, recomputed
                )
                assert disputed is not None
                assert set(recomputed.domains) == set(disputed.batches())

            train = train_job(job.step + 1, assigned, [])
            await run_round(handle, trainer, None, train, fetcher, published.append, verify)
            finished = await handle.finish()
            assert sorted(finished.trained) == assigned  # the dispute's fetch took none of them
            assert len(recomputed.domains) == 2  # the disputed batch and its decoy

    trio.run(main)
    assert sorted(r.batch_id for r in published) == assigned


def a_drawing_round() -> tuple[Coordinator, RoundDuties, NodeIdentity, dict[bytes, SecretKey]]:
    """6 clients with real keys at 20 %: 1 tie-breaker, 1 verifier, 4 trainers (a pool of 4,
    2 of them drawn by the verifier's signature); the round, its duties, its verifier, the keys."""
    keys = {keyed_identity(i).signer: simulated_key(i) for i in range(6)}
    ids = [keyed_identity(i) for i in range(6)]
    coordinator = integration_test_coordinator(6, 12, 0)
    coordinator.config.verification_percent = 20
    assert coordinator.tick(ids, 100, 1) == TickResult.Ticked()
    assert coordinator.tick(ids, 125, 42) == TickResult.Ticked()
    duties = verification_duties_for_state(coordinator)
    (verifier,) = {d.verifier for d in duties.verifiers}
    return coordinator, duties, verifier, keys


def test_a_verifier_checks_what_its_own_signature_draws_from_its_pool() -> None:
    # 6 clients at 20 %: 1 tie-breaker, 1 verifier, 4 trainers: a pool of 4, 2 of them drawn by
    # the verifier's signature (which nobody else can compute before its report reveals it)
    coordinator, duties, verifier, keys = a_drawing_round()
    assert len(duties.pool(verifier)) == 4
    assert plan_verification(coordinator, verifier, None) is None  # no key: no acceptable draw
    plan = plan_verification(coordinator, verifier, keys[verifier.signer].sign)
    assert plan is not None
    assert len(plan.duties) == 2
    assert duties.drawn(verifier, plan.draw) == list(plan.duties)
    # its report, with the draw the plan keeps, is heard; the same findings without it are not
    findings = [Finding(d.batch_id, True, 0.0) for d in plan.duties]
    assert (
        RoundVerification(duties).add(verifier, VerificationReport(plan.step, findings, plan.draw))
        is None
    )
    assert (
        RoundVerification(duties).add(verifier, VerificationReport(plan.step, findings)) is not None
    )


def test_a_tie_breaker_recomputes_only_disputes_whose_draw_it_can_check() -> None:
    # 6 clients at 20 %: a pool of 4, drawn by the verifier's signature. What the tie-breaker
    # reads back (server relay, Solana account) is heard under the coordinator's rule: an
    # accusation relayed without its draw, or with the verifier's draw of another run (same
    # members, step and pool), makes it recompute nothing; the verifier's own draw does.
    coordinator, duties, verifier, keys = a_drawing_round()
    (tie_breaker,) = {d.verifier for d in duties.tie_breakers}
    job = plan_verification(coordinator, tie_breaker, None)
    assert job is not None
    sign = keys[verifier.signer].sign
    plan = plan_verification(coordinator, verifier, sign)
    assert plan is not None
    accused = plan.duties[0].batch_id
    elsewhere = dataclasses.replace(duties, run_id="another-run").draw_message(verifier)

    def accusation(draw: bytes) -> dict[NodeIdentity, VerificationReport]:
        return {verifier: VerificationReport(plan.step, [Finding(accused, False, 9.0)], draw)}

    assert disputes(job, accusation(NO_DRAW)).duties == ()
    assert disputes(job, accusation(sign(elsewhere))).duties == ()
    assert [d.batch_id for d in disputes(job, accusation(plan.draw)).duties] == [accused]
