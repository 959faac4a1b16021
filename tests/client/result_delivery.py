"""A member's announced training result taken through a client's real checks
(`payloads.apply_message`, then `payloads.check_payload`: hash, decode, screen, blooms) on the
simulated coordinator (`deliver`): what the witness tests (test_young_witness.py,
test_witness_judge.py) share."""

from __future__ import annotations

from collections.abc import Callable

import trio

from psyche.client.round import payloads
from psyche.client.round.broadcast import Broadcast, BroadcastType, TrainingResult
from psyche.client.round.state import RoundState
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.testing import Simulation
from psyche.core.batch_id import BatchId
from psyche.core.node_identity import NodeIdentity
from psyche.modeling.distro import DistroResult
from psyche.modeling.serialized_distro import TransmittableDistroResult

from .round_sim import index_of, ticket


def deliver(
    view: RoundState,
    sim: Simulation,
    me: NodeIdentity,
    batch: BatchId,
    sender: NodeIdentity,
    tag: int,
    screen: payloads.ScreenResult,
    accuse: bool,
    results: Callable[[TransmittableDistroResult], list[DistroResult]] = lambda _p: [],
) -> None:
    """`sender`'s announced result for `batch` reaches `me` and goes through the checks
    (`results`: what its payload decodes to)."""
    payload = TransmittableDistroResult(view.step, 30, batch, [])
    proof = view.committee_info.selection.get_committee(index_of(sim.coordinator, sender))
    broadcast = Broadcast(
        step=view.step,
        proof=proof,
        commitment=Commitment(payload.compute_hash(), bytes(64)),
        nonce=0,
        data=BroadcastType.TrainingResult(TrainingResult(batch, ticket(tag))),
    )
    clients = sim.coordinator.epoch_state.clients
    outcome, download = payloads.apply_message(
        view, RoundState(), identity=me, clients=clients, from_id=sender, broadcast=broadcast
    )
    assert outcome is payloads.ApplyMessageOutcome.Applied
    assert download is not None
    blob = download.ticket.hash
    pending = payloads.commitment_for_payload(view, blob)
    assert pending is not None
    trio.run(payloads.check_payload, view, blob, payload, pending, results, screen, accuse)
