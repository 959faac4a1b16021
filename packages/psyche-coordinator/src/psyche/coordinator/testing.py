"""Drive a coordinator as the centralized server and honest clients would, without a network
(for tests and research simulations, as `trio.testing` is for trio).

`Simulation` is a `ServerCore` (the server's rules: pending set, withdraw on disconnect, kicks,
members only, bans; `psyche.coordinator.server_core`) on a simulated clock. It adds no rule of
its own: it only supplies the time and the randomness, sends honest clients' messages and reports
what the coordinator refused. The `*_witness_for` and `health_checks_for` functions build the
messages an honest client sends; `integration_test_coordinator` and `simulated_identity` are the
coordinator and the identities of upstream's integration tests (`quick_coordinator`: the same with
timings of a few seconds).

Everything is deterministic: randomness (round seeds, bloom keys) comes from the seeded
`random.Random` given to the simulation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Iterable
from typing import Any

from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.committee_selection import CommitteeSelection, WitnessProof
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.consensus import unhealthy_trainers
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.errors import CoordinatorError, CoordinatorPanic
from psyche.coordinator.model import LLM, Model
from psyche.coordinator.run_state import (
    ClientState,
    HealthChecks,
    RunState,
    TickResult,
    Witness,
    WitnessMetadata,
)
from psyche.coordinator.server_core import DEFAULT_BAN_EPOCHS, ServerCore
from psyche.core.bloom import WitnessBloom
from psyche.core.identity import SecretKey
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.node_identity import NodeIdentity
from psyche.core.sha256 import sha256


def integration_test_coordinator(
    init_min_clients: int, global_batch_size: int, witness_nodes: int, run_id: str = "test-run"
) -> Coordinator:
    """The coordinator of upstream's centralized integration tests (testing/src): zeroed (so
    step 0), a dummy model, warmup 20 s, rounds of 5 s + 2 s, cooldown 3 s, epochs of 30 s, 100
    steps, 2 s of extra waiting; as the server leaves it at startup (WaitingForMembers)."""
    coordinator = Coordinator.zeroed()
    coordinator.run_id = run_id
    coordinator.run_state = RunState.WaitingForMembers
    coordinator.model = Model.LLM(LLM.dummy())
    coordinator.config = CoordinatorConfig(
        warmup_time=20,
        cooldown_time=3,
        max_round_train_time=5,
        round_witness_time=2,
        global_batch_size_warmup_tokens=0,
        epoch_time=30,
        total_steps=100,
        init_min_clients=init_min_clients,
        min_clients=init_min_clients,
        witness_nodes=witness_nodes,
        global_batch_size_start=global_batch_size,
        global_batch_size_end=global_batch_size,
        verification_percent=0,
        waiting_for_members_extra_time=2,
    )
    coordinator.epoch_state.first_round = True
    return coordinator


def quick_coordinator(
    init_min_clients: int = 2,
    global_batch_size: int = 4,
    witness_nodes: int = 1,
    *,
    run_id: str = "test-run",
    **config: int,
) -> Coordinator:
    """Upstream's test coordinator (step 0, dummy model) with timings of a few "seconds"."""
    coordinator = integration_test_coordinator(
        init_min_clients, global_batch_size, witness_nodes, run_id
    )
    timings: dict[str, Any] = {
        "warmup_time": 2,
        "cooldown_time": 2,
        "max_round_train_time": 2,
        "round_witness_time": 1,
        "epoch_time": 8,
        "waiting_for_members_extra_time": 1,
    }
    timings.update(config)
    coordinator.config = dataclasses.replace(coordinator.config, **timings)
    return coordinator


def simulated_identity(number: int) -> NodeIdentity:
    """A stable identity for simulated client `number` (not a real key pair)."""
    return NodeIdentity.from_single_key(sha256(b"psyche-simulated-client" + number.to_bytes(8)))


def simulated_key(number: int) -> SecretKey:
    """A real key pair for simulated client `number`, where a test needs its signatures (a
    verifier's draw); its identity is `keyed_identity(number)`."""
    return SecretKey.from_bytes(sha256(b"psyche-simulated-key" + number.to_bytes(8)))


def keyed_identity(number: int) -> NodeIdentity:
    """The identity of `simulated_key(number)` (signer and p2p key alike)."""
    return NodeIdentity.from_single_key(simulated_key(number).public_key)


def bloom_of(items: Iterable[bytes], keys: Iterable[int]) -> WitnessBloom:
    bloom = WitnessBloom(list(keys))
    for item in items:
        bloom.add(item)
    return bloom


def warmup_witness_for(index: int, broadcast_merkle: MerkleRoot | None = None) -> Witness:
    """What a client at `index` sends once it has the model: an unchecked proof naming its own
    index, empty blooms."""
    return Witness(
        WitnessProof(position=index, index=index, witness=False),
        broadcast_merkle=broadcast_merkle or MerkleRoot(),
    )


def round_witness_for(
    coordinator: Coordinator,
    index: int,
    *,
    participants: Iterable[NodeIdentity],
    bloom_keys: Iterable[int],
    broadcasts: Iterable[bytes] = (),
    broadcast_merkle: MerkleRoot | None = None,
) -> Witness | None:
    """The witness the client at `index` sends for the current round, or None when it is not
    a witness this round. `participants` are the trainers whose results it saw, `broadcasts`
    the commitment hashes it received."""
    proof = CommitteeSelection.from_coordinator(coordinator, 0).get_witness(index)
    if not proof.witness:
        return None
    keys = list(bloom_keys)
    return Witness(
        proof,
        bloom_of((sha256(p.signer) for p in participants), keys),
        bloom_of(broadcasts, keys),
        broadcast_merkle or MerkleRoot(),
    )


