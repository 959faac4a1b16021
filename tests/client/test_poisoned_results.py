"""A hostile client beside honest ones, through the client's round (real trainers on the tiny
Llama, the in-memory bus and the simulated coordinator of `test_machine`, every client a
witness): its well-formed but poisoned results (`psyche.modeling.hostile.make_hostile`: they hash
to their commitments and pass every check of their bytes) are refused by the honest witnesses
from the round it starts lying, so no honest client applies them; the health checks then drop
it as for a missing result; the honest clients refuse no honest result and end bit-identical."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import trio

from psyche.client.checkpoints.cooldown import live_model_hash
from psyche.client.client import Client
from psyche.client.round.train import OwnResult
from psyche.client.setup.model_loading import preload_modeling
from psyche.client.testing import InProcessServer
from psyche.coordinator.testing import Simulation
from psyche.core.batch_id import BatchId
from psyche.core.definitions import OptimizerDefinition
from psyche.data_provider.types import TokenizedData
from psyche.modeling.hostile import Attack, HostileMember, make_hostile, payload_format
from psyche.modeling.serialized_distro import transmittable_distro_result
from psyche.modeling.trainer import Trainer

from ..modeling.tiny_trainer import diloco_trainer, make_trainer
from ..polling import poll_until
from ..timing import scaled_timer
from . import in_process
from .machine_bus import SEQ, FakeData, Node
from .simulated_run import run_simulated

pytestmark = pytest.mark.usefixtures("single_thread")

CLIENTS = 4
HOSTILE = 3


class BigramData(FakeData):
    """Deterministic sequences per data index with a structure to learn (each token has two
    possible successors): the clients' results share a direction, as on real text."""

    successors = np.random.default_rng(0).integers(0, 256, (256, 2))

    async def get_samples(self, batch: BatchId) -> list[TokenizedData]:
        rows = []
        for i in batch:
            rng = np.random.default_rng(i)
            row = [int(rng.integers(0, 256))]
            for choice in rng.integers(0, 2, SEQ - 1):
                row.append(int(self.successors[row[-1], choice]))
            rows.append(np.array(row, dtype=np.int32))
        return TokenizedData.from_rows(np.stack(rows))


def run_with_hostile(
    make: Callable[[], Trainer], member: HostileMember, rounds: int
) -> tuple[list[Node], Simulation]:
    """`CLIENTS` clients, every one a witness, the last one hostile (`member`; its witness
    vouches for every result: it does not screen), for `rounds` rounds of one epoch."""

    def trainer(i: int) -> Trainer:
        made = make()
        if i == HOSTILE:
            make_hostile(made, member)
        return made

    bus, nodes = trio.run(
        lambda: run_simulated(
            CLIENTS,
            rounds,
            witness_nodes=0,
            trainer=trainer,
            data=BigramData,
            screens=lambda i: i != HOSTILE,
        )
    )
    return nodes, bus.sim


def bounded_diloco_trainer() -> Trainer:
    trainer = diloco_trainer()
    assert trainer.diloco is not None
    definition = trainer.diloco.settings.definition()
    bounded = dataclasses.replace(definition, peer_clip_multiple=2.0)
    return Trainer(
        trainer.model,
        trainer.lr_schedule,
        OptimizerDefinition.DiLoCo(bounded),
        micro_batch_size=trainer.micro_batch_size,
    )


