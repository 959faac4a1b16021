"""A run of step state machines on the in-memory bus (`machine_bus.py`) against a simulated
coordinator clock: `run_simulated` starts `clients` of them, lets chosen ones be late, blind,
corrupt or slow to gossip, and returns the bus and its nodes once `rounds` rounds went by."""

from __future__ import annotations

import random
from collections.abc import Callable

import trio

from psyche.client.round.broadcast import Broadcast
from psyche.client.round.fetch import DataFetcher
from psyche.client.round.steps import MachineSettings, StepStateMachine
from psyche.coordinator import Coordinator, RunState
from psyche.coordinator.testing import Simulation, integration_test_coordinator
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.modeling.trainer import Trainer

from ..modeling.tiny_trainer import make_trainer
from .machine_bus import Bus, BusIO, FakeData, Node, settle


async def run_simulated(
    clients: int,
    rounds: int,
    *,
    corrupt: int | None = None,
    late: int | None = None,
    lose_downloads: int | None = None,
    max_round_train_time: int = 20,
    witness_nodes: int = 1,
    trainer: Callable[[int], Trainer] = lambda _: make_trainer(),
    data: Callable[[], FakeData] = FakeData,
    screens: Callable[[int], bool] = lambda _: True,
    epoch_time: int = 1_000,
    blind: Callable[[int, Coordinator], bool] = lambda _i, _c: False,
    hold: Callable[[int, int, Broadcast], bool] = lambda _s, _r, _b: False,
    epochs: int = 1,
) -> tuple[Bus, list[Node]]:
    """`late`: that client sees each new coordinator state only after the others have trained
    and gossiped in it (their broadcasts reach it while it is still a round behind).
    `lose_downloads`: that client's downloads stop arriving after its second result.
    `max_round_train_time` also bounds (in real seconds) how long an apply waits for a
    payload; `witness_nodes`: the witnesses elected per round (0: every client). `trainer`,
    `data` and `screens` give client `i` its trainer, its data and whether its witness checks
    results (`MachineSettings.screen_results`). `blind(i, state)`: client `i` never sees that
    coordinator state (it was busy while the state went by). `hold(i, j, broadcast)`: that gossip
    message from client `i` reaches client `j` only once `j` has started the round two after
    the message's (a slow or broken gossip path). `epochs`: the run goes on into that many
    epochs (within `rounds`; between them, it waits for the next one to start)."""
    coordinator = integration_test_coordinator(clients, 2 * clients, witness_nodes)
    coordinator.config.max_round_train_time = max_round_train_time
    coordinator.config.epoch_time = epoch_time
    coordinator.config.min_clients = 1
    sim = Simulation(coordinator, now=1_000_000, rng=random.Random(5))
    bus = Bus(sim)
    nodes: list[Node] = []
    bus.hold = lambda s, r, b: hold(nodes.index(s), nodes.index(r), b)
    for i in range(clients):
        key = SecretKey.from_bytes(bytes(31) + bytes([i + 1]))
        node = Node(key, NodeIdentity.from_single_key(key.public_key))
        node.corrupt_payloads = i == corrupt
        node.lose_downloads = i == lose_downloads
        bus.nodes[node.identity] = node
        nodes.append(node)
        sim.join(node.identity)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bus.pump)
        sim.run_until(lambda c: c.run_state is RunState.Warmup, 10)
        for i, node in enumerate(nodes):
            node.machine = StepStateMachine(
                MachineSettings(identity=node.identity, screen_results=screens(i)),
                trainer(i),
                DataFetcher(data(), nursery),
                sim.coordinator.copy(),
                BusIO(bus, node),
                nursery,
            )
        last_step = sim.coordinator.progress.step + rounds
        with trio.fail_after(300):  # a hang guard only: the simulated clock waits for the work
            while (sim.coordinator.progress.step < last_step and sim.coordinator.active()) or (
                sim.coordinator.run_state in (RunState.WaitingForMembers, RunState.Warmup)
                and sim.coordinator.progress.epoch < epochs
            ):
                ordered = [n for i, n in enumerate(nodes) if i != late]
                for group in (ordered, [nodes[late]] if late is not None else []):
                    for node in group:
                        if blind(nodes.index(node), sim.coordinator):
                            continue
                        await node.machine.apply_state(sim.coordinator.copy())
                        node.machine.try_send_opportunistic_witness()
                    bus.deliver_held()
                    await settle(bus, nodes)
                sim.tick()
        for node in nodes:  # finish the last round
            await node.machine.apply_state(sim.coordinator.copy())
        nursery.cancel_scope.cancel()
    return bus, nodes
