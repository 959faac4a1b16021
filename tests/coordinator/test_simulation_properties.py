"""Property-based simulation: random joins, leaves, witnesses, health checks, pauses and clock
jumps (up to 256 clients), checked after every step against the coordinator's invariants, on two
independent coordinators that must stay byte-identical."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from psyche.coordinator import (
    Checkpoint,
    CommitteeSelection,
    Coordinator,
    CoordinatorConfig,
    CoordinatorError,
    CoordinatorErrorKind,
    CoordinatorPanic,
    GcsRepo,
    HubRepo,
    RunState,
    Witness,
    WitnessProof,
    assign_data_for_state,
)
from psyche.coordinator.testing import (
    Simulation,
    health_checks_for,
    integration_test_coordinator,
    simulated_identity,
    warmup_witness_for,
)
from psyche.core import NodeIdentity
from psyche.core.serde import from_bytes

S = RunState
LEGAL = {
    (S.WaitingForMembers, S.Warmup),
    (S.WaitingForMembers, S.Paused),
    (S.Warmup, S.RoundTrain),
    (S.Warmup, S.WaitingForMembers),
    (S.Warmup, S.Finished),
    (S.Warmup, S.Paused),
    (S.RoundTrain, S.RoundWitness),
    (S.RoundWitness, S.RoundTrain),
    (S.RoundWitness, S.Cooldown),
    (S.Cooldown, S.WaitingForMembers),
    (S.Cooldown, S.Finished),
    (S.Cooldown, S.Paused),
    (S.Paused, S.WaitingForMembers),
    (S.Paused, S.Finished),
}
TICK_ERRORS = {CoordinatorErrorKind.Halted}
CHECKPOINTS = [
    Checkpoint.Hub(HubRepo("org/model")),
    Checkpoint.Gcs(GcsRepo("bucket")),
    Checkpoint.P2P(HubRepo("org/other")),
    Checkpoint.Dummy(HubRepo("")),
]

index = st.integers(0, 2**16)
ticks = st.tuples(st.just("tick"), st.sampled_from([0, 1, 1, 1, 1, 2, 2, 3, 5, 8, 30, 400]))
operations = st.one_of(
    ticks,
    ticks,
    ticks,
    st.tuples(st.just("join"), st.integers(1, 24)),
    st.tuples(st.just("rejoin"), index),
    st.tuples(st.just("leave"), index),
    st.tuples(st.just("warmup"), index, st.booleans()),
    st.tuples(st.just("witness"), index, st.sampled_from(["honest", "position", "index", "flag"])),
    st.tuples(st.just("witnesses"), st.integers(0, 3)),
    st.tuples(st.just("witnesses"), st.integers(0, 3)),
    st.tuples(st.just("health"), index),
    st.tuples(st.just("checkpoint"), index, st.sampled_from(range(len(CHECKPOINTS)))),
    st.sampled_from([("pause",), ("resume",)]),
)


@st.composite
def configs(draw: st.DrawFn, max_clients: int = 24) -> CoordinatorConfig:
    min_clients = draw(st.integers(1, min(8, max_clients)))
    start = draw(st.integers(1, 40))
    warmup = draw(st.integers(1, 6))
    train = draw(st.integers(1, 6))
    return CoordinatorConfig(
        warmup_time=warmup,
        cooldown_time=draw(st.integers(1, 4)),
        max_round_train_time=train,
        round_witness_time=draw(st.integers(1, 3)),
        global_batch_size_warmup_tokens=draw(st.sampled_from([0, 5000, 100000])),
        epoch_time=draw(st.integers(max(warmup, train) + 1, 60)),
        total_steps=draw(st.integers(2, 40)),
        init_min_clients=draw(st.integers(min_clients, min(min_clients + 4, max_clients))),
        min_clients=min_clients,
        witness_nodes=draw(st.integers(0, min(min_clients, 32))),
        global_batch_size_start=start,
        global_batch_size_end=start + draw(st.integers(0, 40)),
        verification_percent=0,
        waiting_for_members_extra_time=draw(st.integers(1, 3)),
    )


@dataclass
class Observer:
    """Checks the invariants after every call into the coordinator."""

    enabled: bool = True
    state: RunState = S.WaitingForMembers
    progress: tuple[int, int, int] = (0, 1, 0)
    rounds: list[tuple[int, int, int]] = field(default_factory=list)  # (epoch, height, start)
    next_data_index: int | None = None

    def __call__(self, coordinator: Coordinator) -> None:
        if self.enabled:
            self.check(coordinator)

    def check(self, coordinator: Coordinator) -> None:
        state = coordinator.run_state
        assert state is self.state or (self.state, state) in LEGAL, (self.state, state)
        self.state = state
        progress = coordinator.progress
        now = (progress.epoch, progress.step, progress.epoch_start_data_index)
        assert all(a <= b for a, b in zip(self.progress, now)), (self.progress, now)
        self.progress = now
        epoch_state = coordinator.epoch_state
        assert len(epoch_state.clients) <= 256
        assert len(epoch_state.exited_clients) <= 256
        assert all(len(r.witnesses) <= 32 for r in epoch_state.rounds)
        signers = [c.id.signer for c in epoch_state.clients]
        assert len(signers) == len(set(signers))

        round_ = coordinator.current_round()
        assert round_ is not None
        key = (progress.epoch, round_.height, round_.data_index)
        if state is S.RoundTrain and (not self.rounds or self.rounds[-1] != key):
            # A round that really runs: its data follows the previous round's, with no gap or
            # overlap, and is split among its trainers without overlap.
            if self.next_data_index is not None:
                assert round_.data_index == self.next_data_index, (round_, self)
            if epoch_state.first_round:
                assert round_.data_index == progress.epoch_start_data_index
            batch = coordinator.get_target_global_batch_size(round_)
            self.next_data_index = round_.data_index + batch
            self.rounds.append(key)
            assignments = assign_data_for_state(
                coordinator, CommitteeSelection.from_coordinator(coordinator, 0)
            )
            cursor = round_.data_index
            for batch_id, owner in assignments.items():
                assert batch_id.start == cursor
                assert batch_id.end >= batch_id.start
                assert owner.signer in signers
                cursor = batch_id.end + 1
            assert cursor == round_.data_index + batch  # every index of the round exactly once


@dataclass
class Driver:
    """Applies generated operations to one simulation, observing after every call."""

    sim: Simulation
    observe: Observer
    known: list[NodeIdentity] = field(default_factory=list)
    # Check that a rejected message left the state unchanged (costs a copy per message).
    check_unchanged: bool = True

    def message(self, send: Callable[[], object]) -> None:
        """One message; only CoordinatorError (or a documented panic, atomically) may escape."""
        before = self.sim.coordinator.copy() if self.check_unchanged else None
        refused = False
        try:
            send()
        except CoordinatorError:
            refused = True
        except CoordinatorPanic as e:
            # documented: a stored warmup witness index past the (shrunk) clients list
            refused = True
            panic = str(e)
            assert "stored witness" in panic, panic
        if refused:
            assert before is None or self.sim.coordinator == before
        self.observe(self.sim.coordinator)

    def apply(self, op: tuple) -> None:  # type: ignore[type-arg]
        sim = self.sim
        coordinator = sim.coordinator
        clients = coordinator.epoch_state.clients
        known = self.known
        kind = op[0]
        if kind == "join":
            for _ in range(op[1]):
                identity = simulated_identity(len(known))
                known.append(identity)
                sim.join(identity)
        elif kind == "rejoin" and known:
            sim.join(known[op[1] % len(known)])
        elif kind == "leave" and known:
            sim.disconnect(known[op[1] % len(known)])
            self.observe(coordinator)
        elif kind == "warmup" and clients:
            i = op[1] % len(clients)
            claimed = i if op[2] else (i + 1) % len(clients)
            seed = sim.rng.getrandbits(64)
            self.message(
                lambda: coordinator.warmup_witness(
                    clients[i].id, warmup_witness_for(claimed), sim.now, seed
                )
            )
        elif kind == "witness" and clients:
            i = op[1] % len(clients)
            try:  # the proof an honest client would quote, when there is a round to witness
                proof = CommitteeSelection.from_coordinator(coordinator, 0).get_witness(i)
            except (CoordinatorError, CoordinatorPanic):
                proof = WitnessProof(0, i, True)
            forged = {
                "honest": proof,
                "position": WitnessProof(proof.position + 1, i, proof.witness),
                "index": WitnessProof(proof.position, i + 1, proof.witness),
                "flag": WitnessProof(proof.position, i, not proof.witness),
            }[op[2]]
            self.message(lambda: coordinator.witness(clients[i].id, Witness(forged), sim.now))
        elif kind == "witnesses":
            missing = [c.id for c in clients[: op[1]]]
            self.message(lambda: sim.send_round_witnesses(missing=missing))
        elif kind == "second":
            # an optional disturbance, then every client acts honestly, then the server ticks
            self.apply(op[1:])
            if coordinator.run_state is S.Warmup:
                for i in range(len(coordinator.epoch_state.clients)):
                    self.apply(("warmup", i, True))
            self.message(sim.send_round_witnesses)
            self.apply(("tick", 1))
        elif kind == "tick":
            result = sim.tick(op[1])
            if isinstance(result, CoordinatorError):
                assert result.kind in TICK_ERRORS
            self.observe(coordinator)
        elif kind == "health" and clients:
            sender = clients[op[1] % len(clients)].id

            def health() -> None:
                checks = health_checks_for(coordinator)
                coordinator.health_check(sender, checks)

            self.message(health)
        elif kind == "pause":
            self.message(lambda: coordinator.pause(sim.now))
        elif kind == "resume":
            self.message(lambda: coordinator.resume(sim.now))
        elif kind == "checkpoint" and clients:
            i = op[1] % len(clients)
            self.message(lambda: coordinator.checkpoint(clients[i].id, i, CHECKPOINTS[op[2]]))


def new_simulation(config: CoordinatorConfig, seed: int) -> Simulation:
    coordinator = integration_test_coordinator(1, 1, 0)
    coordinator.config = config
    coordinator.model.value.max_seq_len = 64
    coordinator.progress.step = 1
    # the two coordinators' encodings are compared after every operation instead
    return Simulation(coordinator, now=10_000, rng=random.Random(seed), record=False)


def run(
    config: CoordinatorConfig, ops: list[tuple], seed: int, check_unchanged: bool = True
) -> None:  # type: ignore[type-arg]
    a = Driver(new_simulation(config, seed), Observer(), check_unchanged=check_unchanged)
    # The second coordinator is a decoded copy: it must behave identically.
    b = Driver(new_simulation(config, seed), Observer(enabled=False), check_unchanged=False)
    b.sim.coordinator = from_bytes(a.sim.coordinator.to_bytes(), Coordinator)
    for op in ops:
        a.apply(op)
        b.apply(op)
        assert a.sim.coordinator.to_bytes() == b.sim.coordinator.to_bytes(), op
    final = a.sim.coordinator
    epochs = final.progress.epoch
    event(f"final state {final.run_state.name}")
    event(f"epochs completed: {min(epochs, 3)}{'+' if epochs > 3 else ''}")
    rounds = len(a.observe.rounds)
    event(f"rounds run: {'0' if not rounds else '1-9' if rounds < 10 else '10+'}")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    configs(),
    st.integers(0, 4),
    st.lists(operations, min_size=10, max_size=120),
    st.integers(0, 2**32),
)
def test_random_runs_keep_the_invariants(
    config: CoordinatorConfig,
    extra_clients: int,
    ops: list[tuple],  # type: ignore[type-arg]
    seed: int,
) -> None:
    run(config, [("join", config.init_min_clients + extra_clients), *ops], seed)


# Seconds of honest clients with occasional disturbances: runs that get far (epochs,
# checkpoints, finishing).
disturbances = st.one_of(
    st.just(("none",)),
    st.just(("none",)),
    st.just(("none",)),
    st.just(("none",)),
    st.tuples(st.just("leave"), index),
    st.tuples(st.just("rejoin"), index),
    st.tuples(st.just("join"), st.integers(1, 4)),
    st.tuples(st.just("health"), index),
    st.tuples(st.just("tick"), st.sampled_from([5, 30])),
    st.just(("pause",)),
    st.just(("resume",)),
)
progressing = disturbances.map(lambda d: ("second", *d))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    configs(),
    st.integers(1, 24),
    st.lists(progressing, min_size=60, max_size=250),
    st.integers(0, 2**32),
)
def test_long_runs_keep_the_invariants(
    config: CoordinatorConfig,
    joins: int,
    ops: list[tuple],  # type: ignore[type-arg]
    seed: int,
) -> None:
    run(config, [("join", joins), *ops], seed)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    configs(max_clients=256),
    st.lists(progressing, min_size=20, max_size=120),
    st.integers(0, 2**32),
)
def test_runs_with_256_clients(
    config: CoordinatorConfig,
    ops: list[tuple],  # type: ignore[type-arg]
    seed: int,
) -> None:
    config.init_min_clients = max(config.init_min_clients, 200)
    config.witness_nodes = 32 if config.min_clients >= 32 else config.witness_nodes
    run(config, [("join", 100), ("join", 100), ("join", 70), *ops], seed, check_unchanged=False)
