"""What clients gossip: upstream's `Broadcast` (shared/client/src/protocol.rs), signed and small.

A broadcast announces either a training result (the commitment to its payload plus the ticket of
the blob that carries it) or that the sender finished the round. `Rebroadcaster` re-sends the
client's own broadcasts with a bumped nonce, because gossip does not guarantee delivery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

import trio

from psyche.core.batch_id import BatchId
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.serde import U32, U64, DataEnum, RustEnum, SerdeProxy, struct, variant
from psyche.network.identity import verify
from psyche.network.ticket import BlobTicket

REBROADCAST_SHAREABLE_SECS = 10.0
"""Upstream re-sends one stored broadcast every 10 s, round robin."""

COMMITMENT_LENGTH = 96


class Committee(RustEnum):
    """Upstream `psyche_coordinator::Committee` (same wire form as psyche.coordinator's)."""

    TieBreaker = 0
    Verifier = 1
    Trainer = 2


@struct(frozen=True)
class CommitteeProof:
    """Upstream `psyche_coordinator::CommitteeProof` (same wire form as psyche.coordinator's)."""

    committee: Committee = Committee.TieBreaker
    position: U64 = 0
    index: U64 = 0


class Commitment(SerdeProxy):
    """`{data_hash: [u8; 32], signature: [u8; 64]}`, serialized as one 96-byte byte string.

    Upstream's `psyche_coordinator::Commitment`; kept here until psyche.coordinator has it.
    """

    serde_proxy_type: ClassVar[type] = bytes
    __slots__ = ("data_hash", "signature")

    def __init__(self, data_hash: bytes, signature: bytes) -> None:
        if len(data_hash) != 32 or len(signature) != 64:
            raise ValueError("Invalid length for Commitment")
        self.data_hash = bytes(data_hash)
        self.signature = bytes(signature)

    def to_serde_proxy(self) -> bytes:
        return self.data_hash + self.signature

    @classmethod
    def from_serde_proxy(cls, proxy: bytes) -> Commitment:
        if len(proxy) != COMMITMENT_LENGTH:
            raise ValueError("Invalid length for Commitment")
        return cls(proxy[:32], proxy[32:])

    def verify(self, signer: bytes) -> bool:
        """The client's check: the gossip sender signed the payload hash."""
        return verify(signer, self.data_hash, self.signature)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Commitment):
            return NotImplemented
        return (self.data_hash, self.signature) == (other.data_hash, other.signature)

    def __hash__(self) -> int:
        return hash((self.data_hash, self.signature))

    def __repr__(self) -> str:
        return f"Commitment({self.data_hash[:5].hex()})"


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
