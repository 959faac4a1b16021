"""A witness whose checks refuse an honest member's result must not get that member dropped
when its checks cannot be trusted yet (tests/e2e/test_training.py's killed-client test: the
joiner, elected the only witness of a round, refused an honest member's result at t = -7.50,
its momentum two rounds old against the members' long-remembering ones, and the next health
check dropped that member).

The real path a downloaded payload takes (`payloads.check_payload`: hash, decode, screen,
blooms), the witness sent from those blooms, the coordinator's consensus and the health checks
of the next round, on the simulated coordinator of `psyche.coordinator.testing`: a refused result
is never applied, and its sender is named by the health checks only when the witness's refusals
accuse (`witness.refusals_accuse`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import trio

from psyche.client.round import apply, payloads, witness
from psyche.client.round.state import RoundState
from psyche.client.round.steps import MachineSettings, StepStateMachine
from psyche.coordinator import RunState
from psyche.coordinator.model import Checkpoint, HubRepo
from psyche.coordinator.testing import Simulation, simulated_identity
from psyche.core.batch_id import BatchId
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.modeling.distro import DistroResult
from psyche.modeling.screening import Fingerprint, Measure, Verdict
from psyche.modeling.serialized_distro import TransmittableDistroResult

from ..modeling.tiny_trainer import make_trainer
from .machine_bus import Bus, BusIO, Node
from .result_delivery import deliver
from .round_sim import index_of, next_round, plan_for, training_sim

CLIENTS = 3


def refusing(refused: NodeIdentity, blind: bool = False) -> payloads.ScreenResult:
    """The witness checks' verdicts: `refused`'s result fails the agreement test, as the
    joiner's check of an honest result did in the end-to-end run (`blind`: judged by a witness
    with no update of its own, against the round's other results)."""

    async def screen(
        _round: RoundState, sender: NodeIdentity, _results: list[DistroResult]
    ) -> Verdict:
        fingerprint = Fingerprint(torch.zeros(4), 0.0)
        if sender == refused:
            problem = "agreement t = -7.50 is below -6"
            return Verdict(Measure(-7.5, 79.4, fingerprint), problem, blind=blind)
        return Verdict(Measure(9.0, 80.0, fingerprint), None, blind=blind)

    return screen


def announce_and_check(
    view: RoundState,
    sim: Simulation,
    me: NodeIdentity,
    refused: NodeIdentity,
    accuse: bool,
    blind: bool = False,
) -> None:
    """`me`'s own result of `view`'s round is recorded; every other member's reaches it and
    goes through the checks."""
    for batch, sender in view.data_assignments.items():
        if sender == me:
            payload = TransmittableDistroResult(view.step, 30, batch, [])
            payloads.record_verified_payload(view, me, batch, payload.compute_hash())
            continue
        tag = 1 + index_of(sim.coordinator, sender)
        deliver(view, sim, me, batch, sender, tag, refusing(refused, blind), accuse)


@pytest.mark.parametrize(
    ("accuse", "blind"),
    [(True, False), (False, False), (True, True)],
    ids=["trusted-witness", "young-witness", "witness-without-its-own-update"],
)
def test_a_refused_result_is_never_applied_and_its_sender_dropped_only_on_a_trusted_refusal(
    accuse: bool, blind: bool
) -> None:
    """A witness without an update of its own this round judges each result against the
    round's others, whose arrival order a trainer controls (a hostile first result raised the
    level above every honest one): its refusals withhold the vote but never accuse, whatever
    the witness's age."""
    sim = training_sim(clients=CLIENTS, batch=6, witness_nodes=1)
    next_round(sim)  # round 1: health checks judge from round 2 on
    ids = [simulated_identity(i) for i in range(CLIENTS)]
    views = {i: plan_for(sim.coordinator, ids[i]).state for i in range(CLIENTS)}  # round R
    next_round(sim)  # round R + 1: its one witness attests round R
    later = {i: plan_for(sim.coordinator, ids[i]).state for i in range(CLIENTS)}
    me = next(i for i, v in later.items() if v.committee_info.witness_proof.witness)
    refused = ids[(me + 1) % CLIENTS]
    announce_and_check(views[me], sim, ids[me], refused, accuse, blind)
    # the refused result settled its batch (the opportunistic witness need not wait for it)
    assert views[me].batch_ids_not_yet_trained_on is None
    sent = witness.witness_to_send(views[me], later[me])
    assert sent is not None
    step = sim.coordinator.progress.step
    sim.coordinator.witness(ids[me], sent, sim.now)
    sim.run_until(lambda c: c.run_state is RunState.RoundTrain and c.progress.step == step + 1, 30)

    # round R + 2: the refused result is in no vote, so nobody applies it
    plan = apply.plan_apply(views[me], sim.coordinator)
    refused_batch = next(b for b, n in views[me].data_assignments.items() if n == refused)
    assert plan.no_consensus == [refused_batch]
    assert refused_batch not in [c.batch_id for c in plan.chosen]
    # and the witness of round R + 1 names its sender only when its refusals accuse
    checks = witness.health_checks(later[me], sim.coordinator)
    named = [node for node, _ in checks]
    if accuse and not blind:
        assert named == [refused]
        assert sim.coordinator.health_check(ids[me], checks) == 1
    else:
        assert named == []
        assert all(c.state.name == "Healthy" for c in sim.coordinator.epoch_state.clients)


