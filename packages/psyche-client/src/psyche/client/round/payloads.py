"""Collecting a round's results: gossip messages and the payloads they announce (upstream
`StepStateMachine::apply_message` and `apply_distro_result` in `state/steps.rs`).

A verified sender's `Broadcast` is recorded in the round it belongs to (`apply_message`); a
training result's payload is then downloaded, checked against its commitment
(`payload_problem`), turned into tensors off the loop and screened by this client's witness
checks (`check_payload`), counted for the witness blooms if it passed
(`record_verified_payload`), and kept where the apply finds it. This client's own result
enters its round state directly, already checked and in tensors (`record_own_result`). The
functions above `check_payload` are plain: they take the round states and return what to do.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from psyche.client.observe.logs import log_event
from psyche.client.round.broadcast import Broadcast, BroadcastType
from psyche.client.round.state import (
    DeserializedPayload,
    Downloading,
    PayloadHandle,
    ResultEntry,
    RoundState,
)
from psyche.coordinator import Client
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.committee_selection import Committee
from psyche.core.batch_id import BatchId
from psyche.core.identity import verify_signature
from psyche.core.node_identity import NodeIdentity
from psyche.core.sha256 import sha256
from psyche.network import BlobTicket

if TYPE_CHECKING:
    from psyche.modeling.distro import DistroResult
    from psyche.modeling.screening import Verdict
    from psyche.modeling.serialized_distro import TransmittableDistroResult

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Gossip


class ApplyMessageOutcome(enum.Enum):
    Applied = "applied"
    # Not for us yet (not warmed up, no round info) or already known.
    Ignored = "ignored"
    Invalid = "invalid"
    # For the round after this client's current one: kept until that round starts here.
    Held = "held"


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
    if (
        not is_warmup
        and broadcast.proof.committee is not Committee.Trainer
        and from_id not in round_state.data_assignments.values()
    ):
        # Verifier and tie-breaker broadcasts are not implemented upstream either; they are
        # heard only where the round gave them a batch (a run whose verifiers train).
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
            round_state.announce_result(
                result.batch_id, ResultEntry(from_id, broadcast.commitment, result)
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
# Payloads


class PayloadRejected(ValueError):
    """A downloaded payload that does not answer its commitment."""


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
    round_state: RoundState,
    from_id: NodeIdentity,
    batch_id: BatchId,
    commitment_hash: bytes,
    *,
    attest: bool = True,
    vote: bool | None = None,
) -> None:
    """A checked payload settles its batch; one this client attests counts for its witness
    blooms (upstream attests every payload whose hash matched; here only one that passed the
    witness's checks: `check_payload`).

    An attested sender joins the participant bloom (it delivered: the health checks spare it);
    the first voted-for payload for a still-outstanding batch is this client's vote for that
    commitment in the broadcast bloom (what the consensus applies). `vote` defaults to `attest`;
    a witness whose checks refused a result without being able to tell the sender's fault from
    its own attests the delivery but withholds its vote (`check_payload`'s `accuse`). A refused
    payload settles its batch all the same (this client has judged it: the opportunistic
    witness need not wait for it).
    """
    outstanding = round_state.batch_ids_not_yet_trained_on
    if outstanding is None:
        return  # every batch already has a payload: nothing left to vote for
    if round_state.blooms is not None:
        participant_bloom, broadcast_bloom = round_state.blooms
        if attest:
            participant_bloom.add(sha256(from_id.signer))
        if (attest if vote is None else vote) and batch_id in outstanding:
            broadcast_bloom.add(commitment_hash)
    outstanding.discard(batch_id)
    if not outstanding:
        round_state.batch_ids_not_yet_trained_on = None


def record_own_result(
    current: RoundState,
    previous: RoundState,
    *,
    identity: NodeIdentity,
    clients: Sequence[Client],
    broadcast: Broadcast,
    payload: DeserializedPayload,
    original: list[DistroResult],
) -> RoundState | None:
    """This client's own training result, as it announced it: recorded like anyone's message
    (`apply_message`), and its payload as checked and in tensors at once: it was hashed for the
    commitment and `payload` holds the very tensors it serialized. `original` (unquantized) is
    what the next round's `generate` subtracts from the momentum. Returns the round it went to
    (None when that round is gone or the message was not applied).
    """
    if not isinstance(broadcast.data, BroadcastType.TrainingResult):
        raise TypeError("an own result is announced with a TrainingResult broadcast")
    result = broadcast.data.value
    outcome, _ = apply_message(
        current, previous, identity=identity, clients=clients, from_id=identity, broadcast=broadcast
    )
    if outcome is not ApplyMessageOutcome.Applied:
        return None
    round_state = round_for_step(current, previous, broadcast.step)
    assert round_state is not None  # apply_message found it
    round_state.self_distro_results.append(original)
    record_verified_payload(round_state, identity, result.batch_id, broadcast.commitment.data_hash)
    handle = PayloadHandle()
    handle.set_result(payload)
    round_state.settle(result.ticket.hash, handle)
    return round_state


# --------------------------------------------------------------------------------------------
# Checking a downloaded payload (off the loop)


ScreenResult = Callable[
    [RoundState, NodeIdentity, "list[DistroResult]"], Awaitable["Verdict | None"]
]
"""A witness's checks of a peer's decoded result (`StepStateMachine.screen_result`): its
verdict, or None when this client does not screen."""


async def check_payload(
    round_state: RoundState,
    blob_hash: bytes,
    payload: TransmittableDistroResult,
    pending: PendingPayload,
    results_from_payload: Callable[[TransmittableDistroResult], list[DistroResult]],
    screen_result: ScreenResult | None = None,
    accuse: bool = True,
) -> None:
    """Hash a peer's payload (in a worker thread) against its commitment; if it answers it,
    deserialize it, validated against this model and run by `results_from_payload`
    (`Trainer.results_from_payload`: DisTrO's or DiLoCo's checks), screen the decoded result
    (`screen_result`: agreement, norm, copies; `psyche.modeling.screening`), and only then count
    it for the blooms; it goes into the round's downloads either way.

    A result the checks refuse gets no vote; with `accuse` (a witness whose checks can be
    trusted to tell a bad result from its own view, `StepStateMachine.checks_accuse`) its
    sender is not attested either, so the health checks drop it as for a missing result.
    Without, the sender is attested as having delivered: a refusal that may be this witness's
    own error must not drop an honest member (with one witness a round, it would). A refusal
    by a witness with no update of its own that round (`Verdict.blind`: judged against the
    round's other results, whose order a trainer controls) never accuses.

    Whatever this client thinks of a result, what is applied is the coordinator's consensus
    over every witness's blooms, which an honest client follows even where its own witness
    judged otherwise: so a refused result is kept for the apply. A payload that does not answer
    its commitment is logged and marked refused in place of its download, so an apply that was
    waiting for it skips it; one that does not decode or validate is kept as refused.
    """
    digest = await trio.to_thread.run_sync(payload.compute_hash)
    problem = payload_problem(digest, payload.step, payload.batch_id, pending, round_state.step)
    if problem is not None:
        _log_refusal("payload_rejected", round_state, pending, problem)
        # The blob is content-addressed, so every honest client holds these same bytes and
        # refuses them: if a (dishonest) witness voted for this commitment anyway, all of
        # them skip it at apply alike. Upstream keeps waiting for a download that already
        # happened and then fails the apply.
        refuse_payload(round_state, blob_hash, problem)
        return
    if not isinstance(round_state.downloads.get(blob_hash), Downloading):
        return  # checked twice concurrently, or already applied
    handle = PayloadHandle()
    round_state.settle(blob_hash, handle)
    commitment_hash = pending.commitment.data_hash
    try:
        value = await trio.to_thread.run_sync(_deserialize, payload, results_from_payload)
    except Exception as e:
        _log_refusal("payload_invalid", round_state, pending, str(e))
        record_verified_payload(
            round_state, pending.from_, pending.batch_id, commitment_hash, attest=False
        )
        handle.set_error(e)
        return
    verdict = None
    if screen_result is not None:
        verdict = await screen_result(round_state, pending.from_, value.results)
    if verdict is not None and not verdict.passed:
        measure = verdict.measure
        _log_refusal(
            "payload_refused",
            round_state,
            pending,
            str(verdict.problem),
            agreement=round(measure.agreement, 3),
            norm=round(measure.norm, 6),
            checked=verdict.checked,
            accused=accuse and not verdict.blind,
        )
    elif verdict is not None:
        log_event(
            logger,
            "payload_checked",
            quiet=True,
            step=round_state.step,
            batch_id=pending.batch_id,
            sender=str(pending.from_),
            agreement=round(verdict.measure.agreement, 3),
            norm=round(verdict.measure.norm, 6),
            checked=verdict.checked,
        )
    passed = verdict is None or verdict.passed
    blind = verdict is not None and verdict.blind
    # a check without an own update holds its vote back until the witness is sent
    index = verdict.index if verdict is not None and round_state.screen is not None else None
    held = index is not None
    outstanding = round_state.batch_ids_not_yet_trained_on
    if index is not None:
        round_state.held_checks = max(round_state.held_checks, index + 1)
        if outstanding is not None and pending.batch_id in outstanding:
            round_state.blind_votes.setdefault(pending.batch_id, (index, commitment_hash))
    record_verified_payload(
        round_state,
        pending.from_,
        pending.batch_id,
        commitment_hash,
        attest=passed or not accuse or blind,
        vote=passed and not held,
    )
    handle.set_result(value)


def judgement_due(round_state: RoundState) -> bool:
    """Whether the round's held votes wait for a judgement (`settle_blind_votes`) that is not
    made yet, or that was made before the last held check came in."""
    if round_state.screen is None or round_state.blooms is None or round_state.sent_witness:
        return False
    if not round_state.blind_votes:
        return False
    judged = round_state.judgement
    return judged is None or len(judged) < round_state.held_checks


def settle_blind_votes(round_state: RoundState) -> None:
    """Cast the votes held back by checks without an own update of this round (`check_payload`),
    once, as this client sends its witness: each judged again over every result of the round
    checked so far (`RoundScreen.judge`), so a hostile result that came first is refused once
    honest ones followed, and an honest one it made fail is voted for. Arrival order no longer
    decides this witness's vote; what is applied stays the consensus over every witness's
    blooms, the same for every honest client.

    The judgement is the one the client made off the loop just before (`round_state.judgement`,
    `screening.judge_round`: model-sized work in a worker thread); where none covers every held
    check, it is made here. The round takes the judgement the votes follow (`RoundScreen.commit`:
    what it folds and the level it lends), not any made before it."""
    stale = judgement_due(round_state)
    votes, round_state.blind_votes = round_state.blind_votes, {}
    screen = round_state.screen
    if not votes or screen is None or round_state.blooms is None:
        return
    verdicts = screen.judge() if stale or round_state.judgement is None else round_state.judgement
    screen.commit(verdicts)
    _, broadcast_bloom = round_state.blooms
    for batch_id, (index, commitment_hash) in votes.items():
        if index >= len(verdicts):
            continue  # not judged (cannot happen: a vote is held only after its check)
        verdict = verdicts[index]
        if verdict.passed:
            broadcast_bloom.add(commitment_hash)
        log_event(
            logger,
            "payload_judged",
            quiet=verdict.passed,
            step=round_state.step,
            batch_id=batch_id,
            passed=verdict.passed,
            reason=verdict.problem,
            agreement=round(verdict.measure.agreement, 3),
        )


def refuse_payload(round_state: RoundState, blob_hash: bytes, reason: str) -> bool:
    """Mark a payload the round still waits for as refused (`PayloadRejected(reason)`): the
    apply skips it at once, and since the round knows the hash, announcing it again in this
    round downloads nothing. False when the round was not waiting for it."""
    if not isinstance(round_state.downloads.get(blob_hash), Downloading):
        return False
    rejected = PayloadHandle()
    rejected.set_error(PayloadRejected(reason))
    round_state.settle(blob_hash, rejected)
    return True


def _deserialize(
    payload: TransmittableDistroResult,
    results_from_payload: Callable[[TransmittableDistroResult], list[DistroResult]],
) -> DeserializedPayload:
    return DeserializedPayload(results_from_payload(payload), payload.trainer_nonce)


def _log_refusal(
    event: str, round_state: RoundState, pending: PendingPayload, reason: str, **measures: Any
) -> None:
    """One line per refused payload, whose download a member's signed announcement for its
    own batch caused (no line costs less than a download). `measures`: what the witness checks
    measured (`payload_refused`), to tell an honest result refused from a lie caught."""
    log_event(
        logger,
        event,
        logging.WARNING,
        step=round_state.step,
        batch_id=pending.batch_id,
        sender=str(pending.from_),
        reason=reason,
        **measures,
    )
