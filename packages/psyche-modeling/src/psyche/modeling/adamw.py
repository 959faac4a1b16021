"""AdamW in libtorch's op order (the C++ optimizer upstream's trainer uses).

`torch.optim.AdamW` computes the same update in a different op order (it uses `lerp_` for the
first moment, for instance), so its bits differ; this keeps the upstream order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class LibtorchAdamW:
    """Decoupled-weight-decay Adam; `lr` is set on every `step` call, as the trainer does."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        betas: tuple[float, float],
        weight_decay: float,
        eps: float,
    ) -> None:
        self.params = [p for p in params]
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.weight_decay = float(weight_decay)
        self.eps = float(eps)
        self.steps: list[int] = [0] * len(self.params)
        self.exp_avg: list[torch.Tensor | None] = [None] * len(self.params)
        self.exp_avg_sq: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is None:
                continue
            if self.exp_avg[i] is None:
                self.exp_avg[i] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.exp_avg_sq[i] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avg, exp_avg_sq = self.exp_avg[i], self.exp_avg_sq[i]
            assert exp_avg is not None
            assert exp_avg_sq is not None
            self.steps[i] += 1
            t = self.steps[i]
            if self.weight_decay != 0.0:
                p.mul_(1.0 - lr * self.weight_decay)
            exp_avg.mul_(self.beta1).add_(grad, alpha=1.0 - self.beta1)
            exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1.0 - self.beta2)
            bias_correction1 = 1.0 - self.beta1**t
            bias_correction2 = 1.0 - self.beta2**t
            denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
            p.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))

    def zero_grad(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()