def test_only_a_witness_young_on_a_trained_model_withholds_its_accusations() -> None:
    # a run's first members: their momenta start together, their refusals accuse at once
    assert witness.refusals_accuse(False, 1)
    assert witness.refusals_accuse(False, 0)
    # not known: young (a client that has not told what it loaded must not accuse)
    assert not witness.refusals_accuse(None, 0)
    # a member that joined (or came back to) a trained model: not in its first rounds
    young = range(1, witness.YOUNG_WITNESS_ROUNDS + 1)
    assert not any(witness.refusals_accuse(True, rounds) for rounds in young)
    assert witness.refusals_accuse(True, witness.YOUNG_WITNESS_ROUNDS + 1)


@pytest.mark.parametrize(
    ("checkpoint", "young"),
    [(Checkpoint.P2P, True), (Checkpoint.Hub, False)],
    ids=["joined-from-peers", "first-members"],
)
def test_the_machine_knows_from_its_start_whether_its_checks_accuse(
    checkpoint: Callable[[HubRepo], Checkpoint], young: bool
) -> None:
    """A client that loaded the run's trained model from its peers is a young witness before
    it has trained at all: a joiner that is a verifier in its first round, or whose first
    training was cut, has no own update to judge by (it used to accuse at once, its
    `joined_trained_model` unset until its first training). The real `StepStateMachine`, as
    the client builds it on the state it joined at."""

    async def main() -> None:
        sim = training_sim(clients=2, batch=4, witness_nodes=1)
        state = sim.coordinator.copy()
        state.model.value.checkpoint = checkpoint(HubRepo.dummy())
        key = SecretKey.from_bytes(bytes(31) + bytes([1]))
        identity = NodeIdentity.from_single_key(key.public_key)
        async with trio.open_nursery() as nursery:
            machine = StepStateMachine(
                MachineSettings(identity=identity), make_trainer(), None, state,
                BusIO(Bus(sim), Node(key, identity)), nursery,
            )  # fmt: skip
            assert machine.momentum_rounds == 0
            assert machine.checks_accuse() is not young
            machine.momentum_rounds = witness.YOUNG_WITNESS_ROUNDS
            assert machine.checks_accuse() is not young
            machine.momentum_rounds += 1
            assert machine.checks_accuse()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_blind_witness_votes_over_the_whole_round_whatever_came_first() -> None:
    """A witness with no update of its own this round, in its first round (no aggregate, no
    closed round), checks a hostile member's result at the format's bound first, then three
    honest ones (real int8 DiLoCo results, the real glue: `screening.screen_result`). At its
    check the hostile result had nothing to be compared with and passed; its vote was cast at
    once and, as the round's only witness, it was applied. Now the vote waits for the witness
    to be sent (`payloads.settle_blind_votes`), where the whole round judges it: the hostile
    result is in no vote and nobody applies it, every honest one is, and its sender is not
    named (a blind refusal never accuses)."""
    from psyche.client.round import screening
    from psyche.modeling.hostile import DilocoFormat
    from psyche.modeling.screening import DILOCO_SCREENING, ResultReader, WitnessScreen

    from ..modeling.screening_rounds import honest_results

    clients = 5
    diloco, sent = honest_results("int8", members=clients)
    fmt = DilocoFormat(diloco.layouts())
    sim = training_sim(clients=clients, batch=clients, witness_nodes=1)
    next_round(sim)
    ids = [simulated_identity(i) for i in range(clients)]
    views = {i: plan_for(sim.coordinator, ids[i]).state for i in range(clients)}  # round R
    next_round(sim)  # round R + 1: its one witness attests round R
    later = {i: plan_for(sim.coordinator, ids[i]).state for i in range(clients)}
    me = next(i for i, v in later.items() if v.committee_info.witness_proof.witness)
    view = views[me]
    view.screen = WitnessScreen(ResultReader.of(diloco), DILOCO_SCREENING).open_round()
    view.reference_ready.set()  # no update of its own is coming
    hostile = ids[(me + 1) % clients]
    by_batch: dict[BatchId, list[DistroResult]] = {}
    order = sorted(view.data_assignments.items(), key=lambda item: item[1] != hostile)
    assert order[0][1] == hostile
    for n, (batch, sender) in enumerate(order):
        if sender == ids[me]:
            payload = TransmittableDistroResult(view.step, 30, batch, [])
            payloads.record_verified_payload(view, sender, batch, payload.compute_hash())
            continue
        results = sent[n]
        if sender == hostile:
            results = [fmt.at_bound(r, i) for i, r in enumerate(results)]
        by_batch[batch] = results
        deliver(
            view, sim, ids[me], batch, sender, 10 + n, screening.screen_result, True,
            lambda p: by_batch[p.batch_id],
        )  # fmt: skip
    assert len(view.blind_votes) == clients - 1  # held back, the hostile one's too
    sent_witness = witness.witness_to_send(view, later[me])
    assert sent_witness is not None
    assert not view.blind_votes
    step = sim.coordinator.progress.step
    sim.coordinator.witness(ids[me], sent_witness, sim.now)
    sim.run_until(lambda c: c.run_state is RunState.RoundTrain and c.progress.step == step + 1, 30)

    plan = apply.plan_apply(view, sim.coordinator)
    hostile_batch = next(b for b, n in view.data_assignments.items() if n == hostile)
    assert plan.no_consensus == [hostile_batch]
    # every honest peer's result is applied (this witness's own was only recorded here)
    assert sorted(c.batch_id for c in plan.chosen) == sorted(by_batch.keys() - {hostile_batch})
    assert witness.health_checks(later[me], sim.coordinator) == []
