"""One model replica's training step and optimizer step, as upstream's `LocalTrainer` does them.

`train` splits the batch into `ceil(B / micro_batch_size)` micro-batches with `torch.chunk`,
scales each micro-batch loss by that count, accumulates gradients (optionally in an fp32
buffer), clips and, with DisTrO, runs the lookahead before and `generate` after. `optimize`
applies aggregated DisTrO results (or steps AdamW on the last gradients). `train_exact` is
`train` with the lookahead undone exactly (what keeps Psyche clients bit-identical) and
`prepare_result` turns a step's results into the payload a client publishes.

The trainer owns a `ParallelDims` (`psyche.modeling.parallel`): the layout of the model over the
client's devices. With several ranks each process has a Trainer for its rank: it trains its rows
of the batch, the gradients are averaged (or reduce-scattered by FSDP2) before DisTrO, and
DisTrO works on the full tensors (`psyche.modeling.sharding`); `psyche.modeling.distributed`
runs the ranks together. N DisTrO peers in one process are N Trainers (see `research`,
`train_loop`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import OptimizerDefinition
from psyche.modeling.adamw import LibtorchAdamW
from psyche.modeling.causal_lm import CausalLM
from psyche.modeling.diloco.codec import entry_bound as diloco_entry_bound
from psyche.modeling.diloco.optimizer import Diloco, inner_ranges
from psyche.modeling.distro import Distro, DistroResult, ResultLayout, quantize_results
from psyche.modeling.lr import Schedule, get_lr, prev_lr
from psyche.modeling.parallel import ParallelDims
from psyche.modeling.screening import Reference, ResultReader
from psyche.modeling.serialized_distro import (
    TransmittableDistroResult,
    distro_entry_bound,
    distro_results_from_transmittable,
    payload_size_bound,
    transmittable_distro_result,
)
from psyche.modeling.sharding import full_tensor, local_tensor, settle_gradients

log = logging.getLogger(__name__)


class CancelToken(Protocol):
    def is_set(self) -> bool: ...


class Sample(Protocol):
    """One training sample as a data provider gives it (`TokenizedData`): token ids, and
    optionally labels and position ids of the same length."""

    input_ids: np.ndarray
    labels: np.ndarray | None
    position_ids: np.ndarray | None


def _int64_rows(rows: Sequence[np.ndarray]) -> torch.Tensor:
    lengths = {len(r) for r in rows}
    if len(lengths) != 1:
        raise ValueError(f"samples of different lengths {sorted(lengths)} cannot be batched")
    return torch.from_numpy(np.stack(rows).astype(np.int64))


@dataclass
class Batch:
    """Token ids `[B, T]` (int64; any int tensor is accepted), optional labels and position ids."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    @classmethod
    def from_samples(cls, samples: Sequence[Sample]) -> Batch:
        """The samples stacked as int64 rows (they must be equally long); labels and position
        ids only when every sample has them."""
        if not samples:
            raise ValueError("empty batch")
        labels = [s.labels for s in samples if s.labels is not None]
        positions = [s.position_ids for s in samples if s.position_ids is not None]
        return cls(
            _int64_rows([s.input_ids for s in samples]),
            _int64_rows(labels) if len(labels) == len(samples) else None,
            _int64_rows(positions) if len(positions) == len(samples) else None,
        )

    @classmethod
    def from_rows(cls, input_ids: np.ndarray) -> Batch:
        """A `[B, T]` array of token ids (any integer type) as a batch of int64 rows."""
        return cls(torch.from_numpy(np.asarray(input_ids).astype(np.int64)))

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class TrainOutput:
    loss: float
    distro_results: list[DistroResult] | None
    cancelled: bool
    nonce: int
    duration: float


class TrainerError(RuntimeError):
    pass


