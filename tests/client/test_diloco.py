"""DiLoCo through the client's round (real trainers on the tiny Llama, the in-memory bus and the
simulated coordinator of `test_machine`): three clients for two epochs hold bit-identical weights
after every outer step; a fourth client that joins at the second epoch with the model copied
from a peer (what P2P model sharing gives it) and fresh DiLoCo state stays identical too (the
outer momentum restarts at every epoch start); a committed pseudo-gradient that breaks the
layout is refused by every honest client and never applied."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import trio

from psyche.client.checkpoints.cooldown import live_model_hash
from psyche.client.round.fetch import DataFetcher
from psyche.client.round.steps import MachineSettings, StepStateMachine
from psyche.client.round.train import OwnResult
from psyche.coordinator import RunState
from psyche.coordinator.testing import Simulation, integration_test_coordinator
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.modeling.serialized_distro import (
    SerializableTensor,
    SerializableTensorData,
    SerializedDistroResult,
    TransmittableDistroResult,
)
from psyche.modeling.trainer import PreparedResult, Trainer

from ..modeling.tiny_trainer import DILOCO_INNER_STEPS as INNER_STEPS
from ..modeling.tiny_trainer import diloco_trainer
from .machine_bus import Bus, BusIO, FakeData, Node, settle

CLIENTS = 3


def record_outer_steps(trainer: Trainer, log: dict[int, bytes]) -> None:
    """After every outer step (`optimize`), the hash of the live weights by step."""
    optimize = trainer.optimize

    def wrapped(step: int, **kwargs: object) -> None:
        optimize(step, **kwargs)  # type: ignore[arg-type]
        log[step] = live_model_hash(trainer)

    trainer.optimize = wrapped  # type: ignore[method-assign]


def make_hostile(trainer: Trainer) -> None:
    """This trainer commits to payloads whose first block repeats an index (the hash covers the
    bad bytes, so only the layout check can catch them)."""
    prepare = trainer.prepare_result

    def hostile(out, *, step, batch_id) -> PreparedResult:  # type: ignore[no-untyped-def]
        good = prepare(out, step=step, batch_id=batch_id)
        first = good.payload.distro_results[0]
        raw = bytearray(first.sparse_idx.raw_tensor_data())
        raw[1] = raw[0]
        idx = SerializableTensor(
            first.sparse_idx.dims,
            first.sparse_idx.kind,
            False,
            SerializableTensorData.Full(bytes(raw)),
        )
        bad = SerializedDistroResult(idx, first.sparse_val, first.xshape, first.totalk)
        payload = TransmittableDistroResult(
            step, out.nonce, batch_id, [bad, *good.payload.distro_results[1:]]
        )
        return PreparedResult(payload, payload.compute_hash(), good.sent)

    trainer.prepare_result = hostile  # type: ignore[method-assign]


def new_node(i: int) -> Node:
    key = SecretKey.from_bytes(bytes(31) + bytes([i + 1]))
    return Node(key, NodeIdentity.from_single_key(key.public_key))


async def run_epochs(
    epochs: int, *, hostile: int | None = None, joiner: bool = False
) -> tuple[list[Node], list[dict[int, bytes]], Simulation]:
    coordinator = integration_test_coordinator(CLIENTS, CLIENTS * INNER_STEPS * 2, 1)
    coordinator.config.epoch_time = 16
    coordinator.config.min_clients = 1
    sim = Simulation(coordinator, now=1_000_000, rng=random.Random(5))
    bus = Bus(sim)
    nodes = [new_node(i) for i in range(CLIENTS)]
    logs: list[dict[int, bytes]] = [{} for _ in nodes]
    for node in nodes:
        bus.nodes[node.identity] = node
        sim.join(node.identity)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bus.pump)

        def start_machine(node: Node, trainer: Trainer) -> None:
            node.machine = StepStateMachine(
                MachineSettings(identity=node.identity),
                trainer,
                DataFetcher(FakeData(), nursery),
                sim.coordinator.copy(),
                BusIO(bus, node),
                nursery,
            )

        sim.run_until(lambda c: c.run_state is RunState.Warmup, 10)
        for i, (node, log) in enumerate(zip(nodes, logs)):
            trainer = diloco_trainer()
            record_outer_steps(trainer, log)
            if i == hostile:
                make_hostile(trainer)
            start_machine(node, trainer)
        late: Node | None = None
        with trio.fail_after(600):  # a hang guard only: the simulated clock waits for the work
            while sim.coordinator.progress.epoch < epochs:
                if joiner and late is None and sim.coordinator.run_state is RunState.Cooldown:
                    late = new_node(CLIENTS)
                    bus.nodes[late.identity] = late
                    sim.join(late.identity)
                if (
                    late is not None
                    and late.machine is None
                    and sim.coordinator.run_state is RunState.Warmup
                ):
                    # the model as P2P sharing gives it (the peers' live weights), fresh state
                    trainer = diloco_trainer()
                    source = nodes[0].machine.trainer  # type: ignore[union-attr]
                    with torch.no_grad():
                        for (_, p), (_, q) in zip(
                            trainer.model.variables(), source.model.variables()
                        ):
                            p.copy_(q)
                    log: dict[int, bytes] = {}
                    record_outer_steps(trainer, log)
                    start_machine(late, trainer)
                    nodes.append(late)
                    logs.append(log)
                active = [n for n in nodes if n.machine is not None]
                for node in active:
                    await node.machine.apply_state(sim.coordinator.copy())  # type: ignore[union-attr]
                    node.machine.try_send_opportunistic_witness()  # type: ignore[union-attr]
                await settle(bus, active)
                sim.tick()
        nursery.cancel_scope.cancel()
    return nodes, logs, sim


def test_three_clients_two_epochs_bit_identical_after_every_outer_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")
    nodes, logs, sim = trio.run(lambda: run_epochs(2, joiner=True))
    assert sim.coordinator.progress.epoch == 2
    first, *others = logs[:CLIENTS]
    assert len(first) >= 6, first  # outer steps over the two epochs
    for log in others:
        assert log == first
    # the joiner took every outer step of the second epoch with the same weights
    joined = logs[CLIENTS]
    assert joined, "the joiner took no outer step"
    assert all(first[step] == digest for step, digest in joined.items())
    # outer steps moved the weights, and the payloads of every round were trained
    assert len(set(first.values())) == len(first)
    results: list[OwnResult] = [r for n in nodes for r in n.sent_results]
    assert {r.payload.trainer_nonce for r in results} >= {0, 1, 2}
    applied = [r for r in caplog.records if r.getMessage() == "applied_results"]
    assert applied
    assert max(len(r.psyche_fields["batches"]) for r in applied) == CLIENTS + 1
    assert not [r for r in caplog.records if r.getMessage() == "payload_invalid"]


def test_a_hostile_pseudo_gradient_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")
    nodes, logs, _sim = trio.run(lambda: run_epochs(1, hostile=2))
    invalid = [r for r in caplog.records if r.getMessage() == "payload_invalid"]
    cheater = str(nodes[2].identity)
    assert invalid
    assert {r.psyche_fields["sender"] for r in invalid} == {cheater}
    assert all("repeats within a block" in r.psyche_fields["reason"] for r in invalid)
    cheater_batches = {r.batch_id for r in nodes[2].sent_results}
    honest = {str(n.identity) for n in nodes[:2]}
    for record in caplog.records:
        if record.getMessage() == "applied_results" and (
            record.psyche_fields["client_id"] in honest
        ):
            assert not cheater_batches & set(record.psyche_fields["batches"])
    assert logs[0]
    assert logs[0] == logs[1]
