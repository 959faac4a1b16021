"""How one client's model is laid out over its devices (torchtitan's `distributed.ParallelDims`).

A Psyche client is one member of a run whatever its hardware: upstream splits a client's work
over data-parallel (DP) trainers and tensor-parallel (TP) ranks (`--data-parallelism`,
`--tensor-parallelism`; `shared/modeling/src/parallelism.rs`). `ParallelDims` holds those
degrees and this rank's device, checks them against the model with errors that say what to
change, and is where the trainer asks about the layout:

* `reduce_gradients`, after the backward pass and before clipping and DisTrO: with DP every
  rank's gradients become their mean, computed in fp32 (upstream:
  `g.copy_(allreduce_avg(g.float()).to(g.dtype))`);
* `synchronize`, where a measurement or a hand-over to another thread needs the device's queued
  work done.

DisTrO on sharded parameters goes next to these (issue 15): the momentum lives as its parameter
does, `generate` gathers the full tensor (`gather_full_tensor`) before the DCT encode, and
`apply` shards the decoded aggregate back (`set_grad`) so a shard gets exactly the bits that
slice has on a one-device client.

One device is built today: dp = tp = 1, world size 1, where the gradient mean is the gradients
themselves. The trainer refuses a larger world (`require_single_device`) with a message that
says so; the degrees and their checks against the model are complete so the multi-rank trainer
can start from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterable


class ParallelismError(ValueError):
    """Parallel degrees that cannot work with this model or this build; the message says how
    to fix them."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """The data- and tensor-parallel degrees of one client and the device of this rank."""

    device: torch.device
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name, flag, value in (
            ("data parallelism", "--data-parallelism", self.dp),
            ("tensor parallelism", "--tensor-parallelism", self.tp),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelismError(
                    f"{name} must be a whole number of at least 1, got {value!r}: pass "
                    f"{flag} 1 for one rank"
                )

    @property
    def world_size(self) -> int:
        """Ranks of this client: dp * tp (one device each)."""
        return self.dp * self.tp

    def require_single_device(self) -> None:
        """Refuse a world of more than one rank: parallelism inside a client is not built yet."""
        if self.world_size > 1:
            raise ParallelismError(
                f"data parallelism {self.dp} x tensor parallelism {self.tp} = "
                f"{self.world_size} ranks: parallelism inside a client is not built yet; run "
                "one rank per client (--data-parallelism 1 --tensor-parallelism 1), or one "
                "client per device"
            )

    def check_model(self, config: Any) -> None:
        """Tensor parallelism shards the attention heads and the MLP's inner dimension (upstream
        column/row-parallel Llama layers): each must divide by `tp`."""
        if self.tp == 1:
            return
        for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            size = getattr(config, field, None)
            if isinstance(size, int) and size % self.tp != 0:
                raise ParallelismError(
                    f"tensor parallelism {self.tp} does not divide the model's {field} ({size}): "
                    f"use --tensor-parallelism {' or '.join(map(str, _divisors(size)))}"
                )

    def check_device(self, device: torch.device) -> None:
        """The model must live on this rank's device."""
        if device != self.device:
            raise ParallelismError(
                f"the model is on {device} but this rank's device is {self.device}: build the "
                f"model on {self.device} (or the ParallelDims with the model's device)"
            )

    def reduce_gradients(self, parameters: Iterable[torch.Tensor]) -> None:
        """Make every rank's gradients their mean over the data-parallel ranks, in fp32.

        With one data-parallel rank (all that is built) the mean is the gradients themselves:
        nothing moves and no bit changes."""
        if self.dp == 1:
            return
        self.require_single_device()

    def synchronize(self) -> None:
        """Wait for the work queued on this rank's device (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


__all__ = ["ParallelDims", "ParallelismError"]
