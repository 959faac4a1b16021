"""A round's training step (upstream `state/train.rs`): the round's plan, then in the background
apply round N - 2, train each assigned batch and hand its result over for publishing.

`start_round` is plain: from the coordinator state it derives this client's duties in the round
(committee, witness, assigned batches) and the fresh round state. `run_round` is the step's body,
started by the state machine as a background task: it asks `fetch_data` for the batches while
`apply` applies round N - 2, then trains each batch on the trainer (`Trainer.train_exact` and
`Trainer.prepare_result`, in a worker thread: the trio loop keeps handling the network) and
hands each `OwnResult` to `publish`, which queues it for the client loop to announce.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from psyche.client.observe.logs import log_event
from psyche.client.round.apply import ApplyError, ApplyJob, apply_results
from psyche.client.round.fetch import DataFetcher
from psyche.client.round.state import CommitteeInfo, DeserializedPayload, RoundState
from psyche.coordinator import BLOOM_FALSE_RATE, Coordinator
from psyche.coordinator.committee_selection import CommitteeProof, CommitteeSelection
from psyche.coordinator.data_selection import (
    assign_data_for_state,
    get_batch_ids_for_node,
    get_batch_ids_for_round,
    training_nodes,
)
from psyche.coordinator.errors import CoordinatorError, CoordinatorErrorKind
from psyche.core.atomic_file import write_atomically
from psyche.core.batch_id import BatchId
from psyche.core.bloom import WitnessBloom
from psyche.core.log_markers import IntegrationTestLogMarker
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    from psyche.modeling.distro import DistroResult
    from psyche.modeling.screening import Reference
    from psyche.modeling.serialized_distro import TransmittableDistroResult
    from psyche.modeling.trainer import Batch, Trainer

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# The round's plan


@dataclass(frozen=True)
class RoundPlan:
    """What this client does in a round it starts training."""

    state: RoundState
    have_training: bool
    assigned_batches: list[BatchId]
    warmup_lr_between: tuple[int, int] | None
    zero_optim: bool


BloomFactory = Callable[[int, float], WitnessBloom]


def own_results_to_subtract(
    owed: list[list[DistroResult]],
    previous_round: list[list[DistroResult]],
    plan: RoundPlan,
) -> tuple[list[list[DistroResult]], list[list[DistroResult]]]:
    """What this round's training subtracts from the DisTrO momentum, and what stays owed.

    `owed` is what the client last sent and has not yet taken out; `previous_round` its own
    results of the round that just ended. A client subtracts the own results of the last round
    it trained: upstream takes the previous round's, the same for a client that trains every
    round, but a client that sat a round out (a verifier, a tie-breaker, no batch) would never
    take out what it sent, and its next result would carry it again: an honest result that a
    verifier's comparison finds weak (t below 10 in 2 of 372 role-switching verifications,
    docs/reliability.md). A new epoch's zeroed optimizer starts from nothing; a round without
    a batch (or without training: an epoch's last two) keeps what is owed for the next round
    that trains, in the next epoch too (the trainer's momentum goes on: `StepStateMachine`)."""
    if previous_round:
        owed = list(previous_round)
    if plan.zero_optim:
        owed = []
    if not plan.assigned_batches:
        return [], owed
    return owed, []


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
            round_, coordinator, training_nodes(coordinator, selection)
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


def log_round_start(
    state: Coordinator, identity: NodeIdentity, index: int, plan: RoundPlan
) -> None:
    info = plan.state.committee_info
    assert info is not None
    round_ = state.current_round()
    log_event(
        logger,
        "round_start",
        quiet=True,
        marker=IntegrationTestLogMarker.WitnessElected,
        client_id=str(identity),
        epoch=state.progress.epoch,
        step=state.progress.step,
        round=round_.height if round_ is not None else 0,
        clients=len(state.epoch_state.clients),
        index=index,
        committee=info.committee_proof.committee.name,
        witness=bool(info.witness_proof.witness),
        assigned=plan.assigned_batches,
        assignments=[f"{b}={n}" for b, n in plan.state.data_assignments.items()],
    )


# --------------------------------------------------------------------------------------------
# The step in the background


@dataclass(frozen=True)
class TrainJob:
    step: int
    proof: CommitteeProof
    assigned_batches: list[BatchId]
    warmup_lr_between: tuple[int, int] | None
    zero_optim: bool
    prev_self_results: list[list[DistroResult]]
    identity: NodeIdentity
    write_gradients_dir: Path | None


@dataclass(frozen=True)
class OwnResult:
    """This client's result for a batch, ready to announce (upstream `DistroBroadcastAndPayload`)."""

    step: int
    batch_id: BatchId
    commitment_data_hash: bytes
    proof: CommitteeProof
    payload: TransmittableDistroResult
    # The tensors `payload` carries (1-bit when the run quantizes): what everyone applies.
    sent: list[DistroResult]
    # Unquantized: what the next round's `generate` subtracts from the momentum.
    original: list[DistroResult]
    # This client's own update, the reference of its witness checks of the round (None when it
    # does not screen).
    reference: Reference | None = None

    def deserialized(self) -> DeserializedPayload:
        """The payload as a peer holds it once checked, without the bytes' round trip."""
        return DeserializedPayload(self.sent, self.payload.trainer_nonce)


@dataclass
class FinishedTraining:
    losses: list[float] = field(default_factory=list)
    optim_stats: dict[str, float] = field(default_factory=dict)
    duration: float = 0.0
    trained: list[BatchId] = field(default_factory=list)
    distro_seconds: float = 0.0
    """DisTrO's share of `duration`: applying round N - 2 and compressing this round's results."""


class TrainingStep:
    """Handle of a round's apply-and-train task (upstream `TrainingStep`)."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.finished = False
        self._done = trio.Event()
        self._outcome: FinishedTraining | BaseException | None = None
        self._data_scope: trio.CancelScope | None = None

    async def next_batch(
        self, incoming: trio.MemoryReceiveChannel[tuple[BatchId, Batch]]
    ) -> tuple[BatchId, Batch] | None:
        """The next fetched batch, or None once the round ended or the data ran out. Only the
        wait for data is cut short by `finish`; a batch being trained runs to its end."""
        if self.cancel.is_set():
            return None
        with trio.CancelScope() as scope:
            self._data_scope = scope
            try:
                return await incoming.receive()
            except trio.EndOfChannel:
                return None
            finally:
                self._data_scope = None
        return None

    def complete(self, outcome: FinishedTraining | BaseException) -> None:
        self._outcome = outcome
        self._done.set()

    async def finish(self) -> FinishedTraining:
        """Stop training (a batch in progress stops at its next micro-batch) and wait."""
        self.cancel.set()
        if self._data_scope is not None:
            self._data_scope.cancel()
        await self._done.wait()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        if not self.finished:
            logger.warning(
                "Training didn't finish when the Training round ended, we are likely to desync."
            )
        return self._outcome


async def run_round(
    handle: TrainingStep,
    trainer: Trainer,
    apply_job: ApplyJob | None,
    train_job: TrainJob | None,
    fetcher: DataFetcher | None,
    publish: Callable[[OwnResult], None],
    verify: Callable[[], Awaitable[None]] | None = None,
    *,
    verify_last: bool = False,
    follow: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """The body of a training step: apply (if due), then `verify` (a verifier's or
    tie-breaker's recompute, `round.verify`: it needs the weights the round trains from), then
    train each assigned batch and publish its result (with `verify_last`, a run whose verifiers
    train too, `verify` comes here instead: `train_exact` leaves the round's weights, so its own
    result is not held back by its checks), then `follow` (a follower's rebuilds of the trainers
    it follows, `round.follow`: the round's weights too), then the step's weight decay
    (`Trainer.decay_weights`, on every client whatever it trained). Stores the outcome in `handle`; never
    raises into the nursery."""
    start = time.monotonic()
    finished = FinishedTraining()
    try:
        incoming = None
        if train_job is not None and fetcher is not None and train_job.assigned_batches:
            incoming = fetcher.fetch(train_job.assigned_batches)
        if apply_job is not None:
            apply_start = time.monotonic()
            await apply_results(trainer, apply_job)
            finished.distro_seconds += time.monotonic() - apply_start
        if verify is not None and not verify_last:
            await verify()
        if incoming is not None and train_job is not None:
            async with incoming:
                while (item := await handle.next_batch(incoming)) is not None:
                    batch_id, batch = item
                    await _train_one(handle, trainer, train_job, batch_id, batch, finished, publish)
        if verify is not None and verify_last:
            await verify()
        if follow is not None:
            await follow()
        if train_job is not None:
            # the step's weight decay, on every client of a round that trains, however many of
            # its batches this one trained (none, as a verifier; cancelled): the same bits
            job = train_job
            await trio.to_thread.run_sync(
                lambda: trainer.decay_weights(job.step, warmup_lr_between=job.warmup_lr_between)
            )
        finished.duration = time.monotonic() - start
        handle.finished = True
        handle.complete(finished)
    except ApplyError as e:  # the machine says what it means (`apply_failed`)
        handle.complete(e)
    except Exception as e:
        logger.exception("training step failed")
        handle.complete(e)


async def _train_one(
    handle: TrainingStep,
    trainer: Trainer,
    job: TrainJob,
    batch_id: BatchId,
    batch: Batch,
    finished: FinishedTraining,
    publish: Callable[[OwnResult], None],
) -> None:
    log_event(logger, "training_started", quiet=True, step=job.step, batch_id=batch_id)
    timings: dict[str, float] = {}
    out = await trio.to_thread.run_sync(
        lambda: trainer.train_exact(
            job.step,
            batch,
            warmup_lr_between=job.warmup_lr_between,
            zero_optim=job.zero_optim,
            prev_self_distro_results=job.prev_self_results,
            cancel=handle.cancel,
            timings=timings,
        )
    )
    if out.cancelled:
        logger.info("Training of %s was cancelled; throwing the result away", batch_id)
        return
    for result in out.distro_results or []:
        for name, value in (result.stats or {}).items():
            previous = finished.optim_stats.get(name)
            finished.optim_stats[name] = value if previous is None else (previous + value) / 2.0
    serialize_start = time.perf_counter()
    prepared = await trio.to_thread.run_sync(
        lambda: trainer.prepare_result(out, step=job.step, batch_id=batch_id)
    )
    serialize_secs = time.perf_counter() - serialize_start
    reference = trainer.screening_reference()
    if job.write_gradients_dir is not None:
        try:
            await trio.to_thread.run_sync(
                write_gradients, job.write_gradients_dir, job.identity, prepared.payload
            )
        except OSError as e:
            logger.error("Failed to write gradients to disk: %s", e)
    loss = out.loss if math.isfinite(out.loss) else math.nan
    finished.distro_seconds += timings.get("generate", 0.0)
    finished.losses.append(loss)
    finished.trained.append(batch_id)
    log_event(
        logger,
        "trained_batch",
        quiet=True,
        client_id=str(job.identity),
        step=job.step,
        batch_id=batch_id,
        loss=loss,
        train_secs=round(out.duration, 4),
        generate_secs=round(timings.get("generate", 0.0), 4),
        serialize_secs=round(serialize_secs, 4),
        nonce=out.nonce,
    )
    publish(
        OwnResult(
            job.step,
            batch_id,
            prepared.commitment_hash,
            job.proof,
            prepared.payload,
            prepared.sent,
            out.distro_results or [],
            reference,
        )
    )


def write_gradients(
    directory: Path, identity: NodeIdentity, payload: TransmittableDistroResult
) -> None:
    """`--write-gradients-dir`: this client's serialized results, as upstream names them."""
    from psyche.modeling.serialized_distro import distro_results_to_bytes

    directory.mkdir(parents=True, exist_ok=True)
    name = f"result-{identity}-step{payload.step}-batch{payload.batch_id}.vec-postcard"
    write_atomically(directory / name, distro_results_to_bytes(payload.distro_results))
