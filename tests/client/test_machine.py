"""The state machine shell with real training, without sockets: several `StepStateMachine`s on
tiny Llamas exchange messages through an in-memory bus while a simulated coordinator (the
server's rules, a simulated clock) runs the rounds. Checks that every client keeps bit-identical
weights, that each round's batches are trained once and applied in the next-but-one round, and
that a payload not matching its commitment is refused by everyone.

The simulated clock advances only while nothing is in flight (no message on the bus, no client
computing): computing takes no simulated time, so a slow (busy) machine cannot make a client
miss a round, as it could when the clock ran on regardless."""

from __future__ import annotations

import logging
import random

import pytest
import trio

from psyche.client.checkpoints.cooldown import live_model_hash
from psyche.client.round.apply import ApplyError, ApplyJob, ApplyPlan, ChosenResult, apply_results
from psyche.client.round.broadcast import Broadcast, BroadcastType
from psyche.client.round.fetch import DataFetcher
from psyche.client.round.payloads import PayloadRejected
from psyche.client.round.state import DeserializedPayload, Downloading, PayloadHandle, RoundState
from psyche.client.round.steps import MachineSettings, StepStateMachine
from psyche.coordinator import Coordinator, RunState
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.testing import Simulation, integration_test_coordinator
from psyche.core.batch_id import BatchId
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.modeling.trainer import Trainer

from ..modeling.tiny_trainer import make_trainer
from .machine_bus import (
    Bus,
    BusIO,
    FakeData,
    Node,
)
from .simulated_run import run_simulated

pytestmark = pytest.mark.usefixtures("single_thread")


def trained_per_step(nodes: list[Node]) -> dict[int, list[BatchId]]:
    out: dict[int, list[BatchId]] = {}
    for node in nodes:
        for result in node.sent_results:
            out.setdefault(result.step, []).append(result.batch_id)
    return out


