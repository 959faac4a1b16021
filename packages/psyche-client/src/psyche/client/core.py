"""The client's consensus-critical decisions as plain functions (upstream `state/*.rs`).

Nothing here touches a socket, a clock or a model: each function takes the coordinator state and
the client's round states and returns what to do (or updates the round state it is given). The
trio shells in `steps`, `training` and `client` carry the decisions out. Every honest client
computes the same answers from the same coordinator state and messages, which is what keeps
their models identical.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from psyche.client.broadcast import Broadcast, BroadcastType, Finished
from psyche.client.round_state import (
    CommitteeInfo,
    Downloading,
    PayloadHandle,
    ResultEntry,
    RoundState,
)
from psyche.coordinator import (
    BLOOM_FALSE_RATE,
    Client,
    Coordinator,
    Witness,
    WitnessProof,
)
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.committee_selection import Committee, CommitteeProof, CommitteeSelection
from psyche.coordinator.consensus import unhealthy_trainers
from psyche.coordinator.data_selection import (
    assign_data_for_state,
    get_batch_ids_for_node,
    get_batch_ids_for_round,
)
from psyche.coordinator.errors import CoordinatorError, CoordinatorErrorKind
from psyche.coordinator.model import Checkpoint
from psyche.core.batch_id import BatchId
from psyche.core.bloom import WitnessBloom
from psyche.core.identity import verify_signature
from psyche.core.merkle_tree import MerkleRoot, MerkleTree
from psyche.core.node_identity import NodeIdentity
from psyche.core.sha256 import sha256
from psyche.network.ticket import BlobTicket

# --------------------------------------------------------------------------------------------
# Receiving gossip


class ApplyMessageOutcome(enum.Enum):
    Applied = "applied"
    # Not for us yet (not warmed up, no round info) or already known.
    Ignored = "ignored"
    Invalid = "invalid"


@dataclass(frozen=True)
class DownloadRequest:
    ticket: BlobTicket
    tag: str


def client_for_p2p_key(clients: Sequence[Client], p2p_key: bytes) -> NodeIdentity | None:
    """The run member whose p2p key sent a gossip message (upstream
    `get_client_for_p2p_public_key`)."""
    for client in clients:
        if client.id.p2p_identity == p2p_key:
            return client.id
    return None


def verify_broadcast_signature(p2p_key: bytes, broadcast: Broadcast) -> bool:
    """The sender's p2p key must have signed the commitment's hash (upstream `raw_p2p_verify`)."""
    return verify_signature(p2p_key, broadcast.commitment.data_hash, broadcast.commitment.signature)


def round_for_step(current: RoundState, previous: RoundState, step: int) -> RoundState | None:
    if current.step == step:
        return current
    if previous.step == step:
        return previous
    return None


def apply_message(
    current: RoundState,
    previous: RoundState,
    *,
    identity: NodeIdentity,
    clients: Sequence[Client],
    from_id: NodeIdentity,
    broadcast: Broadcast,
) -> tuple[ApplyMessageOutcome, DownloadRequest | None]:
    """Record a verified sender's broadcast in the round it belongs to (upstream
    `StepStateMachine::apply_message`); returns the outcome and the payload to fetch, if any.

    A broadcast for any step other than the current or previous round is invalid, so an old
    message replayed later is refused.
    """
    round_state = round_for_step(current, previous, broadcast.step)
    if round_state is None:
        return ApplyMessageOutcome.Invalid, None
    data = broadcast.data
    is_warmup = isinstance(data, BroadcastType.Finished) and data.value.warmup
    if not is_warmup and from_id != identity:
        info = round_state.committee_info
        if info is None:
            return ApplyMessageOutcome.Ignored, None
        if not info.selection.verify_committee_for_client(from_id, broadcast.proof, clients):
            return ApplyMessageOutcome.Invalid, None
    elif not any(c.id == from_id for c in clients):
        return ApplyMessageOutcome.Invalid, None
    if not is_warmup and broadcast.proof.committee is not Committee.Trainer:
        # Verifier and tie-breaker broadcasts are not implemented upstream either.
        return ApplyMessageOutcome.Invalid, None

    download = None
    match data:
        case BroadcastType.TrainingResult(result):
            assignee = round_state.data_assignments.get(result.batch_id)
            if assignee is None:
                return ApplyMessageOutcome.Invalid, None
            blob_hash = result.ticket.hash
            if round_state.distro_result_blob_downloaded(blob_hash):
                return ApplyMessageOutcome.Ignored, None
            if from_id != assignee:
                return ApplyMessageOutcome.Invalid, None
            round_state.results.setdefault(result.batch_id, []).append(
                ResultEntry(from_id, broadcast.commitment, result)
            )
            round_state.downloads[blob_hash] = Downloading(from_id, result.batch_id, result.ticket)
            if from_id != identity:
                tag = f"downloaded-distro-result-{from_id}_{broadcast.step}"
                download = DownloadRequest(result.ticket, tag)
        case BroadcastType.Finished(finished):
            if from_id in round_state.clients_finished:
                return ApplyMessageOutcome.Ignored, None
            round_state.clients_finished[from_id] = finished
    round_state.broadcasts.append(broadcast.commitment.data_hash)
    return ApplyMessageOutcome.Applied, download


# --------------------------------------------------------------------------------------------
# Receiving payloads


def round_for_payload(rounds: Sequence[RoundState], blob_hash: bytes) -> RoundState | None:
    """The first round (current, then previous, ...) that announced this blob."""
    for round_state in rounds:
        if round_state.distro_result_blob_downloaded(blob_hash):
            return round_state
    return None


@dataclass(frozen=True)
class PendingPayload:
    from_: NodeIdentity
    batch_id: BatchId
    commitment: Commitment


def commitment_for_payload(round_state: RoundState, blob_hash: bytes) -> PendingPayload | None:
    """The announcement a downloaded blob answers, if it is still waiting for its payload."""
    state = round_state.downloads.get(blob_hash)
    if not isinstance(state, Downloading):
        return None  # unknown, or a duplicate download of a payload already checked
    for entry in round_state.results.get(state.batch_id, []):
        if entry.from_ == state.from_ and entry.result.ticket.hash == blob_hash:
            return PendingPayload(state.from_, state.batch_id, entry.commitment)
    return None


def payload_problem(
    payload_hash: bytes,
    payload_step: int,
    payload_batch: BatchId,
    expected: PendingPayload,
    step: int,
) -> str | None:
    """Why a downloaded payload does not answer its commitment, or None.

    Upstream checks only the hash; the step and batch inside the payload are checked too (the
    hash covers them, so an honest trainer's payload always passes).
    """
    if payload_hash != expected.commitment.data_hash:
        return "payload hash does not match the commitment"
    if payload_step != step:
        return f"payload is for step {payload_step}, the announcement for step {step}"
    if payload_batch != expected.batch_id:
        return f"payload is for batch {payload_batch}, the announcement for {expected.batch_id}"
    return None


def record_verified_payload(
    round_state: RoundState, from_id: NodeIdentity, batch_id: BatchId, commitment_hash: bytes
) -> None:
    """A checked payload counts for the witness blooms (upstream, after the hash check).

    The sender joins the participant bloom; the first payload for a still-outstanding batch is
    this client's vote for that commitment in the broadcast bloom.
    """
    outstanding = round_state.batch_ids_not_yet_trained_on
    if outstanding is None:
        return  # every batch already has a payload: nothing left to vote for
    if round_state.blooms is not None:
        participant_bloom, broadcast_bloom = round_state.blooms
        participant_bloom.add(sha256(from_id.signer))
        if batch_id in outstanding:
            broadcast_bloom.add(commitment_hash)
    outstanding.discard(batch_id)
    if not outstanding:
        round_state.batch_ids_not_yet_trained_on = None


# --------------------------------------------------------------------------------------------
# Starting a round


@dataclass(frozen=True)
class RoundPlan:
    """What this client does in a round it starts training."""

    state: RoundState
    have_training: bool
    assigned_batches: list[BatchId]
    warmup_lr_between: tuple[int, int] | None
    zero_optim: bool


BloomFactory = Callable[[int, float], WitnessBloom]


def start_round(
    coordinator: Coordinator,
    identity: NodeIdentity,
    client_index: int,
    *,
    new_bloom: BloomFactory = WitnessBloom.random,
) -> RoundPlan:
    """The round state for the coordinator's current round (upstream `TrainingStepMetadata::
    start`): committee and witness duty, who trains which batch, fresh blooms."""
    round_ = coordinator.current_round()
    if round_ is None:
        raise CoordinatorError(CoordinatorErrorKind.NoActiveRound)
    clients = coordinator.epoch_state.clients
    selection = CommitteeSelection(
        round_.tie_breaker_tasks,
        coordinator.config.witness_nodes,
        coordinator.config.verification_percent,
        len(clients),
        round_.random_seed,
    )
    # The epoch's last two rounds only apply what is left; nobody trains.
    have_training = not coordinator.epoch_state.last_step_set()
    if have_training:
        assignments = assign_data_for_state(coordinator, selection)
        all_batch_ids = get_batch_ids_for_round(
            round_, coordinator, selection.get_num_trainer_nodes()
        )
        outstanding: set[BatchId] | None = set(all_batch_ids)
    else:
        assignments, all_batch_ids, outstanding = {}, [], None
    info = CommitteeInfo(
        selection.get_committee(client_index), selection.get_witness(client_index), selection
    )
    blooms = (
        new_bloom(len(clients), BLOOM_FALSE_RATE),
        new_bloom(len(all_batch_ids), BLOOM_FALSE_RATE),
    )
    state = RoundState(
        height=round_.height,
        step=coordinator.progress.step,
        data_assignments=assignments,
        blooms=blooms,
        committee_info=info,
        batch_ids_not_yet_trained_on=outstanding,
    )
    warmup_lr_between = coordinator.get_cold_start_warmup_bounds()
    return RoundPlan(
        state=state,
        have_training=have_training,
        assigned_batches=get_batch_ids_for_node(assignments, identity),
        warmup_lr_between=warmup_lr_between,
        zero_optim=warmup_lr_between is not None and round_.height == 0,
    )


# --------------------------------------------------------------------------------------------
# Applying a round's results


@dataclass(frozen=True)
class ChosenResult:
    batch_id: BatchId
    commitment: Commitment
    blob_hash: bytes


@dataclass(frozen=True)
class ApplyPlan:
    """Which payloads of round N - 2 to apply at the start of round N, in batch order."""

    step: int
    batch_ids: list[BatchId]
    chosen: list[ChosenResult]
    untrained: list[BatchId]
    no_consensus: list[BatchId]


def needs_apply(current: RoundState) -> bool:
    """Rounds 0 and 1 of an epoch have nothing to apply (upstream checks the height of the round
    before the one starting, which is 0 for both)."""
    return current.height != 0


def plan_apply(previous: RoundState, coordinator: Coordinator) -> ApplyPlan:
    """Consensus over round N - 2's results (upstream `apply_results`).

    `previous` is the client's state of round N - 2; the coordinator has moved on to round N, so
    its previous round's witnesses voted on round N - 2 and its previous-previous round is
    round N - 2 itself. For each batch (in `get_batch_ids_for_round` order) the commitment most
    witnesses saw wins, with ties to the last (`select_consensus_commitment_by_witnesses`).
    """
    previous_round = coordinator.previous_round()
    round_before = coordinator.previous_previous_round()
    if previous_round is None or round_before is None or previous.committee_info is None:
        raise CoordinatorError(CoordinatorErrorKind.NoActiveRound)
    witnesses = previous_round.witnesses
    quorum = coordinator.witness_quorum(len(witnesses))
    batch_ids = get_batch_ids_for_round(
        round_before, coordinator, previous.committee_info.selection.get_num_trainer_nodes()
    )
    chosen, untrained, no_consensus = [], [], []
    for batch_id in batch_ids:
        entries = previous.results.get(batch_id)
        if not entries:
            untrained.append(batch_id)
            continue
        index = Coordinator.select_consensus_commitment_by_witnesses(
            [e.commitment for e in entries], witnesses, quorum
        )
        if index is None:
            no_consensus.append(batch_id)
            continue
        entry = entries[index]
        chosen.append(ChosenResult(batch_id, entry.commitment, entry.result.ticket.hash))
    return ApplyPlan(coordinator.progress.step, batch_ids, chosen, untrained, no_consensus)


def skip_for_cold_start(coordinator: Coordinator, trainer_nonce: int) -> bool:
    """A trainer still warming up its optimizer after joining a running model is not applied
    (only with a P2P checkpoint: in a fresh run everyone starts together)."""
    llm = coordinator.model.value  # type: ignore[attr-defined]
    is_p2p = isinstance(llm.checkpoint, Checkpoint.P2P | Checkpoint.P2PGcs)
    return is_p2p and trainer_nonce < llm.cold_start_warmup_steps


# --------------------------------------------------------------------------------------------
# Health checks and witnesses


def health_checks(
    round_state: RoundState, coordinator: Coordinator
) -> list[tuple[NodeIdentity, CommitteeProof]]:
    """The trainers of the round just finished that too few witnesses saw (upstream
    `start_sending_health_checks`); only a witness of that round sends them."""
    if round_state.height == 0:
        return []
    info = round_state.committee_info
    if info is None:
        raise CoordinatorError(CoordinatorErrorKind.NoActiveRound)
    if coordinator.epoch_state.first_round or not info.witness_proof.witness:
        return []
    return unhealthy_trainers(coordinator, info.selection)


def merkle_root(broadcasts: Sequence[bytes]) -> MerkleRoot:
    return MerkleTree(broadcasts).get_root() or MerkleRoot()


def witness_to_send(previous: RoundState, current: RoundState) -> Witness | None:
    """The witness for the previous round, once, if this client is a witness of the current one
    (upstream `WitnessStep::get_witness_to_send`); marks it sent."""
    if previous.sent_witness:
        return None
    info = current.committee_info
    if info is None or not info.witness_proof.witness:
        return None
    if previous.blooms is not None:
        participant_bloom, broadcast_bloom = (b.copy() for b in previous.blooms)
    else:
        participant_bloom, broadcast_bloom = WitnessBloom(), WitnessBloom()
    previous.sent_witness = True
    return Witness(
        info.witness_proof, participant_bloom, broadcast_bloom, merkle_root(previous.broadcasts)
    )


@dataclass(frozen=True)
class SendFinished:
    step: int
    merkle: MerkleRoot
    proof: CommitteeProof
    warmup: bool

    @property
    def commitment_data_hash(self) -> bytes:
        return sha256(self.merkle.inner)


@dataclass(frozen=True)
class SendWitness:
    witness: Witness


@dataclass(frozen=True)
class SendWarmupWitness:
    witness: Witness


OpportunisticAction = SendFinished | SendWitness | SendWarmupWitness | None


def unfinished_clients(round_state: RoundState, clients: Sequence[Client]) -> list[NodeIdentity]:
    return [c.id for c in clients if c.id not in round_state.clients_finished]


def previous_round_settled(previous: RoundState) -> bool:
    """Every batch of the previous round has a checked payload and all are deserialized."""
    if previous.batch_ids_not_yet_trained_on is not None:
        return False
    return all(isinstance(s, PayloadHandle) and s.done for s in previous.downloads.values())


def opportunistic_training_action(
    current: RoundState,
    previous: RoundState,
    *,
    training_finished: bool,
    clients: Sequence[Client],
) -> OpportunisticAction:
    """Upstream's 500 ms check during training: once this client has trained and has every
    payload of the previous round, it says so (`Finished`, once); once everyone has, a witness
    sends its witness without waiting for the round's timeout. Marks what it returns as sent."""
    info = current.committee_info
    if info is None or not training_finished or not previous_round_settled(previous):
        return None
    if not current.sent_finished:
        current.sent_finished = True
        return SendFinished(
            current.step, merkle_root(previous.broadcasts), info.committee_proof, warmup=False
        )
    if unfinished_clients(current, clients):
        return None
    witness = witness_to_send(previous, current)
    return SendWitness(witness) if witness is not None else None


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


def finished_broadcast(action: SendFinished, signature: bytes, nonce: int) -> Broadcast:
    return Broadcast(
        step=action.step,
        proof=action.proof,
        commitment=Commitment(action.commitment_data_hash, signature),
        nonce=nonce,
        data=BroadcastType.Finished(Finished(action.merkle, action.warmup)),
    )