def health_checks_for(coordinator: Coordinator) -> HealthChecks:
    """The health checks an honest witness sends at the start of a round: every current client
    that was not a healthy trainer of the previous round (errors count as unhealthy)."""
    return unhealthy_trainers(coordinator, CommitteeSelection.from_coordinator(coordinator, -1))


class Simulation:
    """A `ServerCore` on a simulated clock (`now`, whole seconds), with honest clients' messages.

    The coordinator is driven as given (no start-up preparation: the caller builds the state the
    server runs). Each call returns what the coordinator returned, or the `CoordinatorError` it
    refused the event with (the server logs those and carries on); where upstream would panic,
    the `CoordinatorPanic` is raised. `transcript` hashes the coordinator's postcard bytes after
    every call, so two runs can be compared by one digest.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        now: int,
        rng: random.Random,
        *,
        record: bool = True,
        ban_epochs: int = DEFAULT_BAN_EPOCHS,
    ) -> None:
        self.core = ServerCore(coordinator, coordinator.config.warmup_time, ban_epochs=ban_epochs)
        self.now = now
        self.rng = rng
        self.transcript: Any = hashlib.sha256()
        # Encoding after every call costs milliseconds at 256 clients; turn off when not needed.
        self.record = record

    @property
    def coordinator(self) -> Coordinator:
        return self.core.coordinator

    @coordinator.setter
    def coordinator(self, coordinator: Coordinator) -> None:
        self.core.coordinator = coordinator

    @property
    def pending(self) -> dict[bytes, NodeIdentity]:
        """The server's pending clients, by signer, in the order they joined."""
        return {identity.signer: identity for identity in self.core.pending_clients}

    def _record(self) -> None:
        if self.record:
            self.transcript.update(self.coordinator.to_bytes())

    def _refusal(self) -> CoordinatorError | None:
        refusal = self.core.refusal
        if isinstance(refusal, CoordinatorPanic):
            raise refusal
        return refusal

    def join(self, identity: NodeIdentity) -> None:
        self.core.on_join(identity, self.coordinator.run_id)
        self._record()

    def disconnect(self, identity: NodeIdentity) -> CoordinatorError | None:
        """The client's connection drops (the server withdraws it)."""
        self.core.on_disconnect(identity)
        self._record()
        return self._refusal()

    def tick(self, seconds: int = 1) -> TickResult | CoordinatorError:
        self.now += seconds
        outcome = self.core.on_tick(self.now, self.rng.getrandbits(64))
        self._record()
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        assert outcome.result is not None  # the coordinator ticked
        return outcome.result

    def send_warmup_witnesses(self, indices: Iterable[int] | None = None) -> list[CoordinatorError]:
        """Warmup witnesses from the clients at `indices` (default: all), in order."""
        clients = self.coordinator.epoch_state.clients
        chosen = list(range(len(clients)) if indices is None else indices)
        errors = []
        for index in chosen:
            data = OpportunisticData.WarmupStep(warmup_witness_for(index))
            self.core.on_witness(clients[index].id, data, self.now, self.rng.getrandbits(64))
            if (refusal := self._refusal()) is not None:
                errors.append(refusal)
        self._record()
        return errors

    def send_round_witnesses(
        self, missing: Iterable[NodeIdentity] = (), silent: Iterable[NodeIdentity] = ()
    ) -> list[CoordinatorError]:
        """Every witness of the current round attests all healthy clients except `missing`;
        witnesses in `silent` send nothing. Outside a round's training or witness phase
        clients have no round to witness, and nothing is sent."""
        coordinator = self.coordinator
        if coordinator.run_state not in (RunState.RoundTrain, RunState.RoundWitness):
            return []
        clients = coordinator.epoch_state.clients
        skip = {i.signer for i in missing}
        quiet = {i.signer for i in silent}
        participants = [
            c.id for c in clients if c.state is ClientState.Healthy and c.id.signer not in skip
        ]
        keys = [self.rng.getrandbits(64) for _ in range(WitnessBloom.num_keys)]
        selection = CommitteeSelection.from_coordinator(coordinator, 0)
        # every witness saw the same trainers here: build their bloom once
        participant_bloom = bloom_of((sha256(p.signer) for p in participants), keys)
        empty_bloom = WitnessBloom(keys)
        errors = []
        for index, client in enumerate(list(clients)):
            if client.id.signer in quiet:
                continue
            proof = selection.get_witness(index)
            if not proof.witness:
                continue
            witness = Witness(proof, participant_bloom.copy(), empty_bloom.copy(), MerkleRoot())
            data = OpportunisticData.WitnessStep((witness, WitnessMetadata()))
            # a round witness takes no random seed (only a warmup witness can start a round)
            self.core.on_witness(client.id, data, self.now, 0)
            if (refusal := self._refusal()) is not None:
                errors.append(refusal)
        self._record()
        return errors

    def send_health_checks(self, sender: NodeIdentity) -> int | CoordinatorError:
        """`sender` reports every client that was not a healthy trainer of the previous round;
        returns how many the coordinator dropped."""
        clients = self.coordinator.epoch_state.clients
        healthy = [c for c in clients if c.state is ClientState.Healthy]
        try:
            checks = health_checks_for(self.coordinator)
        except CoordinatorError as e:
            self._record()
            return e
        if checks:
            self.core.on_health_check(sender, checks)
        self._record()
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        return sum(1 for c in healthy if c.state is ClientState.Dropped)

    def run_until(self, predicate: Callable[[Coordinator], bool], max_seconds: int) -> None:
        """Tick once a second until `predicate(coordinator)` holds (or raise after max_seconds)."""
        for _ in range(max_seconds):
            if predicate(self.coordinator):
                return
            self.tick()
        if not predicate(self.coordinator):
            raise TimeoutError(f"condition not reached within {max_seconds} simulated seconds")
