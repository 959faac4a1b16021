"""One model replica's training step and optimizer step, as upstream's `LocalTrainer` does them.

`train` splits the batch into `ceil(B / micro_batch_size)` micro-batches with `torch.chunk`,
scales each micro-batch loss by that count, accumulates gradients (optionally in an fp32
buffer), clips and, with DisTrO, runs the lookahead before and `generate` after. `optimize`
applies aggregated DisTrO results (or steps AdamW on the last gradients). `train_exact` is
`train` with the lookahead undone exactly (what keeps Psyche clients bit-identical) and
`prepare_result` turns a step's results into the payload a client publishes.

The trainer owns a `ParallelDims` (`psyche.modeling.parallel`): the layout of the model over the
client's devices, where data and tensor parallelism inside a client go. One device is built
today. N DisTrO peers in one process are N Trainers (see `research`, `train_loop`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import OptimizerDefinition
from psyche.modeling.adamw import LibtorchAdamW
from psyche.modeling.causal_lm import CausalLM
from psyche.modeling.distro import Distro, DistroResult, quantize_results
from psyche.modeling.lr import Schedule, get_lr, prev_lr
from psyche.modeling.parallel import ParallelDims
from psyche.modeling.serialized_distro import (
    TransmittableDistroResult,
    transmittable_distro_result,
)

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
        labels = [s.labels for s in samples]
        positions = [s.position_ids for s in samples]
        return cls(
            _int64_rows([s.input_ids for s in samples]),
            None if any(x is None for x in labels) else _int64_rows(labels),  # type: ignore[arg-type]
            None if any(x is None for x in positions) else _int64_rows(positions),  # type: ignore[arg-type]
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
        self.parallel.require_single_device()
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
            case OptimizerDefinition.Distro(value):
                self.distro = Distro.from_definition(self.model.variables(), value)
                self.clip_grad_norm = value.clip_grad_norm
                self.quantize_1bit = bool(value.quantize_1bit)
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
        device = self.model.device
        steps = math.ceil(len(batch) / self.micro_batch_size)
        input_ids = batch.input_ids.to(device=device, dtype=torch.int64)
        labels = input_ids.clone() if batch.labels is None else batch.labels.to(device)
        position_ids = None if batch.position_ids is None else batch.position_ids.to(device)
        chunks_ids = torch.chunk(input_ids, steps, 0)
        chunks_labels = torch.chunk(labels, steps, 0)
        chunks_pos = (
            torch.chunk(position_ids, steps, 0) if position_ids is not None else [None] * steps
        )
        if len(chunks_ids) != steps:
            raise TrainerError(f"batch of {len(batch)} does not split into {steps} micro-batches")

        lr = self.get_lr(step, warmup_lr_between)
        lookahead_lr = prev_lr(self.lr_schedule, step, warmup_lr_between)

        params = self.model.variables()
        for _, p in params:
            if p.grad is not None:
                p.grad.zero_()
        if self.distro is not None:
            if zero_optim:
                self.distro.zero_optim()
            self.distro.error_correction(lookahead_lr)
        elif zero_optim and self.adamw is not None:
            log.warning("zeroing optimizer state is not supported for AdamW")
        use_fp32_accum = self.grad_accum_in_fp32 and steps != 1
        if use_fp32_accum:
            self._zero_fp32_buffer(params)

        loss_sum: torch.Tensor | None = None
        cancelled = False
        for ids, lab, pos in zip(chunks_ids, chunks_labels, chunks_pos):
            if cancel is not None and cancel.is_set():
                cancelled = True
                break
            # index, not unpack: the logits must not outlive this micro-batch
            loss = self.model.forward(ids, labels=lab, position_ids=pos, loss_scale=steps)[1]
            if loss is None:
                raise TrainerError("the model returned no loss")
            loss.backward()
            loss = loss.detach()
            if bool(torch.isfinite(loss)):
                loss_sum = loss if loss_sum is None else loss_sum + loss
            if use_fp32_accum:
                self._accumulate_fp32(params)
        if use_fp32_accum:
            self._apply_fp32(params)
        if not cancelled:
            self.parallel.reduce_gradients(p.grad for _, p in params if p.grad is not None)

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
        loss_value = float(loss_sum.item()) if loss_sum is not None else 0.0
        return TrainOutput(loss_value, results, cancelled, nonce, time.perf_counter() - start)

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
        weights off by its own rounding error; here the weights are restored from a copy and the
        weight decay that `generate` applies is applied to the restored weights, in the same
        form. The results are unchanged (they depend on the momentum only), and every client
        keeps bit-identical weights. Without DisTrO this is `train`.
        """
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
            if not out.cancelled and distro.weight_decay != 0.0:
                lr = self.get_lr(step, warmup_lr_between)
                for p in params:
                    p.mul_(1.0 - lr * distro.weight_decay)
        return out

    def prepare_result(self, out: TrainOutput, *, step: int, batch_id: BatchId) -> PreparedResult:
        """The payload of a trained batch: its results, 1-bit when the run's DisTrO quantizes
        (none without DisTrO), serialized and hashed for the commitment."""
        results = out.distro_results or []
        sent = self.quantize_results(results) if self.quantize_1bit else list(results)
        payload = transmittable_distro_result(sent, step, out.nonce, batch_id)
        return PreparedResult(payload, payload.compute_hash(), sent)

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
        """Apply a round: DisTrO applies `distro_results`; AdamW steps on the current grads."""
        lr = self.get_lr(step, warmup_lr_between)
        if self.adamw is not None:
            if self.clip_grad_norm is not None and self.clip_grad_norm > 0.0:
                self.model.clip_grad_norm(self.clip_grad_norm)
            self.adamw.step(lr)
            self.adamw.zero_grad()
        elif self.distro is not None:
            if distro_results is None:
                raise TrainerError("DisTrO optimize needs a result list (possibly empty)")
            self.distro.apply(distro_results, lr)

    def extract(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return self.model.extract(dtype)

    def truncate_bf16(self) -> None:
        self.model.truncate_bf16()

    # -- fp32 gradient accumulation -------------------------------------------------------

    def _zero_fp32_buffer(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        if self._fp32_grads is None:
            total = sum(p.numel() for _, p in params if p.requires_grad)
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
                n = p.numel()
                yield p, self._fp32_grads[offset : offset + n]
                offset += n

    @torch.no_grad()
    def _accumulate_fp32(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        for p, buffer in self._fp32_slices(params):
            if p.grad is not None:
                buffer.add_(p.grad.float().reshape(-1))
                p.grad.zero_()

    @torch.no_grad()
    def _apply_fp32(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        for p, buffer in self._fp32_slices(params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(buffer.to(p.dtype).view_as(p))
