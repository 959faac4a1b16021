"""Warmup (upstream `state/warmup.rs` and the warmup arm of the opportunistic check).

A client that has the model says so with `Finished{warmup: true}`, once; when every client of
the epoch has, it sends the warmup witness, with which the coordinator may start the first round
before the warmup time is up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psyche.client.round.state import RoundState
from psyche.client.round.witness import (
    OpportunisticAction,
    SendFinished,
    SendWarmupWitness,
    merkle_root,
    unfinished_clients,
)
from psyche.coordinator import Client, Witness, WitnessProof
from psyche.coordinator.committee_selection import CommitteeProof
from psyche.core.bloom import WitnessBloom
from psyche.core.node_identity import NodeIdentity


@dataclass
class WarmupProgress:
    sent_finished: bool = False
    sent_witness: bool = False


def opportunistic_warmup_action(
    current: RoundState,
    progress: WarmupProgress,
    *,
    identity: NodeIdentity,
    clients: Sequence[Client],
) -> OpportunisticAction:
    """During warmup: say we have the model (`Finished{warmup}`), then, once every client has,
    send the warmup witness (which can start the first round early). Marks what it returns."""
    merkle = merkle_root(current.broadcasts)
    if not progress.sent_finished:
        progress.sent_finished = True
        return SendFinished(0, merkle, CommitteeProof(), warmup=True)
    if unfinished_clients(current, clients) or progress.sent_witness:
        return None
    progress.sent_witness = True
    index = next((i for i, c in enumerate(clients) if c.id == identity), None)
    if index is None:
        return None
    # The coordinator checks the index only for duplicates; position = index by convention.
    proof = WitnessProof(position=index, index=index, witness=False)
    return SendWarmupWitness(Witness(proof, WitnessBloom(), WitnessBloom(), merkle))