@dataclass(frozen=True)
class PreparedResult:
    """A trained batch's DisTrO results as a client publishes them (upstream
    `DistroBroadcastAndPayload` without the proof)."""

    payload: TransmittableDistroResult
    """The wire form."""
    commitment_hash: bytes
    """`payload.compute_hash()`: what the client signs and its peers check the payload against."""
    sent: list[DistroResult]
    """The tensors the payload carries (1-bit values when the run quantizes): what every peer,
    this client included, applies."""


# A trainer's own optimizer state: what its payloads depend on beyond the run's weights, its batch
# and the run's settings, which no other client holds (`Trainer.swap_own_state`): DisTrO's
# momentum; DiLoCo's error-feedback residual, its last measured pseudo-gradient and round (the
# lookahead's input) and its inner AdamW state; and the witness reference each keeps. DiLoCo's
# outer momentum is the run's (every client's the same bits) and is not in it.
_OWN_STATE: tuple[tuple[str, str], ...] = (
    ("distro", "deltas"),
    ("distro", "encoded"),
    ("diloco", "residuals"),
    ("diloco", "_own_update"),
    ("diloco", "_own_round"),
    ("diloco", "encoded"),
    ("adamw", "steps"),
    ("adamw", "exp_avg"),
    ("adamw", "exp_avg_sq"),
)


@dataclass
class OwnState:
    """One trainer's own optimizer state (`_OWN_STATE`), held outside its `Trainer`: a
    verifier's shadow of a trainer it follows (`psyche.modeling.verification.Shadow`).
    `values` maps `(component, attribute)` to the value; only the run optimizer's components."""

    values: dict[tuple[str, str], Any]


