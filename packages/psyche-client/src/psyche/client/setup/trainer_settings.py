"""How the client's trainer trains besides its model and optimizer (`--micro-batch-size`,
`--grad-accum-in-fp32`, `--optim-stats-steps`; upstream `RunInitConfig`'s fields of the same
names): the settings `TrainOptions` composes, `init.RunInitConfig` carries and each rank of a
`workers.WorkerGroup` receives (picklable), and the one way a trainer is built from them.

This module imports nothing heavy (`TrainOptions` composes it, and `--help` must stay fast).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psyche.modeling.causal_lm import CausalLM
    from psyche.modeling.parallel import ParallelDims
    from psyche.modeling.trainer import Trainer


@dataclass(frozen=True)
class TrainerSettings:
    micro_batch_size: int = 1
    grad_accum_in_fp32: bool = False
    optim_stats_every_n_steps: int | None = None

    def build(
        self,
        cls: type[Trainer],
        model: CausalLM,
        lr_schedule: Any,
        optimizer: Any,
        parallel: ParallelDims | None = None,
    ) -> Trainer:
        """A `cls` trainer of `model` with these settings: how a one-rank client and each rank
        of a `workers.WorkerGroup` build theirs."""
        return cls(
            model,
            lr_schedule,
            optimizer,
            self.micro_batch_size,
            optim_stats_every_n_steps=self.optim_stats_every_n_steps,
            grad_accum_in_fp32=self.grad_accum_in_fp32,
            parallel=parallel,
        )


__all__ = ["TrainerSettings"]
