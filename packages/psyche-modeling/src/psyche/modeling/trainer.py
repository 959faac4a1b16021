"""One model replica's training step and optimizer step, as upstream's `LocalTrainer` does them.

`train` splits the batch into `ceil(B / micro_batch_size)` micro-batches with `torch.chunk`,
scales each micro-batch loss by that count, accumulates gradients (optionally in an fp32
buffer), clips and, with DisTrO, runs the lookahead before and `generate` after. `optimize`
applies aggregated DisTrO results (or steps AdamW on the last gradients).

Data parallelism across processes and tensor parallelism are not implemented here: one Trainer
is one model on one device. N DisTrO peers in one process are N Trainers (see `research`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from psyche.core.definitions import OptimizerDefinition
from psyche.modeling.adamw import LibtorchAdamW
from psyche.modeling.causal_lm import CausalLM
from psyche.modeling.distro import Distro, DistroResult, quantize_results
from psyche.modeling.lr import Schedule, get_lr, prev_lr

log = logging.getLogger(__name__)


class CancelToken(Protocol):
    def is_set(self) -> bool: ...


@dataclass
class Batch:
    """Token ids `[B, T]` (int64; any int tensor or nested list is accepted)."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    @classmethod
    def from_samples(
        cls,
        input_ids: Sequence[Sequence[int]],
        labels: Sequence[Sequence[int]] | None = None,
        position_ids: Sequence[Sequence[int]] | None = None,
    ) -> Batch:
        def as_tensor(rows: Sequence[Sequence[int]] | None) -> torch.Tensor | None:
            return None if rows is None else torch.tensor(rows, dtype=torch.int64)

        ids = as_tensor(input_ids)
        assert ids is not None
        return cls(ids, as_tensor(labels), as_tensor(position_ids))

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


class Trainer:
    """Trains one `CausalLM` with the optimizer of a run's `OptimizerDefinition`.

    `optimizer` is `psyche.core.definitions.OptimizerDefinition` (AdamW, Distro or Dummy);
    `lr_schedule` anything with `get_lr(step)` (e.g. `LearningRateSchedule`).
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
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError("micro_batch_size must be at least 1")
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
                self.quantize_1bit = value.quantize_1bit
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
    ) -> TrainOutput:
        """Forward/backward over `batch` and, with DisTrO, produce this step's results."""
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

        results = None
        if not cancelled and self.distro is not None:
            if self.clip_grad_norm is not None and self.clip_grad_norm > 0.0:
                self.model.clip_grad_norm(self.clip_grad_norm)
            stats = bool(
                self.optim_stats_every_n_steps and step % self.optim_stats_every_n_steps == 0
            )
            results = self.distro.generate(
                prev_self_distro_results or [], lookahead_lr, lr, stats=stats
            )
        nonce = self.nonce
        self.nonce += 1
        loss_value = float(loss_sum.item()) if loss_sum is not None else 0.0
        return TrainOutput(loss_value, results, cancelled, nonce, time.perf_counter() - start)

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

    @torch.no_grad()
    def _accumulate_fp32(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        assert self._fp32_grads is not None
        offset = 0
        for _, p in params:
            if not p.requires_grad:
                continue
            n = p.numel()
            if p.grad is not None:
                self._fp32_grads[offset : offset + n].add_(p.grad.float().reshape(-1))
                p.grad.zero_()
            offset += n

    @torch.no_grad()
    def _apply_fp32(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        assert self._fp32_grads is not None
        offset = 0
        for _, p in params:
            if not p.requires_grad:
                continue
            n = p.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(self._fp32_grads[offset : offset + n].to(p.dtype).view_as(p))
            offset += n
