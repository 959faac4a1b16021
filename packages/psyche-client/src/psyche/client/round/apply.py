"""Applying round N - 2's results at the start of round N (upstream `apply_results`,
`state/train.rs`).

`plan_apply` is the consensus, a plain function: for each batch of that round, the commitment
most witnesses of round N - 1 voted for. `apply_results` carries it out: it waits (bounded) for
each chosen payload to be checked and deserialized, drops what cannot be applied, and has the
trainer take one DisTrO step on the rest, in batch order, in a worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from psyche.client.observe.logs import log_event
from psyche.client.round.broadcast import Broadcast, BroadcastType
from psyche.client.round.state import Downloading, PayloadHandle, RoundState
from psyche.coordinator import Client, Coordinator, Witness
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.data_selection import get_batch_ids_for_round, training_nodes
from psyche.coordinator.errors import CoordinatorError, CoordinatorErrorKind
from psyche.coordinator.model import Checkpoint
from psyche.core.batch_id import BatchId
from psyche.core.log_markers import IntegrationTestLogMarker
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    from psyche.modeling.distro import DistroResult
    from psyche.modeling.trainer import Trainer

logger = logging.getLogger(__name__)


class ApplyError(RuntimeError):
    """The agreed results could not be applied: this client's model would leave the run's."""


# --------------------------------------------------------------------------------------------
# The consensus


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
    round_before = coordinator.previous_previous_round()
    if round_before is None or previous.committee_info is None:
        raise CoordinatorError(CoordinatorErrorKind.NoActiveRound)
    witnesses, quorum = deciding_witnesses(coordinator)
    batch_ids = get_batch_ids_for_round(
        round_before, coordinator, training_nodes(coordinator, previous.committee_info.selection)
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


def deciding_witnesses(coordinator: Coordinator) -> tuple[Sequence[Witness], int]:
    """The witnesses whose blooms decide round N - 2's apply (those of round N - 1, the
    coordinator being at round N) and how many of them must agree."""
    previous_round = coordinator.previous_round()
    if previous_round is None:
        raise CoordinatorError(CoordinatorErrorKind.NoActiveRound)
    witnesses = previous_round.witnesses
    return witnesses, coordinator.witness_quorum(len(witnesses))


def agreed_but_unapplied(
    job: ApplyJob, from_id: NodeIdentity, broadcast: Broadcast, clients: Sequence[Client]
) -> bool:
    """Whether `broadcast`, a result arriving after `job` (the apply of its round) was planned,
    is one the run agreed on that the plan left out as untrained.

    The plan can only take what this client had received when the round two later started;
    the witnesses may have seen more. A batch's commitment that reaches the witnesses' quorum
    is applied by every client that holds its announcement, so a client that had none for it
    applied a different set: its model has left the run's. The check is the consensus itself
    (`select_consensus_commitment_by_witnesses` over the witnesses the plan used), evaluated
    on the announcement from the batch's assigned trainer, so it is exact: no other client
    decided otherwise on the same message.
    """
    data = broadcast.data
    if not isinstance(data, BroadcastType.TrainingResult) or broadcast.step != job.round_state.step:
        return False
    batch_id = data.value.batch_id
    info = job.round_state.committee_info
    if (
        batch_id not in job.plan.untrained
        or job.round_state.data_assignments.get(batch_id) != from_id
        or info is None
        or not info.selection.verify_committee_for_client(from_id, broadcast.proof, clients)
    ):
        return False
    witnesses, quorum = deciding_witnesses(job.coordinator)  # as the plan found them
    chosen = Coordinator.select_consensus_commitment_by_witnesses(
        [broadcast.commitment], witnesses, quorum
    )
    return chosen is not None


def skip_for_cold_start(coordinator: Coordinator, trainer_nonce: int) -> bool:
    """A trainer still warming up its optimizer after joining a running model is not applied
    (only with a P2P checkpoint: in a fresh run everyone starts together)."""
    llm = coordinator.model.value
    is_p2p = isinstance(llm.checkpoint, Checkpoint.P2P | Checkpoint.P2PGcs)
    return is_p2p and trainer_nonce < llm.cold_start_warmup_steps


# --------------------------------------------------------------------------------------------
# Carrying it out


async def wait_for_payload(
    round_state: RoundState, blob_hash: bytes, deadline: float
) -> PayloadHandle:
    """The checked payload for a chosen commitment, waiting (until `deadline`, trio clock) for one
    still downloading or deserializing.

    Upstream fails at once when the payload is not deserialized yet; waiting a bounded time
    gives the same result whenever upstream succeeds and rides out a slow download otherwise.
    Nothing polls: a download's entry signals when its checked payload takes its place.
    """
    state = round_state.downloads.get(blob_hash)
    if isinstance(state, Downloading):
        with trio.move_on_at(deadline):
            await state.settled.wait()
        if not state.settled.is_set():
            raise ApplyError(
                f"payload {blob_hash[:5].hex()} for batch {state.batch_id} was not downloaded in time"
            )
        state = round_state.downloads.get(blob_hash)
    if state is None:
        raise ApplyError(f"unknown consensus payload {blob_hash[:5].hex()}")
    assert isinstance(state, PayloadHandle)
    with trio.move_on_at(deadline):
        await state.wait()
    if not state.done:
        raise ApplyError(f"payload {blob_hash[:5].hex()} did not finish deserializing")
    return state


@dataclass(frozen=True)
class ApplyJob:
    plan: ApplyPlan
    round_state: RoundState
    coordinator: Coordinator
    warmup_lr_between: tuple[int, int] | None
    deadline: float
    identity: NodeIdentity | None = None


async def apply_results(trainer: Trainer, job: ApplyJob) -> list[BatchId]:
    """Apply the chosen payloads in batch order; returns the batches applied."""
    plan = job.plan
    for batch_id in plan.untrained:
        expected = job.round_state.data_assignments.get(batch_id)
        log_event(
            logger,
            "untrained_batch",
            logging.WARNING,
            marker=IntegrationTestLogMarker.UntrainedBatches,
            step=plan.step,
            batch_id=batch_id,
            expected_trainer=str(expected),
        )
    for batch_id in plan.no_consensus:
        logger.warning("No consensus commitment for batch %s", batch_id)
    results: list[list[DistroResult]] = []
    applied: list[BatchId] = []
    refused: list[BatchId] = []
    warming_up: list[BatchId] = []
    for chosen in plan.chosen:
        handle = await wait_for_payload(job.round_state, chosen.blob_hash, job.deadline)
        try:
            payload = handle.outcome()
        except Exception as e:
            logger.warning(
                "DESYNC: Got the following error when deserializing results for commitment "
                "0x%s: %s",
                chosen.commitment.data_hash.hex(),
                e,
            )
            refused.append(chosen.batch_id)
            continue
        if skip_for_cold_start(job.coordinator, payload.trainer_nonce):
            logger.info("Skipping apply of batch %s, trainer warming up", chosen.batch_id)
            warming_up.append(chosen.batch_id)
            continue
        results.append(payload.results)
        applied.append(chosen.batch_id)
    started = time.perf_counter()

    def optimize() -> None:
        if job.round_state.height == 0:
            trainer.start_epoch()  # this epoch's first apply (DiLoCo's outer momentum restarts)
        trainer.optimize(plan.step, warmup_lr_between=job.warmup_lr_between, distro_results=results)
        trainer.synchronize()

    await trio.to_thread.run_sync(optimize)
    job.round_state.downloads.clear()
    # what was left out, and why, in the same event: two clients' events of one step tell
    # whether (and where) they applied different sets
    log_event(
        logger,
        "applied_results",
        quiet=True,
        client_id=str(job.identity),
        step=plan.step,
        batches=applied,
        untrained=plan.untrained,
        no_consensus=plan.no_consensus,
        refused=refused,
        warming_up=warming_up,
        apply_secs=round(time.perf_counter() - started, 4),
    )
    return applied