class Trainer:
    """Trains one `CausalLM` with the optimizer of a run's `OptimizerDefinition`.

    `optimizer` is `psyche.core.definitions.OptimizerDefinition` (AdamW, Distro or Dummy);
    `lr_schedule` anything with `get_lr(step)` (e.g. `LearningRateSchedule`); `parallel` the
    model's layout over the client's devices (default: the model's one device).
    """

    def __init__(
        self,
        model: CausalLM,
        lr_schedule: Schedule,
        optimizer: OptimizerDefinition,
        micro_batch_size: int,
        *,
        optim_stats_every_n_steps: int | None = None,
        grad_accum_in_fp32: bool = False,
        parallel: ParallelDims | None = None,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError("micro_batch_size must be at least 1")
        self.parallel = parallel or ParallelDims(model.device)
        self.parallel.check_optimizer(optimizer)
        self.parallel.require_world()
        self.parallel.check_device(model.device)
        self.parallel.check_model(model.config)
        self.model = model
        self.lr_schedule = lr_schedule
        self.micro_batch_size = micro_batch_size
        self.optim_stats_every_n_steps = optim_stats_every_n_steps
        self.grad_accum_in_fp32 = grad_accum_in_fp32
        self.nonce = 0
        self._fp32_grads: torch.Tensor | None = None
        self.distro: Distro | None = None
        self.adamw: LibtorchAdamW | None = None
        self.clip_grad_norm: float | None = None
        self.quantize_1bit = False
        self.diloco: Diloco | None = None
        self._distro_layouts: list[ResultLayout] | None = None
        self._max_payload_size: int | None = None
        self._screening_reader: ResultReader | None = None
        self._setup_optimizer(optimizer)

    def _setup_optimizer(self, optimizer: OptimizerDefinition) -> None:
        match optimizer:
            case OptimizerDefinition.Dummy():
                return
            case OptimizerDefinition.AdamW(value):
                self.adamw = LibtorchAdamW(
                    (p for _, p in self.model.variables()),
                    betas=(value.betas[0], value.betas[1]),
                    weight_decay=value.weight_decay,
                    eps=value.eps,
                )
                self.clip_grad_norm = value.clip_grad_norm
            case OptimizerDefinition.Distro(value) | OptimizerDefinition.DistroSparse(value):
                # the route is the run's (its optimizer's variant), so every client takes it
                sparse = isinstance(optimizer, OptimizerDefinition.DistroSparse)
                self.distro = Distro.from_definition(self.model.variables(), value, sparse=sparse)
                self.clip_grad_norm = value.clip_grad_norm
                self.quantize_1bit = bool(value.quantize_1bit)
            case OptimizerDefinition.DiLoCo(value):
                # the inner optimizer is `adamw`; `optimize` takes DiLoCo's outer step
                schedule = getattr(self.lr_schedule, "value", self.lr_schedule)
                self.diloco = Diloco.from_definition(
                    self.model.variables(), value, base_lr=getattr(schedule, "base_lr", None)
                )
                self.adamw = LibtorchAdamW(
                    self.diloco.params,
                    betas=self.diloco.settings.inner_betas,
                    weight_decay=value.inner_weight_decay,
                    eps=self.diloco.settings.inner_eps,
                )
                self.clip_grad_norm = value.inner_clip_grad_norm or None
            case _:
                raise TypeError(f"expected an OptimizerDefinition, got {optimizer!r}")

    # ----------------------------------------------------------------------------------------

    def get_lr(self, step: int, warmup_lr_between: tuple[int, int] | None = None) -> float:
        return get_lr(self.lr_schedule, step, warmup_lr_between)

    @staticmethod
    def quantize_results(results: Sequence[DistroResult]) -> list[DistroResult]:
        return quantize_results(results)

    def train(
        self,
        step: int,
        batch: Batch,
        *,
        warmup_lr_between: tuple[int, int] | None = None,
        zero_optim: bool = False,
        prev_self_distro_results: Sequence[Sequence[DistroResult]] | None = None,
        cancel: CancelToken | None = None,
        timings: MutableMapping[str, float] | None = None,
    ) -> TrainOutput:
        """Forward/backward over `batch` and, with DisTrO, produce this step's results.

        `timings`, if given, receives `generate`: the seconds DisTrO's compression took (the
        device synchronized around it), so the forward/backward can be told apart from it."""
        start = time.perf_counter()
        if self.distro is not None and prev_self_distro_results is None:
            raise TrainerError("DisTrO training needs the previous results (possibly empty)")
        if len(batch) == 0:
            raise TrainerError("empty batch")
        lr = self.get_lr(step, warmup_lr_between)
        lookahead_lr = prev_lr(self.lr_schedule, step, warmup_lr_between)
        if self.distro is not None:
            if zero_optim:
                self.distro.zero_optim()
            self.distro.error_correction(lookahead_lr)
        elif zero_optim and self.adamw is not None:
            log.warning("zeroing optimizer state is not supported for AdamW")
        loss_value, cancelled = self.accumulate_gradients(batch, cancel=cancel)

        results = None
        if not cancelled and self.distro is not None:
            if self.clip_grad_norm is not None and self.clip_grad_norm > 0.0:
                self.model.clip_grad_norm(self.clip_grad_norm)
            stats = bool(
                self.optim_stats_every_n_steps and step % self.optim_stats_every_n_steps == 0
            )
            if timings is not None:
                self.parallel.synchronize()
                generate_start = time.perf_counter()
            results = self.distro.generate(
                prev_self_distro_results or [], lookahead_lr, lr, stats=stats
            )
            if timings is not None:
                self.parallel.synchronize()
                elapsed = time.perf_counter() - generate_start
                timings["generate"] = timings.get("generate", 0.0) + elapsed
        nonce = self.nonce
        self.nonce += 1
        return TrainOutput(loss_value, results, cancelled, nonce, time.perf_counter() - start)

    def accumulate_gradients(
        self, batch: Batch, *, cancel: CancelToken | None = None
    ) -> tuple[float, bool]:
        """The batch's gradients in the parameters' `.grad` (zeroed first), as `train` takes
        them: micro-batches, the loss scale, the fp32 buffer, the ranks' reduction (not the
        clipping). Returns (the loss, reduced over the ranks; whether `cancel` stopped it).
        A verifier's recompute (`psyche.modeling.verification`) is this same code."""
        if len(batch) == 0:
            raise TrainerError("empty batch")
        micro_batches = self._micro_batches(batch)
        loss_scale = self.parallel.loss_scale(len(batch), self.micro_batch_size)
        steps = len(micro_batches)
        params = self.model.variables()
        for _, p in params:
            if p.grad is not None:
                p.grad.zero_()
        use_fp32_accum = self.grad_accum_in_fp32 and steps != 1
        if use_fp32_accum:
            self._zero_fp32_buffer(params)

        loss_sum: torch.Tensor | None = None
        cancelled = False
        for ids, lab, pos, weight in micro_batches:
            # every rank stops at the same micro-batch (only the leader sees `cancel`)
            if self.parallel.agree(cancel is not None and cancel.is_set()):
                cancelled = True
                break
            # index, not unpack: the logits must not outlive this micro-batch
            loss = self.model.forward(ids, labels=lab, position_ids=pos, loss_scale=loss_scale)[1]
            if loss is None:
                raise TrainerError("the model returned no loss")
            if weight == 0.0:
                loss = loss * 0.0
            loss.backward()
            loss = loss.detach()
            if bool(torch.isfinite(loss)):
                loss_sum = loss if loss_sum is None else loss_sum + loss
            if use_fp32_accum:
                self._accumulate_fp32(params)
        if use_fp32_accum:
            self._apply_fp32(params)
        loss_value = float(loss_sum.item()) if loss_sum is not None else 0.0
        if not cancelled:
            settle_gradients(p for _, p in params)
            self.parallel.reduce_gradients(p.grad for _, p in params if p.grad is not None)
            loss_value = self.parallel.reduce_loss(loss_value)
        return loss_value, cancelled

    def _micro_batches(
        self, batch: Batch
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]]:
        """This rank's micro-batches of `batch` as `(ids, labels, position_ids, weight)`.

        One rank: `torch.chunk` into `ceil(B / micro_batch_size)` (upstream). Several DP ranks:
        each takes its rows (`ParallelDims.local_rows`) and chunks them into the micro-batch
        count of the rank with the most rows; a rank left with fewer chunks runs zero-weight
        micro-batches (a row of the batch, loss times 0) so that the collectives inside every
        forward and backward pair up across ranks. The losses are divided by
        `ParallelDims.loss_scale` (the micro-batch count with one rank)."""
        device = self.model.device
        input_ids = batch.input_ids.to(device=device, dtype=torch.int64)
        labels = input_ids.clone() if batch.labels is None else batch.labels.to(device)
        position_ids = None if batch.position_ids is None else batch.position_ids.to(device)
        steps = self.parallel.micro_batches(len(batch), self.micro_batch_size)
        start, rows = self.parallel.local_rows(len(batch))

        def split(t: torch.Tensor) -> list[torch.Tensor]:
            return list(torch.chunk(t.narrow(0, start, rows), steps, 0)) if rows else []

        ids, labs = split(input_ids), split(labels)
        pos: list[torch.Tensor | None] = (
            [None] * steps if position_ids is None else list(split(position_ids))
        )
        if self.parallel.dp == 1 and len(ids) != steps:
            raise TrainerError(f"batch of {len(batch)} does not split into {steps} micro-batches")
        out = [(i, la, p, 1.0) for i, la, p in zip(ids, labs, pos)]
        while len(out) < steps:
            pad = None if position_ids is None else position_ids[:1]
            out.append((input_ids[:1], labels[:1], pad, 0.0))
        return out

    def train_exact(
        self,
        step: int,
        batch: Batch,
        *,
        warmup_lr_between: tuple[int, int] | None,
        zero_optim: bool,
        prev_self_distro_results: Sequence[Sequence[DistroResult]],
        cancel: CancelToken | None = None,
        timings: MutableMapping[str, float] | None = None,
    ) -> TrainOutput:
        """`train`, with the DisTrO lookahead undone exactly.

        Upstream adds `sign(delta) * lr` back after subtracting it, which leaves each client's
        weights off by its own rounding error; here the weights are restored from a copy, so
        they are exactly those the step trained from. The weight decay `generate` applies is
        undone with them: it is the step's, not the batch's, and `decay_weights` applies it once
        per step on every client. The results are unchanged (they depend on the momentum only),
        and every client keeps bit-identical weights. Without DisTrO this is `train`; with
        DiLoCo it is the round's inner steps (`_train_diloco`).
        """
        if self.diloco is not None:
            return self._train_diloco(step, batch, warmup_lr_between, cancel)
        distro = self.distro
        if distro is None:
            return self.train(
                step,
                batch,
                warmup_lr_between=warmup_lr_between,
                zero_optim=zero_optim,
                prev_self_distro_results=None,
                cancel=cancel,
                timings=timings,
            )
        params = [p for _, p in self.model.variables()]
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
        out = self.train(
            step,
            batch,
            warmup_lr_between=warmup_lr_between,
            zero_optim=zero_optim,
            prev_self_distro_results=prev_self_distro_results,
            cancel=cancel,
            timings=timings,
        )
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        return out

    def fresh_own_state(self) -> OwnState:
        """The own state of a trainer that has trained nothing yet (a client's at its first
        round in the run): DisTrO's momentum zero, no DiLoCo residual, no pending own update,
        a fresh inner AdamW; what `Distro` and `Diloco` start from."""
        values: dict[tuple[str, str], Any] = {}
        for component, name in _OWN_STATE:
            owner = getattr(self, component)
            if owner is None:
                continue
            value: Any = None
            if (component, name) == ("distro", "deltas"):
                with torch.no_grad():
                    value = [torch.zeros_like(p) for _, p in owner.variables]
            elif component == "adamw":
                value = [0] * len(owner.params) if name == "steps" else [None] * len(owner.params)
            values[(component, name)] = value
        return OwnState(values)

    def swap_own_state(self, state: OwnState) -> None:
        """Exchange this trainer's own optimizer state with `state` (references, no copy):
        after it the trainer trains, prepares and keeps feedback as the owner of `state` would;
        twice puts both back. `state` must be this run's (`fresh_own_state`, or one swapped out
        of a trainer of the same run): every key is checked before anything is swapped, so a
        state of another optimizer raises `TrainerError` and leaves both untouched."""
        for component, name in state.values:
            if getattr(self, component) is None:
                raise TrainerError(f"the state holds {component}.{name}; this trainer has none")
        for (component, name), value in state.values.items():
            owner = getattr(self, component)
            state.values[(component, name)] = getattr(owner, name)
            setattr(owner, name, value)

    def decay_weights(self, step: int, *, warmup_lr_between: tuple[int, int] | None) -> None:
        """DisTrO's weight decay of `step` (`p *= 1 - lr * weight_decay`, `generate`'s op), for
        the exact route (`train_exact`): once per step, after the step's training, on every
        client of the round, whether it trained one batch, several, none (a verifier, a client
        without an assignment) or was cancelled. The decay is a function of the step and the
        weights only, so every honest client keeps the same bits. A no-op without DisTrO or at
        weight decay 0 (DiLoCo's inner decay stays inside its inner steps; its outer step has
        none)."""
        distro = self.distro
        if distro is None or distro.weight_decay == 0.0:
            return
        lr = self.get_lr(step, warmup_lr_between)
        with torch.no_grad():
            for _, p in self.model.variables():
                p.mul_(1.0 - lr * distro.weight_decay)

    def _train_diloco(
        self,
        step: int,
        batch: Batch,
        warmup_lr_between: tuple[int, int] | None,
        cancel: CancelToken | None,
    ) -> TrainOutput:
        """A DiLoCo round: the batch split into `inner_steps` contiguous parts
        (`diloco.inner_ranges`), an inner AdamW step (lr: the schedule at `step`) on each, then
        the pseudo-gradient in its sent form as the results; the weights are the round's again
        afterwards. One nonce per round."""
        diloco, inner = self.diloco, self.adamw
        assert diloco is not None
        assert inner is not None
        if len(batch) == 0:
            raise TrainerError("empty batch")
        start = time.perf_counter()
        nonce = self.nonce
        lr = self.get_lr(step, warmup_lr_between)
        # round `step - 1`'s own payload is still to be applied: start from the lookahead
        diloco.begin_round(step, lookahead_lr=diloco.outer_lr(lr))
        losses = self.inner_steps(batch, inner, lr, cancel=cancel)
        if losses is None:
            diloco.abort_round()
            self.nonce = nonce + 1
            return TrainOutput(0.0, None, True, nonce, time.perf_counter() - start)
        results = diloco.end_round(step)
        self.nonce = nonce + 1
        loss = sum(losses) / len(losses)
        return TrainOutput(loss, results, False, nonce, time.perf_counter() - start)

    def inner_steps(
        self,
        batch: Batch,
        inner: LibtorchAdamW,
        lr: float,
        *,
        cancel: CancelToken | None = None,
    ) -> list[float] | None:
        """A DiLoCo round's inner steps on `batch` with `inner` (the trainer's own inner AdamW,
        or a verifier's fresh one: `psyche.modeling.verification`): each part of
        `diloco.inner_ranges` accumulated, clipped and stepped at `lr`. Returns each part's loss;
        None when `cancel` stopped it (the gradients zeroed, the weights left as they are)."""
        diloco = self.diloco
        assert diloco is not None
        losses = []
        for a, b in inner_ranges(len(batch), diloco.settings.inner_steps):
            part = Batch(
                batch.input_ids[a:b],
                None if batch.labels is None else batch.labels[a:b],
                None if batch.position_ids is None else batch.position_ids[a:b],
            )
            loss, cancelled = self.accumulate_gradients(part, cancel=cancel)
            if cancelled:
                inner.zero_grad()
                return None
            if self.clip_grad_norm is not None and self.clip_grad_norm > 0.0:
                self.model.clip_grad_norm(self.clip_grad_norm)
            inner.step(lr)
            inner.zero_grad()
            losses.append(loss)
        return losses

    def start_epoch(self) -> None:
        """An epoch's first apply is next: DiLoCo's outer momentum restarts from zero on every
        client (so a client that joined at this epoch start holds the same state)."""
        if self.diloco is not None:
            self.diloco.reset_outer_state()

    def results_from_payload(self, payload: TransmittableDistroResult) -> list[DistroResult]:
        """A peer's payload checked against this model and run (raises `InvalidDistroResult`
        with the reason), then as tensors."""
        if self.diloco is not None:
            return self.diloco.results_from_transmittable(payload)
        if self.distro is None:
            return distro_results_from_transmittable(payload, [])
        if self._distro_layouts is None:
            self._distro_layouts = self.distro.layouts()
        return distro_results_from_transmittable(
            payload, self._distro_layouts, require_1bit=self.quantize_1bit
        )

    def max_payload_size(self) -> int:
        """The size in bytes of the largest payload `results_from_payload` accepts (this
        model's layouts under the run's DisTrO or DiLoCo settings; no DisTrO: an empty one):
        a peer's result ticket announcing more is refused before it is downloaded."""
        if self._max_payload_size is None:
            self._max_payload_size = self._payload_size_bound()
        return self._max_payload_size

    def _payload_size_bound(self) -> int:
        if self.diloco is not None:
            entries = [diloco_entry_bound(layout) for layout in self.diloco.layouts()]
        elif self.distro is None:
            entries = []
        else:
            if self._distro_layouts is None:
                self._distro_layouts = self.distro.layouts()
            require_1bit = self.quantize_1bit
            entries = [
                distro_entry_bound(layout, require_1bit=require_1bit)
                for layout in self._distro_layouts
            ]
        return payload_size_bound(entries)

    def prepare_result(self, out: TrainOutput, *, step: int, batch_id: BatchId) -> PreparedResult:
        """The payload of a trained batch: its results, 1-bit when the run's DisTrO quantizes
        (none without DisTrO), serialized and hashed for the commitment."""
        results = out.distro_results or []
        sent = self.quantize_results(results) if self.quantize_1bit else list(results)
        payload = transmittable_distro_result(sent, step, out.nonce, batch_id)
        return PreparedResult(payload, payload.compute_hash(), sent)

    def screening_reader(self) -> ResultReader | None:
        """How this run's results read for a witness's checks (None when the optimizer sends
        none); turns on keeping the reference `screening_reference` reads. Only the leader of a
        several-rank client needs it (the reference is the full momentum, on every rank)."""
        optimizer: Distro | Diloco | None = self.distro or self.diloco
        if optimizer is None:
            return None
        optimizer.keep_encoded = True
        if self._screening_reader is None:
            self._screening_reader = ResultReader.of(optimizer)
        return self._screening_reader

    def screening_reference(self) -> Reference | None:
        """This client's own update of the batch it just trained (no copy), a witness's
        reference for the round's other results (`psyche.modeling.screening`); None when not
        screening or when the last step produced nothing."""
        reader = self._screening_reader
        optimizer: Distro | Diloco | None = self.distro or self.diloco
        if reader is None or optimizer is None:
            return None
        try:
            return reader.reference(optimizer)
        except ValueError:
            return None

    def synchronize(self) -> None:
        """Wait until the device has done the work queued so far (a no-op on the CPU)."""
        self.parallel.synchronize()

    def optimize(
        self,
        step: int,
        *,
        warmup_lr_between: tuple[int, int] | None = None,
        distro_results: Sequence[Sequence[DistroResult]] | None = None,
    ) -> None:
        """Apply a round: DisTrO applies `distro_results`, DiLoCo takes its outer step on them;
        AdamW steps on the current grads."""
        lr = self.get_lr(step, warmup_lr_between)
        if self.diloco is not None:
            if distro_results is None:
                raise TrainerError("DiLoCo optimize needs a result list (possibly empty)")
            self.diloco.apply(distro_results, self.diloco.outer_lr(lr))
        elif self.adamw is not None:
            if self.clip_grad_norm is not None and self.clip_grad_norm > 0.0:
                self.model.clip_grad_norm(self.clip_grad_norm)
            self.adamw.step(lr)
            self.adamw.zero_grad()
        elif self.distro is not None:
            if distro_results is None:
                raise TrainerError("DisTrO optimize needs a result list (possibly empty)")
            self.distro.apply(distro_results, lr)

    def extract(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """CPU copies of the whole state dict (sharded tensors gathered: on every rank)."""
        return self.model.extract(dtype)

    def full_variables(self) -> dict[str, torch.Tensor]:
        """The parameters by name as whole tensors (sharded ones gathered: every rank calls
        it); what the live model hash covers."""
        return {name: full_tensor(p) for name, p in self.model.variables()}

    def truncate_bf16(self) -> None:
        self.model.truncate_bf16()

    # -- fp32 gradient accumulation -------------------------------------------------------

    def _zero_fp32_buffer(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        if self._fp32_grads is None:
            total = sum(local_tensor(p).numel() for _, p in params if p.requires_grad)
            self._fp32_grads = torch.zeros(total, dtype=torch.float32, device=self.model.device)
        else:
            self._fp32_grads.zero_()

    def _fp32_slices(
        self, params: list[tuple[str, torch.nn.Parameter]]
    ) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Each trainable parameter with its slice of the fp32 buffer."""
        assert self._fp32_grads is not None
        offset = 0
        for _, p in params:
            if p.requires_grad:
                n = local_tensor(p).numel()
                yield p, self._fp32_grads[offset : offset + n]
                offset += n

    @torch.no_grad()
    def _accumulate_fp32(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        for p, buffer in self._fp32_slices(params):
            if p.grad is not None:
                buffer.add_(local_tensor(p.grad).float().reshape(-1))
                p.grad.zero_()

    @torch.no_grad()
    def _apply_fp32(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        for p, buffer in self._fp32_slices(params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local_tensor(p.grad).copy_(buffer.to(p.dtype).view_as(local_tensor(p)))
