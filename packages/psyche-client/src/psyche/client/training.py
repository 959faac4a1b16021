"""A round's work on the model: apply round N - 2, fetch the assigned batch, train, publish.

Upstream `state/train.rs` and `fetch_data.rs`. The model is touched by one worker thread at a
time (apply, then each batch); the trio loop keeps handling the network meanwhile. What to apply
is decided by `core.plan_apply` before the task starts; this module only carries it out.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from psyche.client.core import ApplyPlan, skip_for_cold_start
from psyche.client.logs import log_event
from psyche.client.round_state import Downloading, PayloadHandle, RoundState
from psyche.coordinator.committee_selection import CommitteeProof
from psyche.core.atomic_file import write_atomically
from psyche.core.batch_id import BatchId
from psyche.core.log_markers import IntegrationTestLogMarker
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    from psyche.coordinator.coordinator import Coordinator
    from psyche.data_provider.types import TokenizedData, TokenizedDataProvider
    from psyche.modeling.distro import DistroResult
    from psyche.modeling.serialized_distro import TransmittableDistroResult
    from psyche.modeling.trainer import Batch, Trainer, TrainOutput

logger = logging.getLogger(__name__)

# Upstream DataFetcher: 7 retries, waiting 2 s x (attempt - 1) before each.
FETCH_MAX_RETRIES = 7
FETCH_BASE_DELAY_SECS = 2.0


class ApplyError(RuntimeError):
    """The agreed results could not be applied: this client's model would leave the run's."""


# --------------------------------------------------------------------------------------------
# Data


def batch_from_samples(samples: Sequence[TokenizedData]) -> Batch:
    import numpy as np
    import torch

    from psyche.modeling.trainer import Batch

    if not samples:
        raise ValueError("empty batch")

    def stack(rows: list[Any]) -> Any:
        lengths = {len(r) for r in rows}
        if len(lengths) != 1:
            raise ValueError(f"samples of different lengths {sorted(lengths)} cannot be batched")
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    labels = [s.labels for s in samples]
    positions = [s.position_ids for s in samples]
    return Batch(
        stack([s.input_ids for s in samples]),
        None if any(x is None for x in labels) else stack(labels),
        None if any(x is None for x in positions) else stack(positions),
    )


class DataFetcher:
    """Fetches a round's assigned batches in the background, a few ahead (upstream buffer: two
    per data-parallel trainer). A new round's fetch cancels the previous one."""

    def __init__(self, provider: TokenizedDataProvider, nursery: trio.Nursery, buffer: int = 2):
        self.provider = provider
        self._nursery = nursery
        self._buffer = buffer
        self._scope: trio.CancelScope | None = None
        self._lock = trio.Lock()

    def fetch(
        self, batch_ids: Sequence[BatchId]
    ) -> trio.MemoryReceiveChannel[tuple[BatchId, Batch]]:
        if self._scope is not None:
            self._scope.cancel()
        send, receive = trio.open_memory_channel[tuple[BatchId, "Batch"]](self._buffer)
        scope = trio.CancelScope()
        self._scope = scope
        self._nursery.start_soon(self._run, list(batch_ids), send, scope)
        return receive

    async def _run(
        self,
        batch_ids: list[BatchId],
        send: trio.MemorySendChannel[tuple[BatchId, Batch]],
        scope: trio.CancelScope,
    ) -> None:
        with scope:
            async with send:
                while batch_ids:
                    batch_id = batch_ids.pop()  # upstream pops from the end
                    samples = await self._get_with_retries(batch_id)
                    if samples is None:
                        return
                    try:
                        await send.send((batch_id, batch_from_samples(samples)))
                    except trio.BrokenResourceError:
                        return  # the round stopped reading (it ended while we fetched)

    async def _get_with_retries(self, batch_id: BatchId) -> list[TokenizedData] | None:
        attempt = 0
        while True:
            try:
                async with self._lock:  # one request at a time, as upstream's mutex
                    return await self.provider.get_samples(batch_id)
            except Exception as e:
                if attempt >= FETCH_MAX_RETRIES:
                    logger.error(
                        "Data fetch failed for batch_id=%s after %d attempts: %s",
                        batch_id,
                        FETCH_MAX_RETRIES,
                        e,
                    )
                    return None
                attempt += 1
                delay = FETCH_BASE_DELAY_SECS * (attempt - 1)
                logger.warning(
                    "Data fetch error for batch_id=%s (attempt %d/%d): %s. Retrying in %.0f ms",
                    batch_id,
                    attempt,
                    FETCH_MAX_RETRIES,
                    e,
                    delay * 1000,
                )
                await trio.sleep(delay)


# --------------------------------------------------------------------------------------------
# Applying round N - 2


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
            continue
        if skip_for_cold_start(job.coordinator, payload.trainer_nonce):
            logger.info("Skipping apply of batch %s, trainer warming up", chosen.batch_id)
            continue
        results.append(payload.results)
        applied.append(chosen.batch_id)
    started = time.perf_counter()

    def optimize() -> None:
        trainer.optimize(plan.step, warmup_lr_between=job.warmup_lr_between, distro_results=results)
        _sync(trainer.model.device)

    await trio.to_thread.run_sync(optimize)
    job.round_state.downloads.clear()
    log_event(
        logger,
        "applied_results",
        quiet=True,
        client_id=str(job.identity),
        step=plan.step,
        batches=applied,
        apply_secs=round(time.perf_counter() - started, 4),
    )
    return applied


# --------------------------------------------------------------------------------------------
# Training


@dataclass(frozen=True)
class OwnResult:
    """This client's result for a batch, ready to announce (upstream `DistroBroadcastAndPayload`)."""

    step: int
    batch_id: BatchId
    commitment_data_hash: bytes
    proof: CommitteeProof
    payload: TransmittableDistroResult
    # Unquantized: what the next round's `generate` subtracts from the momentum.
    original: list[DistroResult]