@pytest.mark.parametrize(
    ("make", "attack", "start"),
    [(make_trainer, Attack.SignFlip, 2), (bounded_diloco_trainer, Attack.Scaled, 1)],
    ids=["distro-sign-flip", "diloco-scaled"],
)
def test_a_hostile_clients_results_are_refused_and_it_is_dropped(
    make: Callable[[], Trainer], attack: Attack, start: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")
    member = HostileMember(attack, start=start)
    nodes, sim = run_with_hostile(make, member, rounds=8)
    hostile, honest = nodes[HOSTILE], nodes[:HOSTILE]
    cheater = str(hostile.identity)
    # it lied from round `start` of its results on
    assert member.lies
    assert member.lies[0] == start
    lies = {hostile.sent_results[r].batch_id for r in member.lies}
    honest_ids = {str(n.identity) for n in honest}
    applied = [
        r
        for r in caplog.records
        if r.getMessage() == "applied_results" and r.psyche_fields["client_id"] in honest_ids
    ]
    assert applied
    for record in applied:
        assert not lies & set(record.psyche_fields["batches"]), record.psyche_fields
    # its honest rounds were applied (the checks refuse the lies, not the member)
    truths = {r.batch_id for i, r in enumerate(hostile.sent_results) if i not in member.lies}
    assert truths & {b for r in applied for b in r.psyche_fields["batches"]}
    refused = [r for r in caplog.records if r.getMessage() == "payload_refused"]
    assert refused
    assert {r.psyche_fields["sender"] for r in refused} == {cheater}
    # each line says why, and what the checks measured (an honest result refused shows itself)
    for record in refused:
        assert record.psyche_fields["reason"], record.psyche_fields
        assert record.psyche_fields["checked"] is True, record.psyche_fields
        assert isinstance(record.psyche_fields["agreement"], float), record.psyche_fields
    # health-checked out as for a missing result, two rounds after its first lie
    checks = [r for r in caplog.records if r.getMessage() == "health_check"]
    first_lie = hostile.sent_results[member.lies[0]].step
    named = [r.psyche_fields["step"] for r in checks if cheater in r.psyche_fields["unhealthy"]]
    assert named, (first_lie, named)
    assert min(named) == first_lie + 2, (first_lie, named)
    assert hostile.identity not in {c.id for c in sim.coordinator.epoch_state.clients}
    for record in checks:
        assert set(record.psyche_fields["unhealthy"]) <= {cheater}
    # the honest clients hold the same weights
    assert len({live_model_hash(n.machine.trainer) for n in honest}) == 1  # type: ignore[union-attr]


# ---- whole clients in one process (real libp2p on loopback, the server's rules) -------------


class SignFlippingClient(Client):
    """A client whose published results are its honest ones sign-flipped from its second on
    (committed to, so they hash right and pass every check of their bytes)."""

    member: ClassVar[HostileMember]
    lies: ClassVar[list[BatchId]]

    async def _publish_result(self, result: OwnResult) -> None:
        assert self.machine is not None
        fmt = payload_format(self.machine.trainer)
        lying = self.member.lying
        sent = self.member.tamper(result.sent, fmt)
        if lying:
            self.lies.append(result.batch_id)
        payload = transmittable_distro_result(
            sent, result.step, result.payload.trainer_nonce, result.batch_id
        )
        await super()._publish_result(
            dataclasses.replace(
                result, payload=payload, commitment_data_hash=payload.compute_hash(), sent=sent
            )
        )


def test_in_process_a_hostile_clients_results_are_not_applied_and_honest_clients_agree(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three honest clients and a sign-flipping one (every client a witness): the honest
    clients never apply its lies, the health checks drop it, and they end the epoch with the
    same weights."""
    caplog.set_level(logging.INFO, logger="psyche")
    preload_modeling()
    state = in_process.coordinator(*in_process.write_run(tmp_path))
    state.config.init_min_clients = 4
    state.config.witness_nodes = 0
    # room for the health check that drops it (from the third round) and rounds after it
    state.config.epoch_time = scaled_timer(12)
    server = InProcessServer(state, ban_epochs=1)
    SignFlippingClient.member = HostileMember(Attack.SignFlip, start=1)
    SignFlippingClient.lies = []

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            for number in (1, 2, 3):
                nursery.start_soon(in_process.run_client, server, number)
            nursery.start_soon(in_process.run_client, server, 4, SignFlippingClient)
            with trio.fail_after(240):
                await poll_until(lambda: server.coordinator.progress.epoch >= 1, 0.2)
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    records = caplog.records
    lies = {str(b) for b in SignFlippingClient.lies}
    assert lies
    honest = {str(c) for c in in_process.identities(1, 2, 3)}
    applied = [f for f in in_process.fields(records, "applied_results") if f["client_id"] in honest]
    assert applied
    for f in applied:
        assert not lies & {str(b) for b in f["batches"]}, f
    assert "Dropped 1 clients from health check" in caplog.text
    ended = [f for f in in_process.fields(records, "cooldown_model") if f["epoch"] == 0]
    assert {f["client_id"] for f in ended} >= honest
    assert len({f["model_hash"] for f in ended if f["client_id"] in honest}) == 1, ended
