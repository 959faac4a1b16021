"""The client's ranks as its options give them (`--data-parallelism`, `--tensor-parallelism`,
`--fsdp` and its dtypes, `--activation-checkpointing`, `--device`, `--cpu-threads`): the
settings `workers.WorkerGroup` takes, and what is wrong with them.

This module imports nothing heavy (`TrainOptions` composes it, and `--help` must stay fast):
torch is imported only by `sharding`, when the ranks are laid out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psyche.modeling.sharding import ShardingOptions


@dataclass(frozen=True)
class RankLayout:
    """The client's ranks: `dp` data parallel x `tp` tensor parallel, one device each."""

    dp: int = 1
    tp: int = 1
    fsdp: bool = False
    device: str = "auto"
    cpu_threads: int | None = None
    param_dtype: str = "auto"
    reduce_dtype: str = "fp32"
    activation_checkpointing: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def needed(self) -> bool:
        """Whether the trainer is built through a `WorkerGroup` (several ranks, or a memory
        option the one-rank path applies the same way)."""
        return self.world_size > 1 or self.activation_checkpointing

    def sharding(self) -> ShardingOptions:
        import torch

        from psyche.modeling.sharding import ShardingOptions

        dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
        return ShardingOptions(
            param_dtype=dtypes.get(self.param_dtype),
            reduce_dtype=dtypes[self.reduce_dtype],
            activation_checkpointing=self.activation_checkpointing,
        )

    def problems(self) -> list[str]:
        """What is wrong with the layout and its device, as one-line messages (checked before
        anything heavy loads; devices that do not exist are found when the ranks start)."""
        problems = []
        dp, tp, world = self.dp, self.tp, self.world_size
        device = self.device.strip().lower()
        if device.startswith("cuda:"):
            parts = device[5:].split(",")
            if not all(p.strip().isdigit() for p in parts):
                problems.append(f"--device {self.device}: expected cuda:N or cuda:N,M,...")
            elif len(parts) != world:
                problems.append(
                    f"--device {self.device} names {len(parts)} device(s) for "
                    f"--data-parallelism {dp} x --tensor-parallelism {tp} = {world} rank(s): "
                    f"list {world} devices, or use --device cuda / auto"
                )
            elif len(set(map(int, parts))) != len(parts):
                problems.append(f"--device {self.device}: a device is listed twice")
        elif device not in ("auto", "cpu", "cuda"):
            problems.append(
                f"--device {self.device}: supported are auto, cpu, cuda, cuda:N and "
                "cuda:N,M,... (one per rank)"
            )
        if self.fsdp and dp < 2:
            problems.append("--fsdp shards over the data-parallel ranks: add --data-parallelism 2+")
        if not self.fsdp and (self.param_dtype != "auto" or self.reduce_dtype != "fp32"):
            problems.append("--param-dtype and --reduce-dtype apply to --fsdp only")
        return problems


__all__ = ["RankLayout"]