@dataclass
class FinishedTraining:
    losses: list[float] = field(default_factory=list)
    optim_stats: dict[str, float] = field(default_factory=dict)
    duration: float = 0.0
    trained: list[BatchId] = field(default_factory=list)


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


def train_batch_exact(
    trainer: Trainer,
    step: int,
    batch: Batch,
    *,
    warmup_lr_between: tuple[int, int] | None,
    zero_optim: bool,
    prev_self_results: list[list[DistroResult]],
    cancel: threading.Event,
    timings: dict[str, float] | None = None,
) -> TrainOutput:
    """`Trainer.train`, with the DisTrO lookahead undone exactly.

    Upstream adds `sign(delta) * lr` back after subtracting it, which leaves each client's
    weights off by its own rounding error; here the weights are restored from a copy and the
    weight decay that `generate` applies is applied to the restored weights, in the same form.
    The transmitted results are unchanged (they depend on the momentum only), and every client
    keeps bit-identical weights.

    `timings`, if given, receives `generate` (DisTrO's compression, timed inside the call) so
    the forward/backward can be told apart from it.
    """
    import torch

    distro = trainer.distro
    if distro is None:
        return trainer.train(
            step,
            batch,
            warmup_lr_between=warmup_lr_between,
            zero_optim=zero_optim,
            prev_self_distro_results=None,
            cancel=cancel,
        )
    params = [p for _, p in trainer.model.variables()]
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
    if timings is not None:
        distro.generate = _timed(distro.generate, timings, "generate", trainer.model.device)  # type: ignore[method-assign]
    try:
        out = trainer.train(
            step,
            batch,
            warmup_lr_between=warmup_lr_between,
            zero_optim=zero_optim,
            prev_self_distro_results=prev_self_results,
            cancel=cancel,
        )
    finally:
        if timings is not None:
            del distro.generate  # back to the class's method
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
        if not out.cancelled and distro.weight_decay != 0.0:
            lr = trainer.get_lr(step, warmup_lr_between)
            for p in params:
                p.mul_(1.0 - lr * distro.weight_decay)
    return out


def _timed(
    fn: Callable[..., Any], timings: dict[str, float], key: str, device: Any
) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        _sync(device)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _sync(device)
            timings[key] = timings.get(key, 0.0) + time.perf_counter() - start

    return run


def _sync(device: Any) -> None:
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def prepare_result(
    trainer: Trainer,
    out: TrainOutput,
    *,
    step: int,
    batch_id: BatchId,
    quantize: bool,
) -> tuple[TransmittableDistroResult, bytes]:
    from psyche.modeling.serialized_distro import transmittable_distro_result

    results = out.distro_results or []
    sent = trainer.quantize_results(results) if quantize else results
    payload = transmittable_distro_result(sent, step, out.nonce, batch_id)
    return payload, payload.compute_hash()


def write_gradients(
    directory: Path, identity: NodeIdentity, payload: TransmittableDistroResult
) -> None:
    """`--write-gradients-dir`: this client's serialized results, as upstream names them."""
    from psyche.modeling.serialized_distro import distro_results_to_bytes

    directory.mkdir(parents=True, exist_ok=True)
    name = f"result-{identity}-step{payload.step}-batch{payload.batch_id}.vec-postcard"
    write_atomically(directory / name, distro_results_to_bytes(payload.distro_results))


@dataclass(frozen=True)
class TrainJob:
    step: int
    proof: CommitteeProof
    assigned_batches: list[BatchId]
    warmup_lr_between: tuple[int, int] | None
    zero_optim: bool
    prev_self_results: list[list[DistroResult]]
    quantize: bool
    identity: NodeIdentity
    write_gradients_dir: Path | None


async def run_round(
    handle: TrainingStep,
    trainer: Trainer,
    apply_job: ApplyJob | None,
    train_job: TrainJob | None,
    fetcher: DataFetcher | None,
    publish: Callable[[OwnResult], None],
) -> None:
    """The body of a training step: apply (if due), then train each assigned batch and publish
    its result. Stores the outcome in `handle`; never raises into the nursery."""
    start = time.monotonic()
    finished = FinishedTraining()
    try:
        incoming = None
        if train_job is not None and fetcher is not None and train_job.assigned_batches:
            incoming = fetcher.fetch(train_job.assigned_batches)
        if apply_job is not None:
            await apply_results(trainer, apply_job)
        if incoming is not None and train_job is not None:
            async with incoming:
                while (item := await handle.next_batch(incoming)) is not None:
                    batch_id, batch = item
                    await _train_one(handle, trainer, train_job, batch_id, batch, finished, publish)
        finished.duration = time.monotonic() - start
        handle.finished = True
        handle.complete(finished)
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
        lambda: train_batch_exact(
            trainer,
            job.step,
            batch,
            warmup_lr_between=job.warmup_lr_between,
            zero_optim=job.zero_optim,
            prev_self_results=job.prev_self_results,
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
    payload, commitment_hash = await trio.to_thread.run_sync(
        lambda: prepare_result(
            trainer, out, step=job.step, batch_id=batch_id, quantize=job.quantize
        )
    )
    serialize_secs = time.perf_counter() - serialize_start
    if job.write_gradients_dir is not None:
        try:
            await trio.to_thread.run_sync(
                write_gradients, job.write_gradients_dir, job.identity, payload
            )
        except OSError as e:
            logger.error("Failed to write gradients to disk: %s", e)
    loss = out.loss if math.isfinite(out.loss) else math.nan
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
            commitment_hash,
            job.proof,
            payload,
            out.distro_results or [],
        )
    )
