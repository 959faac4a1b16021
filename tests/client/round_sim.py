"""A simulated run (the server's rules on a simulated clock, `psyche.coordinator.testing`) at
its first training round, and the round plan each client computes from it, with a fixed bloom
so that plans compare equal: what the client tests of the round's plain decisions share."""

from __future__ import annotations

import random

from psyche.client.round import train
from psyche.coordinator import Coordinator, RunState
from psyche.coordinator.testing import Simulation, integration_test_coordinator, simulated_identity
from psyche.core.bloom import WitnessBloom
from psyche.core.node_identity import NodeIdentity
from psyche.core.sha256 import sha256
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr

KEYS = [11, 12, 13, 14, 15, 16, 17, 18]


def fixed_bloom(_items: int, _rate: float) -> WitnessBloom:
    return WitnessBloom(KEYS)


def training_sim(clients: int = 3, batch: int = 6, witness_nodes: int = 1) -> Simulation:
    coordinator = integration_test_coordinator(clients, batch, witness_nodes)
    sim = Simulation(coordinator, now=1_000_000, rng=random.Random(3))
    for i in range(clients):
        sim.join(simulated_identity(i))
    sim.run_until(lambda c: c.run_state is RunState.Warmup, 10)
    sim.send_warmup_witnesses()
    sim.run_until(lambda c: c.run_state is RunState.RoundTrain, 30)
    return sim


def next_round(sim: Simulation) -> None:
    step = sim.coordinator.progress.step
    assert sim.send_round_witnesses() == []
    sim.run_until(lambda c: c.run_state is RunState.RoundTrain and c.progress.step == step + 1, 30)


def index_of(coordinator: Coordinator, identity: NodeIdentity) -> int:
    return next(i for i, c in enumerate(coordinator.epoch_state.clients) if c.id == identity)


def plan_for(coordinator: Coordinator, identity: NodeIdentity) -> train.RoundPlan:
    return train.start_round(
        coordinator, identity, index_of(coordinator, identity), new_bloom=fixed_bloom
    )


def ticket(tag: int, provider: bytes = bytes(32)) -> BlobTicket:
    """A ticket to blob number `tag` (its hash `sha256(tag)`) at `provider`, for the results
    the plans' broadcasts announce."""
    return BlobTicket(EndpointAddr(provider, []), BlobFormat.Raw, sha256(bytes([tag])), 100)
