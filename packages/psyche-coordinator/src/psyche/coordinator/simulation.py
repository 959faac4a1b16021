"""Drive a coordinator as the centralized server and honest clients would, without a network.

For research simulations and tests. `Simulation` keeps what the server keeps beside the
coordinator (the clock, the pending clients) and applies the server's rules (upstream
`centralized/server/src/app.rs`): a Join puts a client in the pending set; a disconnect removes
it and withdraws it from the run; every tick first drops exited clients from the pending set.
The `*_witness_for` and `health_checks_for` functions build the messages an honest client sends.

Everything is deterministic: randomness (round seeds, bloom keys) comes from the seeded
`random.Random` given to the simulation.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from psyche.coordinator.committee_selection import CommitteeSelection, WitnessProof
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.coordinator import (
    ClientState,
    Coordinator,
    HealthChecks,
    RunState,
    TickResult,
    Witness,
    WitnessBloom,
)
from psyche.coordinator.errors import CoordinatorError
from psyche.coordinator.model import LLM, Model
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


def simulated_identity(number: int) -> NodeIdentity:
    """A stable identity for simulated client `number` (not a real key pair)."""
    return NodeIdentity.from_single_key(sha256(b"psyche-simulated-client" + number.to_bytes(8)))


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
    selection = CommitteeSelection.from_coordinator(coordinator, -1)
    checks: HealthChecks = []
    for index, client in enumerate(coordinator.epoch_state.clients):
        proof = selection.get_committee(index)
        try:
            healthy = coordinator.healthy(client.id, proof)
        except CoordinatorError:
            healthy = False
        if not healthy:
            checks.append((client.id, proof))
    return checks


@dataclass
class Simulation:
    """A coordinator with the centralized server's bookkeeping around it.

    Each call returns what the coordinator returned, or the `CoordinatorError` it raised (the
    server logs those and carries on). `transcript` hashes the coordinator's postcard bytes after
    every call, so two runs can be compared by one digest.
    """

    coordinator: Coordinator
    now: int
    rng: random.Random
    pending: dict[bytes, NodeIdentity] = field(default_factory=dict)
    transcript: Any = field(default_factory=hashlib.sha256)
    # Encoding after every call costs milliseconds at 256 clients; turn off when not needed.
    record: bool = True

    def _record(self) -> None:
        if self.record:
            self.transcript.update(self.coordinator.to_bytes())

    def join(self, identity: NodeIdentity) -> None:
        self.pending[identity.signer] = identity
        self._record()

    def disconnect(self, identity: NodeIdentity) -> CoordinatorError | None:
        """The server's withdraw-on-disconnect."""
        self.pending.pop(identity.signer, None)
        outcome = None
        for index, client in enumerate(self.coordinator.epoch_state.clients):
            if client.id.signer == identity.signer:
                try:
                    self.coordinator.withdraw(index)
                except CoordinatorError as e:
                    outcome = e
                break
        self._record()
        return outcome

    def tick(self, seconds: int = 1) -> TickResult | CoordinatorError:
        self.now += seconds
        for client in self.coordinator.epoch_state.exited_clients:
            if client.state is not ClientState.Healthy:
                self.pending.pop(client.id.signer, None)
        try:
            result: TickResult | CoordinatorError = self.coordinator.tick(
                list(self.pending.values()), self.now, self.rng.getrandbits(64)
            )
        except CoordinatorError as e:
            result = e
        self._record()
        return result

    def send_warmup_witnesses(self, indices: Iterable[int] | None = None) -> list[CoordinatorError]:
        """Warmup witnesses from the clients at `indices` (default: all), in order."""
        clients = self.coordinator.epoch_state.clients
        chosen = list(range(len(clients)) if indices is None else indices)
        errors = []
        for index in chosen:
            sender = clients[index].id
            try:
                self.coordinator.warmup_witness(
                    sender, warmup_witness_for(index), self.now, self.rng.getrandbits(64)
                )
            except CoordinatorError as e:
                errors.append(e)
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
            try:
                coordinator.witness(client.id, witness, self.now)
            except CoordinatorError as e:
                errors.append(e)
        self._record()
        return errors

    def send_health_checks(self, sender: NodeIdentity) -> int | CoordinatorError:
        try:
            checks = health_checks_for(self.coordinator)
            dropped = self.coordinator.health_check(sender, checks) if checks else 0
        except CoordinatorError as e:
            dropped = e
        self._record()
        return dropped

    def run_until(self, predicate: Callable[[Coordinator], bool], max_seconds: int) -> None:
        """Tick once a second until `predicate(coordinator)` holds (or raise after max_seconds)."""
        for _ in range(max_seconds):
            if predicate(self.coordinator):
                return
            self.tick()
        if not predicate(self.coordinator):
            raise TimeoutError(f"condition not reached within {max_seconds} simulated seconds")
