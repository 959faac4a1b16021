"""What clients gossip: upstream's `Broadcast` (shared/client/src/protocol.rs), signed and small.

A broadcast announces either a training result (the commitment to its payload plus the ticket of
the blob that carries it) or that the sender finished the round. `Rebroadcaster` re-sends the
client's own broadcasts with a bumped nonce, because gossip does not guarantee delivery.
`Commitment`, `Committee` and `CommitteeProof` are psyche.coordinator's (re-exported here).
`open_network` is the network as the client speaks it: this gossip, and DisTrO results in blobs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import trio

from psyche.coordinator.commitment import Commitment
from psyche.coordinator.committee_selection import Committee, CommitteeProof
from psyche.core.batch_id import BatchId
from psyche.core.identity import verify_signature
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.serde import U32, DataEnum, struct, variant
from psyche.modeling.serialized_distro import TransmittableDistroResult
from psyche.network import BlobTicket

if TYPE_CHECKING:
    from psyche.network import NetworkConfig, NetworkConnection

__all__ = [
    "REBROADCAST_SHAREABLE_SECS",
    "RESEND_ON_CONNECT_SECS",
    "Broadcast",
    "BroadcastType",
    "Commitment",
    "Committee",
    "CommitteeProof",
    "Finished",
    "Rebroadcaster",
    "TrainingResult",
    "open_network",
    "rebroadcast_periodically",
    "verify_commitment",
]

REBROADCAST_SHAREABLE_SECS = 10.0
"""Upstream re-sends one stored broadcast every 10 s, round robin."""
RESEND_ON_CONNECT_SECS = 1.0
"""A port addition: this long after a run member newly connects (time for the gossip layer to
learn its subscription), every stored broadcast is re-sent once. A peer that connected after
a result was gossiped would otherwise see it only at the round robin's pace, possibly after
the round that applies it, and leave the run's model (upstream logs `DESYNC` then)."""


def verify_commitment(commitment: Commitment, signer: bytes) -> bool:
    """The client's check of a received broadcast: `signer` signed the commitment's hash."""
    return verify_signature(signer, commitment.data_hash, commitment.signature)


@struct(frozen=True)
class TrainingResult:
    batch_id: BatchId
    ticket: BlobTicket


@struct(frozen=True)
class Finished:
    broadcast_merkle: MerkleRoot
    warmup: bool


class BroadcastType(DataEnum):
    TrainingResult = variant(TrainingResult)
    Finished = variant(Finished)

    def kind(self) -> str:
        return "training_result" if isinstance(self, BroadcastType.TrainingResult) else "finished"


@struct(frozen=True)
class Broadcast:
    step: U32
    proof: CommitteeProof
    commitment: Commitment
    nonce: U32
    data: BroadcastType


@dataclass
class Rebroadcaster:
    """The client's own broadcasts, re-sent one per tick with a fresh nonce (upstream client loop).

    Each tick advances the round-robin index first, then bumps that broadcast's nonce (wrapping
    at 2^32) so its bytes, and so its gossip message id, differ from the last copy: gossip drops
    exact duplicates.
    """

    broadcasts: list[Broadcast] = field(default_factory=list)
    index: int = 0

    def add(self, broadcast: Broadcast) -> None:
        self.broadcasts.append(broadcast)

    def next_to_send(self) -> Broadcast | None:
        if not self.broadcasts:
            return None
        self.index = (self.index + 1) % len(self.broadcasts)
        current = self.broadcasts[self.index]
        bumped = replace(current, nonce=(current.nonce + 1) & 0xFFFFFFFF)
        self.broadcasts[self.index] = bumped
        return bumped

    def all_to_send(self) -> list[Broadcast]:
        """Every stored broadcast once, each with a fresh nonce (for a newly connected peer)."""
        for i, current in enumerate(self.broadcasts):
            self.broadcasts[i] = replace(current, nonce=(current.nonce + 1) & 0xFFFFFFFF)
        return list(self.broadcasts)

    def retain_from_step(self, min_step: int) -> None:
        """On entering RoundTrain upstream keeps the broadcasts of `step - 2` onwards."""
        self.broadcasts = [b for b in self.broadcasts if b.step >= min_step]


async def rebroadcast_periodically(
    rebroadcaster: Rebroadcaster,
    send: Callable[[Broadcast], None],
    interval: float = REBROADCAST_SHAREABLE_SECS,
) -> None:
    """Upstream's `sharing_downloadable_interval` arm: every `interval`, re-send one broadcast."""
    while True:
        await trio.sleep(interval)
        broadcast = rebroadcaster.next_to_send()
        if broadcast is not None:
            send(broadcast)


def open_network(config: NetworkConfig) -> AbstractAsyncContextManager[NetworkConnection]:
    """The client's network (upstream `NC = NetworkConnection<Broadcast, TransmittableDownload>`):
    gossip carries `Broadcast`s, a blob's DistroResult variant a `TransmittableDistroResult`, and
    model sharing torch tensors (`TENSOR_CODEC`)."""
    from psyche.modeling.sharing import TENSOR_CODEC
    from psyche.network import NetworkConnection  # libp2p loads only when needed

    return NetworkConnection.open(
        config,
        broadcast_type=Broadcast,
        distro_result_type=TransmittableDistroResult,
        model_codec=TENSOR_CODEC,
    )
