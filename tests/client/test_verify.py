"""A verifier's plan of its round (`psyche.client.round.verify`): its duties are the
coordinator's, and each duty's decoy is a batch of the round that another trainer trained."""

from __future__ import annotations

from psyche.client.round.verify import decoy_for, plan_verification
from psyche.coordinator import Coordinator, RunState, TickResult
from psyche.coordinator.data_selection import verification_duties_for_state
from psyche.coordinator.testing import integration_test_coordinator, simulated_identity
from psyche.coordinator.verification import VerificationDuty
from psyche.core import BatchId

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
    assert all(plan_verification(coordinator, i) is None for i in IDS)


def test_the_plan_is_the_coordinators_duties_with_decoys_of_other_trainers() -> None:
    coordinator = round_of(40)
    duties = verification_duties_for_state(coordinator)
    trainers = dict(duties.assigned)
    plans = {i: plan_verification(coordinator, i) for i in IDS}
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
