"""State-machine scenarios: what upstream's centralized integration tests check
(testing/tests/integration_tests.rs, spec §4.6), replayed at the coordinator level with the same
configuration, plus the other behaviours the issue lists (witness timeout, finishing, pause and
resume, rejoining, health-check ejection)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from psyche.coordinator import (
    Checkpoint,
    ClientState,
    Coordinator,
    CoordinatorError,
    RunState,
    TickResult,
)
from psyche.coordinator.testing import (
    Simulation,
    integration_test_coordinator,
    simulated_identity,
)
from psyche.core import NodeIdentity


class Clients:
    """Honest clients around a `Simulation`: warmup witnesses `warmup_delay` seconds into warmup
    (loading the model), round witnesses `train_delay` seconds into each round (upstream's dummy
    training delay)."""

    def __init__(self, init_min_clients: int, global_batch_size: int, witness_nodes: int) -> None:
        coordinator = integration_test_coordinator(
            init_min_clients, global_batch_size, witness_nodes
        )
        self.sim = Simulation(coordinator, now=1_000_000, rng=random.Random(7))
        self.warmup_delay = 1
        self.train_delay = 2
        self.next_number = 0
        self.silent: set[bytes] = set()  # clients that neither train nor witness
        self.warmed_up = False
        self.sent: set[tuple[int, int]] = set()
        self.results: list[TickResult | CoordinatorError] = []

    @property
    def coordinator(self) -> Coordinator:
        return self.sim.coordinator

    def spawn(self, count: int = 1) -> list[NodeIdentity]:
        spawned = []
        for _ in range(count):
            identity = simulated_identity(self.next_number)
            self.next_number += 1
            self.sim.join(identity)
            spawned.append(identity)
        return spawned

    def kill(self, identity: NodeIdentity) -> None:
        self.silent.add(identity.signer)
        self.sim.disconnect(identity)

    def second(self) -> None:
        coordinator = self.coordinator
        state = coordinator.run_state
        started = coordinator.run_state_start_unix_timestamp
        if (
            state is RunState.Warmup
            and not self.warmed_up
            and self.sim.now - started >= self.warmup_delay
        ):
            active = [
                i
                for i, c in enumerate(coordinator.epoch_state.clients)
                if c.id.signer not in self.silent
            ]
            assert self.sim.send_warmup_witnesses(active) == []
            self.warmed_up = True
        if state is not RunState.Warmup:
            self.warmed_up = False
        round_ = coordinator.current_round()
        assert round_ is not None
        key = (coordinator.progress.epoch, round_.height)
        if (
            state is RunState.RoundTrain
            and self.sim.now - started >= self.train_delay
            and key not in self.sent
        ):
            silent = [c.id for c in coordinator.epoch_state.clients if c.id.signer in self.silent]
            assert self.sim.send_round_witnesses(missing=silent, silent=silent) == []
            self.sent.add(key)
        self.results.append(self.sim.tick())

    def until(self, predicate: Callable[[Coordinator], bool], limit: int = 120) -> None:
        for _ in range(limit):
            if predicate(self.coordinator):
                return
            self.second()
        raise AssertionError(f"not reached in {limit} s: {self.coordinator.run_state}")

    def until_state(self, state: RunState, limit: int = 120) -> None:
        self.until(lambda c: c.run_state is state, limit)

    def wait(self, seconds: int) -> None:
        for _ in range(seconds):
            self.second()

    def pending_len(self) -> int:
        return len(self.sim.pending)

    def clients_len(self) -> int:
        return len(self.coordinator.epoch_state.clients)


def healthy_score(coordinator: Coordinator, round_index: int) -> int:
    witnesses = coordinator.epoch_state.rounds[round_index].witnesses
    return sum(
        Coordinator.trainer_healthy_score_by_witnesses(c.id, witnesses)
        for c in coordinator.epoch_state.clients
    )


# ---- upstream's integration tests, coordinator level ---------------------------------------------


def test_connect_single_node() -> None:
    run = Clients(2, 4, 1)
    run.spawn()
    run.wait(5)
    assert run.pending_len() == 1
    assert run.coordinator.run_state is RunState.WaitingForMembers


def test_connect_multiple_nodes() -> None:
    run = Clients(15, 4, 1)
    run.spawn(10)
    run.wait(5)
    assert run.pending_len() == 10
    assert run.coordinator.run_state is RunState.WaitingForMembers


def test_state_change_waiting_for_members_to_warmup() -> None:
    run = Clients(2, 4, 1)
    assert run.clients_len() == 0
    run.spawn(2)
    run.sim.tick()
    assert run.coordinator.run_state is RunState.Warmup
    assert run.clients_len() == 2


def test_state_change_shutdown_node_in_warmup() -> None:
    run = Clients(2, 4, 1)
    _, second = run.spawn(2)
    run.sim.tick()
    assert run.coordinator.run_state is RunState.Warmup
    run.kill(second)
    assert run.sim.tick() == TickResult.EpochEnd(False)
    assert run.coordinator.run_state is RunState.WaitingForMembers
    assert run.clients_len() == 1  # the epoch state is reset only by the next warmup
    assert run.pending_len() == 1


def test_state_change_waiting_for_members_to_round_train() -> None:
    run = Clients(2, 4, 1)
    run.spawn(2)
    run.until_state(RunState.RoundTrain, 30)
    assert run.clients_len() == 2


def test_state_change_waiting_for_members_to_round_witness() -> None:
    run = Clients(2, 4, 1)
    run.train_delay = 10  # slower than the round: the witness phase starts on time
    run.spawn(2)
    run.until_state(RunState.RoundTrain, 30)
    started = run.coordinator.run_state_start_unix_timestamp
    run.until_state(RunState.RoundWitness, 10)
    assert run.coordinator.run_state_start_unix_timestamp == started + 5
    assert run.clients_len() == 2


def test_validate_all_clients_participate_in_witness_bloom() -> None:
    run = Clients(5, 5, 1)
    assert run.coordinator.epoch_state.rounds_head == 0
    assert run.coordinator.epoch_state.rounds[0].witnesses == []
    run.spawn(5)
    run.until_state(RunState.Warmup, 5)
    run.until_state(RunState.RoundTrain, 30)
    run.until_state(RunState.RoundWitness, 10)
    run.until(lambda c: c.epoch_state.rounds_head == 1, 10)
    run.until(lambda c: c.epoch_state.rounds_head == 2, 10)
    assert healthy_score(run.coordinator, 1) == 5  # one witness saw all five trainers


def test_replace_node_and_complete_round() -> None:
    run = Clients(2, 2, 1)
    first, _ = run.spawn(2)
    run.sim.tick()
    assert run.coordinator.run_state is RunState.Warmup
    run.spawn()  # waits in the pending set
    assert (run.pending_len(), run.clients_len()) == (3, 2)
    run.kill(first)
    run.until_state(RunState.WaitingForMembers, 2)
    run.until_state(RunState.Warmup, 5)
    assert run.clients_len() == 2
    run.until_state(RunState.RoundTrain, 30)
    run.until_state(RunState.RoundWitness, 10)


def test_finish_epoch() -> None:
    run = Clients(2, 2, 1)
    assert run.coordinator.epoch_state.rounds_head == 0
    run.spawn(2)
    run.until_state(RunState.RoundTrain, 30)
    run.until_state(RunState.RoundWitness, 10)
    for head in (1, 2, 3):
        run.until(lambda c, h=head: c.epoch_state.rounds_head == h, 10)
    run.until_state(RunState.Cooldown, 60)
    run.wait(3)
    assert run.coordinator.progress.epoch == 1
    assert TickResult.EpochEnd(True) in run.results


def test_client_join_in_training() -> None:
    run = Clients(2, 2, 1)
    run.spawn(2)
    run.until_state(RunState.RoundTrain, 30)
    run.spawn()
    run.second()
    assert (run.pending_len(), run.clients_len()) == (3, 2)
    run.until_state(RunState.RoundWitness, 10)
    for head in (1, 2, 3):
        run.until(lambda c, h=head: c.epoch_state.rounds_head == h, 10)
    assert healthy_score(run.coordinator, 1) == 2
    run.until_state(RunState.Warmup, 60)
    assert run.clients_len() == 3


def test_shutdown_node_in_training_and_complete_round() -> None:
    run = Clients(3, 3, 2)
    first, *_ = run.spawn(3)
    run.until_state(RunState.RoundTrain, 30)
    assert run.clients_len() == 3
    run.kill(first)
    run.until_state(RunState.RoundWitness, 10)
    # the withdrawn client leaves at the round's end: fewer than min_clients
    run.until_state(RunState.Cooldown, 10)
    run.until_state(RunState.WaitingForMembers, 10)
    run.spawn()
    run.until_state(RunState.Warmup, 10)
    assert run.clients_len() == 3


def test_client_join_in_training_and_get_model_using_p2p() -> None:
    run = Clients(2, 3, 1)
    run.train_delay = 1
    run.spawn(2)
    run.until_state(RunState.RoundTrain, 30)
    run.spawn()
    for head in (1, 2, 3):
        run.until(lambda c, h=head: c.epoch_state.rounds_head == h, 10)
    run.until(lambda c: c.progress.epoch == 1, 60)
    assert isinstance(run.coordinator.model.value.checkpoint, Checkpoint.P2P)
    run.until_state(RunState.Warmup, 10)
    for head in (1, 2, 3):
        run.until(lambda c, h=head: c.epoch_state.rounds_head == h, 40)
    run.until(lambda c: c.progress.epoch == 2, 60)
    assert run.clients_len() == 3


def test_two_clients_join_in_training_and_get_model_using_p2p() -> None:
    run = Clients(2, 4, 1)
    run.spawn(2)
    run.until_state(RunState.RoundTrain, 30)
    run.until(lambda c: c.epoch_state.rounds_head == 1, 10)
    run.spawn(2)
    run.until(lambda c: c.progress.epoch == 1, 60)
    assert isinstance(run.coordinator.model.value.checkpoint, Checkpoint.P2P)
    run.until_state(RunState.Warmup, 10)
    run.until(lambda c: c.epoch_state.rounds_head == 1, 40)
    run.until(lambda c: c.progress.epoch == 2, 60)
    assert run.clients_len() == 4


# ---- further behaviours ---------------------------------------------------------------------------


def test_a_round_without_witnesses_withdraws_everyone_and_the_run_restarts() -> None:
    """Upstream withdraws every client when a round gets no witness, then keeps kicking them
    from the pending set until new clients start an epoch. The server's rules forgive a mass
    withdrawal (`ServerCore.rejoinable`, docs/centralized.md): the same clients rejoin and the
    run starts again. The elected witness that sent nothing is banned for `ban_epochs`, but a
    ban never keeps a run below `init_min_clients`, so here it is admitted anyway."""
    run = Clients(2, 4, 1)
    members = run.spawn(2)
    run.until_state(RunState.RoundTrain, 30)
    for member in members:
        run.silent.add(member.signer)  # nobody witnesses
    run.until_state(RunState.RoundWitness, 6)
    run.until_state(RunState.Cooldown, 3)
    assert all(c.state is ClientState.Withdrawn for c in run.coordinator.epoch_state.clients)
    run.until_state(RunState.WaitingForMembers, 4)
    assert len(run.sim.core.banned) == 1  # the round's only (silent) witness
    run.silent.clear()
    for member in members:
        run.sim.join(member)
    run.wait(1)
    assert run.pending_len() == 2
    run.until_state(RunState.RoundTrain, 40)
    assert run.coordinator.progress.epoch == 1
    assert [c.id for c in run.coordinator.epoch_state.clients] == members


def test_dropping_below_min_clients_mid_epoch() -> None:
    run = Clients(3, 6, 1)
    members = run.spawn(4)
    run.until_state(RunState.RoundTrain, 30)
    run.until(lambda c: c.epoch_state.rounds_head == 2, 20)
    run.kill(members[0])
    run.until_state(RunState.RoundWitness, 10)
    run.until(lambda c: c.epoch_state.rounds_head == 3, 10)
    assert run.clients_len() == 3  # still enough
    run.kill(members[1])
    run.until_state(RunState.Cooldown, 20)
    assert [c.id for c in run.coordinator.epoch_state.exited_clients] == members[:2]
    run.until_state(RunState.WaitingForMembers, 5)
    assert run.pending_len() == 2


def test_finishing_at_total_steps() -> None:
    run = Clients(2, 4, 1)
    run.coordinator.config.total_steps = 12
    run.spawn(2)
    run.until_state(RunState.Finished, 400)
    assert run.coordinator.progress.step == 12
    assert run.coordinator.progress.epoch >= 2
    assert isinstance(run.sim.tick(), CoordinatorError)  # Halted from now on


def test_pause_and_resume() -> None:
    run = Clients(2, 4, 1)
    run.spawn(2)
    run.until_state(RunState.RoundTrain, 30)
    run.coordinator.pause(run.sim.now)
    assert run.coordinator.pending_pause
    run.until_state(RunState.Paused, 60)
    assert run.coordinator.epoch_state.cold_start_epoch
    epoch = run.coordinator.progress.epoch
    run.wait(5)
    assert run.coordinator.run_state is RunState.Paused
    run.coordinator.resume(run.sim.now)
    run.spawn(2)  # the paused clients were withdrawn and kicked; these are new
    run.until_state(RunState.RoundTrain, 30)
    assert run.coordinator.epoch_state.cold_start_epoch
    assert run.coordinator.progress.epoch == epoch


def test_a_client_that_reconnects_within_its_epoch_trains_in_the_next() -> None:
    """Upstream kicks a client that rejoins while the epoch it left still lists it as exited,
    so it sits out the next epoch too. The server's rules keep it pending (`rejoinable`: a
    restarted process with the same key), so it trains in the next epoch."""
    run = Clients(2, 4, 1)
    first, *_ = run.spawn(3)
    run.until_state(RunState.RoundTrain, 30)
    run.kill(first)
    run.until(lambda c: any(x.id == first for x in c.epoch_state.exited_clients), 20)
    run.silent.discard(first.signer)
    run.sim.join(first)
    run.wait(1)
    assert first.signer in run.sim.pending
    run.until_state(RunState.Warmup, 80)  # the next epoch, with it
    assert run.coordinator.progress.epoch == 1
    assert first in [c.id for c in run.coordinator.epoch_state.clients]


def test_health_check_ejects_a_silent_trainer() -> None:
    run = Clients(4, 8, 3)  # quorum 2: the round goes on even if the silent one is a witness
    members = run.spawn(5)
    run.until_state(RunState.RoundTrain, 30)
    lazy = members[3]
    run.silent.add(lazy.signer)  # stays connected, neither trains nor witnesses
    run.until(lambda c: (r := c.current_round()) is not None and r.height >= 3, 60)
    reporter = next(c.id for c in run.coordinator.epoch_state.clients if c.id != lazy)
    dropped = run.sim.send_health_checks(reporter)
    assert dropped == 1
    index = [c.id for c in run.coordinator.epoch_state.clients].index(lazy)
    assert run.coordinator.epoch_state.clients[index].state is ClientState.Dropped
    run.until(lambda c: lazy in [x.id for x in c.epoch_state.exited_clients], 20)
    assert lazy.signer in run.sim.pending
    run.second()  # the server kicks exited clients at the start of each tick, but not a banned
    # one: its Join is kept while it sits out its ban (`--ban-epochs 0`: kicked, as upstream)
    assert lazy.signer in run.sim.pending
    assert lazy in run.sim.core.banned


def test_simulation_run_until() -> None:
    sim = Simulation(integration_test_coordinator(2, 4, 1), now=50, rng=random.Random(1))
    sim.join(simulated_identity(0))
    sim.join(simulated_identity(1))
    sim.run_until(lambda c: c.run_state is RunState.Warmup, 5)
    sim.run_until(lambda c: c.run_state is RunState.RoundTrain, 25)  # warmup times out
    assert sim.now == 71
    with pytest.raises(TimeoutError):
        sim.run_until(lambda c: c.run_state is RunState.Finished, 3)
