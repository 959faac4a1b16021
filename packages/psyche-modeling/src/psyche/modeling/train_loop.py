"""Training outside a run: one `Trainer` with AdamW, or N `Trainer` replicas exchanging DisTrO
results as simulated peers (what `psyche-train` runs, as upstream's `examples/train`).

With DisTrO the loop has upstream's timing: step N trains on weights updated through step N-2
(plus the lookahead), then applies the (optionally 1-bit) results of step N-1. With N replicas
the step's batch is split in N equal parts; each replica applies every replica's results, as
Psyche clients do, and keeps its own unquantized results for the momentum residual. The loop
reads batches through a callable, so where the data comes from is the caller's business.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from psyche.core.batch_id import BatchId
from psyche.modeling.trainer import Batch, Trainer

if TYPE_CHECKING:
    import torch

    from psyche.modeling.distro import DistroResult


@dataclass(frozen=True)
class StepReport:
    """One finished step."""

    step: int
    batch_id: BatchId
    loss: float
    """The mean of the replicas' losses."""
    duration: float
    """Seconds, reading the batch included."""


def rows(batch: Batch, start: int, end: int) -> Batch:
    """Rows `start..end` of `batch` (every field)."""

    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[start:end]

    return Batch(batch.input_ids[start:end], part(batch.labels), part(batch.position_ids))


def train_steps(
    trainers: Sequence[Trainer],
    read_batch: Callable[[BatchId], Batch],
    *,
    start_step: int,
    total_steps: int,
    total_batch: int,
    distro: bool,
    quantize: bool = False,
) -> Iterator[StepReport]:
    """Train steps `start_step..=total_steps`, yielding each step's report once every replica
    has applied its update. Step N trains on samples `(N-1)*total_batch ..= N*total_batch-1`
    (`read_batch` gives them), split evenly across `trainers`; with `distro` each replica then
    applies every replica's results of the step before (1-bit with `quantize`), else its own
    optimizer step. Every replica must start from the same weights; `total_batch` must be a
    multiple of their number."""
    prev: list[list[DistroResult]] | None = [] if distro else None
    for step in range(start_step, total_steps + 1):
        started = time.perf_counter()
        batch_id = BatchId((step - 1) * total_batch, step * total_batch - 1)
        batch = read_batch(batch_id)
        per_peer = len(batch) // len(trainers)
        outputs = []
        for i, trainer in enumerate(trainers):
            own_prev = None if prev is None else ([prev[i]] if prev else [])
            out = trainer.train(
                step,
                rows(batch, i * per_peer, (i + 1) * per_peer),
                prev_self_distro_results=own_prev,
            )
            outputs.append(out)
        for trainer in trainers:
            if prev is None:
                trainer.optimize(step)
            elif step > start_step:
                sent = [trainer.quantize_results(r) if quantize else r for r in prev]
                trainer.optimize(step, distro_results=sent)
        if prev is not None:
            prev = []
            for out in outputs:
                # A DisTrO trainer's step returns its results unless cancelled (nothing cancels).
                assert out.distro_results is not None, "distro=True needs DisTrO trainers"
                prev.append(out.distro_results)
        loss = sum(out.loss for out in outputs) / len(outputs)
        yield StepReport(step, batch_id, loss, time.perf_counter() - started)


__all__ = ["StepReport", "rows", "train_steps"]
