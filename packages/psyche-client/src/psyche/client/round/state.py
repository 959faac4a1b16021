"""What a client remembers about one training round (upstream `state/round_state.rs`).

The client keeps two of these: the round it is training (`current`) and the one before
(`previous`), whose payloads it is still downloading and whose results it witnesses. Round N's
results are applied at the start of round N + 2, from the `previous` state of that moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from psyche.client.round.broadcast import Finished, TrainingResult
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.committee_selection import CommitteeProof, CommitteeSelection, WitnessProof
from psyche.core.batch_id import BatchId
from psyche.core.bloom import WitnessBloom
from psyche.core.node_identity import NodeIdentity
from psyche.network import BlobTicket

if TYPE_CHECKING:
    from psyche.modeling.distro import DistroResult
    from psyche.modeling.screening import RoundScreen, Verdict


@dataclass(frozen=True)
class DeserializedPayload:
    """A peer's checked DisTrO result, as tensors, and the trainer nonce it claims."""

    results: list[DistroResult]
    trainer_nonce: int


class PayloadHandle:
    """A payload whose hash matched its commitment, being turned into tensors off the loop.

    Upstream keeps the join handle of the deserializing task; here the task stores its outcome
    (the tensors, or the reason they were refused) and sets an event.
    """

    __slots__ = ("_event", "error", "value")

    def __init__(self) -> None:
        self._event = trio.Event()
        self.value: DeserializedPayload | None = None
        self.error: Exception | None = None

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def set_result(self, value: DeserializedPayload) -> None:
        self.value = value
        self._event.set()

    def set_error(self, error: Exception) -> None:
        self.error = error
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()

    def outcome(self) -> DeserializedPayload:
        """The tensors; raises the stored error. Only once `done`."""
        if not self.done:
            raise RuntimeError("payload is still being deserialized")
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value


@dataclass(frozen=True)
class Downloading:
    """A payload announced by `from_` for `batch_id`, not yet downloaded and checked."""

    from_: NodeIdentity
    batch_id: BatchId
    ticket: BlobTicket
    settled: trio.Event = field(default_factory=trio.Event, compare=False, repr=False)
    """Set once `RoundState.settle` put the payload's `PayloadHandle` in this entry's place."""


PayloadState = Downloading | PayloadHandle


@dataclass(frozen=True)
class CommitteeInfo:
    """This client's duties in the round and the selection that proves them."""

    committee_proof: CommitteeProof
    witness_proof: WitnessProof
    selection: CommitteeSelection


@dataclass(frozen=True)
class ResultEntry:
    """A training result someone announced for a batch, in the order this client received it."""

    from_: NodeIdentity
    commitment: Commitment
    result: TrainingResult


@dataclass
class RoundState:
    height: int = 0
    step: int = 0
    sent_witness: bool = False
    sent_finished: bool = False
    # Blob hash -> where that payload is.
    downloads: dict[bytes, PayloadState] = field(default_factory=dict)
    results: dict[BatchId, list[ResultEntry]] = field(default_factory=dict)
    clients_finished: dict[NodeIdentity, Finished] = field(default_factory=dict)
    # Ascending by batch (upstream's BTreeMap).
    data_assignments: dict[BatchId, NodeIdentity] = field(default_factory=dict)
    # (participant bloom, broadcast bloom); None in the default (pre-training) state.
    blooms: tuple[WitnessBloom, WitnessBloom] | None = None
    # Commitment hashes of every broadcast applied, in order (the witness's merkle leaves).
    broadcasts: list[bytes] = field(default_factory=list)
    committee_info: CommitteeInfo | None = None
    # Batches no checked payload has arrived for yet; None once all have (or no training).
    batch_ids_not_yet_trained_on: set[BatchId] | None = None
    # This client's own unquantized results (the residual the next `generate` subtracts).
    self_distro_results: list[list[DistroResult]] = field(default_factory=list)
    # This client's witness checks of the round's results (None: it does not screen) and
    # whether they can start: set once its own update of the round is the screen's reference,
    # or once it is known there will be none (`StepStateMachine`).
    screen: RoundScreen | None = None
    reference_ready: trio.Event = field(default_factory=trio.Event, compare=False, repr=False)
    reference_pending: bool = False
    """Its own update is being read into the screen (`reference_ready` is set once it is)."""
    blind_votes: dict[BatchId, tuple[int, bytes]] = field(default_factory=dict)
    """Votes held back by checks without an own update (batch -> the check's
    `Verdict.index`, the commitment), cast when the witness is sent
    (`payloads.settle_blind_votes`)."""
    held_checks: int = 0
    """Held checks (`Verdict.index`) whose verdicts reached this round so far."""
    judgement: list[Verdict] | None = None
    """The round's held checks judged as a whole (`RoundScreen.judge`), made off the loop
    before the witness is sent (`screening.judge_round`); it covers its first `len` checks."""
    judging: trio.Lock = field(default_factory=trio.Lock, compare=False, repr=False)
    """Held while a judgement is made (one at a time)."""

    results_announced: trio.Event = field(default_factory=trio.Event, compare=False, repr=False)
    """Set, and replaced by a fresh one, whenever a result joins `results`: a task waiting for a
    particular trainer's announcement (a verifier) re-checks `results` when it fires."""

    def announce_result(self, batch_id: BatchId, entry: ResultEntry) -> None:
        """Record an announced result and wake whoever waits for announcements."""
        self.results.setdefault(batch_id, []).append(entry)
        announced, self.results_announced = self.results_announced, trio.Event()
        announced.set()

    def distro_result_blob_downloaded(self, blob_hash: bytes) -> bool:
        """Upstream's name: whether this round knows the payload (announced or downloaded)."""
        return blob_hash in self.downloads

    def settle(self, blob_hash: bytes, handle: PayloadHandle) -> None:
        """Put a downloaded payload's handle in place of its `Downloading` entry and wake whoever
        waits for it (`Downloading.settled`)."""
        previous = self.downloads.get(blob_hash)
        self.downloads[blob_hash] = handle
        if isinstance(previous, Downloading):
            previous.settled.set()