def test_clients_stay_bit_identical_through_rounds(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")
    bus, nodes = trio.run(run_simulated, 3, 6)
    hashes = {live_model_hash(node.machine.trainer) for node in nodes}
    assert len(hashes) == 1
    assert hashes != {live_model_hash(make_trainer())}  # results were applied
    # every round's batches were trained exactly once, by three different clients
    for step, batches in trained_per_step(nodes).items():
        assert len(batches) == len(set(batches)) == 3, step
        indices = sorted(i for b in batches for i in b)
        assert indices == list(range(indices[0], indices[0] + 6))
    applied = [r for r in caplog.records if r.getMessage() == "applied_results"]
    assert applied
    assert all(len(r.psyche_fields["batches"]) == 3 for r in applied)
    assert bus.rejected_witnesses == []


def test_a_client_a_moment_behind_keeps_the_results_sent_before_its_round_started(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that learns of each new round after its peers have already gossiped their
    results for it (a slower link to the coordinator): the results are held until its round
    starts, so it applies the same results as everyone (before, it dropped them as being for
    an unknown step, applied fewer batches and its weights left the run's)."""
    caplog.set_level(logging.INFO, logger="psyche.client")
    _bus, nodes = trio.run(lambda: run_simulated(3, 6, late=2))
    assert len({live_model_hash(node.machine.trainer) for node in nodes}) == 1
    assert not [r for r in caplog.records if r.getMessage() == "untrained_batch"]
    applied = [r for r in caplog.records if r.getMessage() == "applied_results"]
    assert applied
    assert all(len(r.psyche_fields["batches"]) == 3 for r in applied)


def test_a_payload_that_does_not_match_its_commitment_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")
    _bus, nodes = trio.run(lambda: run_simulated(3, 5, corrupt=2))
    rejected = [r for r in caplog.records if r.getMessage() == "payload_rejected"]
    assert rejected
    assert all("hash" in r.psyche_fields["reason"] for r in rejected)
    cheater = str(nodes[2].identity)
    assert {r.psyche_fields["sender"] for r in rejected} == {cheater}
    cheater_batches = {r.batch_id for r in nodes[2].sent_results}
    honest = {str(n.identity) for n in nodes[:2]}
    for record in caplog.records:
        if record.getMessage() == "applied_results" and (
            record.psyche_fields["client_id"] in honest
        ):
            assert not cheater_batches & set(record.psyche_fields["batches"])
    # the honest clients applied the same results (the cheater applies its own payloads, which
    # only it holds in their committed form, whenever it is the round's witness)
    assert len({live_model_hash(node.machine.trainer) for node in nodes[:2]}) == 1


def test_a_client_that_cannot_apply_the_agreed_results_stops_with_its_model_stale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client whose downloads stop arriving cannot apply what the run agreed on: it says so
    (`apply_failed`), stops training and marks its model stale (`left_run`: the client joins
    again and reloads it), where it ended with "unexpected ApplyError" before (seen when a
    punched path died mid-round). The others go on with identical weights. Every client
    witnesses every round, so the one that stops leaves the round's other witnesses (with one
    witness a round, its silence would end the epoch for everyone: another test)."""
    caplog.set_level(logging.INFO, logger="psyche.client")
    _bus, nodes = trio.run(
        lambda: run_simulated(3, 7, lose_downloads=2, max_round_train_time=3, witness_nodes=0)
    )
    failed = [r.psyche_fields for r in caplog.records if r.getMessage() == "apply_failed"]
    assert len(failed) == 1, failed
    assert "not downloaded in time" in failed[0]["error"], failed
    assert nodes[2].machine.left_run
    assert not any(n.machine.left_run for n in nodes[:2])
    stopped_at = failed[0]["step"]
    assert nodes[2].sent_results
    assert all(r.step < stopped_at for r in nodes[2].sent_results)
    assert "training step failed" not in caplog.text  # an outcome, not a crash: no traceback
    assert len({live_model_hash(node.machine.trainer) for node in nodes[:2]}) == 1


def test_apply_skips_refused_payloads_and_fails_on_missing_ones() -> None:
    from types import SimpleNamespace

    calls: list[tuple[int, list]] = []  # type: ignore[type-arg]
    trainer = SimpleNamespace(
        optimize=lambda step, warmup_lr_between, distro_results: calls.append(
            (step, distro_results)
        ),
        synchronize=lambda: None,
        start_epoch=lambda: None,
    )
    b1, b2 = BatchId(0, 1), BatchId(2, 3)
    h1, h2 = b"1" * 32, b"2" * 32
    plan = ApplyPlan(
        step=5,
        batch_ids=[b1, b2],
        chosen=[
            ChosenResult(b1, Commitment(b"a" * 32, bytes(64)), h1),
            ChosenResult(b2, Commitment(b"b" * 32, bytes(64)), h2),
        ],
        untrained=[],
        no_consensus=[],
    )
    coordinator = integration_test_coordinator(2, 4, 1)

    async def scenario() -> None:
        state = RoundState()
        refused, good = PayloadHandle(), PayloadHandle()
        refused.set_error(PayloadRejected("payload hash does not match the commitment"))
        good.set_result(DeserializedPayload(["results-of-b2"], 3))  # type: ignore[list-item]
        state.downloads = {h1: refused, h2: good}
        job = ApplyJob(plan, state, coordinator, None, trio.current_time() + 5)
        assert await apply_results(trainer, job) == [b2]  # type: ignore[arg-type]
        assert calls == [(5, [["results-of-b2"]])]
        assert state.downloads == {}
        # a chosen payload that never arrives: the apply fails once the deadline passes
        missing = RoundState()
        owner = NodeIdentity.from_single_key(bytes(32))
        missing.downloads = {h1: Downloading(owner, b1, None), h2: good}  # type: ignore[arg-type]
        late = ApplyJob(plan, missing, coordinator, None, trio.current_time() + 0.3)
        with pytest.raises(ApplyError, match="not downloaded in time"):
            await apply_results(trainer, late)  # type: ignore[arg-type]

    trio.run(scenario)


def _one_of_two_at_warmup(
    nursery: trio.Nursery,
) -> tuple[StepStateMachine, Coordinator, NodeIdentity]:
    """The machine of the first of two clients of a run at its warmup, that state, and the
    other client's identity."""
    sim = Simulation(integration_test_coordinator(2, 4, 1), now=1_000_000, rng=random.Random(5))
    key = SecretKey.from_bytes(bytes(31) + bytes([1]))
    identity = NodeIdentity.from_single_key(key.public_key)
    other = NodeIdentity.from_single_key(SecretKey.from_bytes(bytes(31) + bytes([2])).public_key)
    sim.join(identity)
    sim.join(other)
    sim.run_until(lambda c: c.run_state is RunState.Warmup, 10)
    io = BusIO(Bus(sim), Node(key, identity))
    machine = StepStateMachine(
        MachineSettings(identity=identity), make_trainer(),
        DataFetcher(FakeData(), nursery), sim.coordinator.copy(), io, nursery,
    )  # fmt: skip
    return machine, sim.coordinator.copy(), other


def test_only_a_round_trained_without_the_client_makes_its_model_stale() -> None:
    """Leaving between epochs keeps the model (an epoch that ended with every client withdrawn
    empties the client list: dropping the model there restarted a run from its initial
    weights); a round the run trains without this client makes it stale (`left_run`)."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            machine, warmup, _ = _one_of_two_at_warmup(nursery)
            for run_state, stale in (
                (RunState.WaitingForMembers, False),
                (RunState.Warmup, False),
                (RunState.RoundTrain, True),
            ):
                state = warmup.copy()
                state.run_state = run_state
                state.epoch_state.clients = []
                await machine.apply_state(state)
                assert machine.left_run is stale, run_state
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("others_listed", [True, False])
def test_a_client_dropped_at_the_epochs_last_round_drops_its_model(others_listed: bool) -> None:
    """A health check at the end of the epoch's last round drops this client: the Cooldown
    lists the others, whose cooldown applies that round, and not it. It kept its model (a round
    behind) and trained the next epoch with it beside the others' (CI run 25: two honest
    clients' cooldown hashes differed from then on). Now its model is stale (`left_run`: the
    client joins again and loads the run's model). A Cooldown listing nobody holds no newer
    model: the model is kept, as between epochs."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            machine, warmup, other = _one_of_two_at_warmup(nursery)
            state = warmup.copy()
            state.run_state = RunState.Cooldown
            state.epoch_state.clients = [c for c in state.epoch_state.clients if c.id == other]
            if not others_listed:
                state.epoch_state.clients = []
            await machine.apply_state(state)
            assert machine.left_run is others_listed
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_client_that_missed_the_epochs_last_round_does_not_freeze_its_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client busy while the epoch's last round went by (its RoundTrain and RoundWitness
    states replaced by the Cooldown before it looked) never applied that round's results. It
    froze its model anyway: its cooldown hash, under the same step as its peers', differed from
    theirs (a model a round behind, shared to joiners and checkpointed). Now it says so
    (`missed_round`) and its model is stale (`left_run`: the client joins again and loads the
    run's model); the others' cooldown hashes agree."""
    caplog.set_level(logging.INFO, logger="psyche.client")

    def last_round(i: int, state: Coordinator) -> bool:
        epoch = state.epoch_state
        return (
            i == 2
            and state.run_state in (RunState.RoundTrain, RunState.RoundWitness)
            and epoch.last_step_set()
            and state.progress.step == epoch.last_step - 1
        )

    _bus, nodes = trio.run(
        lambda: run_simulated(3, 100, witness_nodes=0, epoch_time=20, blind=last_round)
    )
    frozen = [r.psyche_fields for r in caplog.records if r.getMessage() == "cooldown_model"]
    missed = [r.psyche_fields for r in caplog.records if r.getMessage() == "missed_round"]
    blind_id = str(nodes[2].identity)
    hashes = {f["client_id"]: f["model_hash"].hex()[:16] for f in frozen if f["epoch"] == 0}
    assert len(set(hashes.values())) == 1, hashes  # before: the blind client's differed
    assert set(hashes) == {str(n.identity) for n in nodes[:2]}, hashes
    assert len(missed) == 1, missed
    assert missed[0]["last_seen"] == missed[0]["step"] - 2, missed
    assert nodes[2].machine.left_run
    assert not any(n.machine.left_run for n in nodes[:2])
    applied = {
        (r.psyche_fields["client_id"], r.psyche_fields["step"])
        for r in caplog.records
        if r.getMessage() == "applied_results"
    }
    last = missed[0]["step"] - 1  # the round it did not see, whose apply the others ran
    assert {c for c, step in applied if step == last} == {str(n.identity) for n in nodes[:2]}
    assert blind_id not in {c for c, _ in applied if _ == last}


def test_a_result_the_run_agreed_on_that_arrived_after_the_apply_makes_the_model_stale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Client 0 gets client 1's result of one round only after it has started the round that
    applies it (a slow gossip path under load): its apply plan, made from what it held, left
    the batch out as untrained, while the witnesses' quorum (clients 1 and 2) voted for it and
    the others applied it. Client 0 went on with a model no other client had (three such
    clients, each missing a different peer's result, end with three different models). Now
    the late announcement is checked against the consensus the plan used: client 0 logs
    `missed_result` and its model is stale (`left_run`: the client joins again and loads the
    run's model); the clients still in the run hold identical weights."""
    caplog.set_level(logging.INFO, logger="psyche.client")
    held_steps: list[int] = []

    def late_result(sender: int, receiver: int, broadcast: Broadcast) -> bool:
        if sender != 1 or receiver != 0:
            return False
        if not isinstance(broadcast.data, BroadcastType.TrainingResult):
            return False
        if not held_steps:
            held_steps.append(broadcast.step + 1)  # the second round client 1 trains
        return broadcast.step == held_steps[0]

    _bus, nodes = trio.run(lambda: run_simulated(3, 6, witness_nodes=0, hold=late_result))
    in_run = [n for n in nodes if not n.machine.left_run]
    assert len({live_model_hash(n.machine.trainer) for n in in_run}) == 1  # before: two models
    assert nodes[0].machine.left_run
    missed = [r.psyche_fields for r in caplog.records if r.getMessage() == "missed_result"]
    assert len(missed) == 1, missed
    assert missed[0]["step"] == held_steps[0], missed
    assert missed[0]["trainer"] == str(nodes[1].identity), missed
    untrained = [r.psyche_fields for r in caplog.records if r.getMessage() == "untrained_batch"]
    # its plan had left the batch out (the others' later ones miss client 0's batches)
    assert untrained[0]["step"] == held_steps[0] + 2, untrained
    assert untrained[0]["expected_trainer"] == str(nodes[1].identity), untrained


def test_a_client_takes_out_its_last_result_in_the_next_epochs_first_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that goes on into the next epoch keeps its trainer and DisTrO momentum: its
    first training of the epoch subtracts what it sent in the previous epoch's last round, as
    every other round subtracts the previous one's. Before, going back to warmup dropped it and
    the epoch's first result re-sent it (its agreement about twice the rounds' around it, whose
    median then refused an honest result: `tests/modeling/test_screening.py`)."""
    caplog.set_level(logging.INFO, logger="psyche.client")
    subtracted: dict[int, list[int]] = {}

    def recording(i: int) -> Trainer:
        trainer = make_trainer()
        train_exact = trainer.train_exact

        def train(step: int, batch, **kw):  # type: ignore[no-untyped-def]
            if i == 0:
                subtracted[step] = [id(r) for r in kw["prev_self_distro_results"] or []]
            return train_exact(step, batch, **kw)

        trainer.train_exact = train  # type: ignore[method-assign]
        return trainer

    _bus, nodes = trio.run(
        lambda: run_simulated(2, 30, witness_nodes=0, epoch_time=20, trainer=recording, epochs=2)
    )
    me = str(nodes[0].identity)
    starts = [
        r.psyche_fields
        for r in caplog.records
        if r.getMessage() == "round_start" and r.psyche_fields["client_id"] == me
    ]
    first_of_epoch = [f["step"] for f in starts if f["round"] == 0 and f["epoch"] > 0]
    assert first_of_epoch, starts
    sent = nodes[0].sent_results
    for step in first_of_epoch:
        assert step in subtracted, (step, sorted(subtracted))
        last = [r.original for r in sent if r.step < step][-1]
        assert subtracted[step] == [id(last)], (step, subtracted[step])
