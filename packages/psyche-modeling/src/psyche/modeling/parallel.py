"""How one client's model is laid out over its devices (torchtitan's `distributed.ParallelDims`).

A Psyche client is one member of a run whatever its hardware: upstream splits a client's work
over data-parallel (DP) and tensor-parallel (TP) ranks (`--data-parallelism`,
`--tensor-parallelism`; `shared/modeling/src/parallelism.rs`, and FSDP2 + DTensor in its Python
path, `python/psyche/models/hf_transformers.py`). `ParallelDims` holds those degrees, this
rank's place among them and its device, the `DeviceMesh` over the ranks, checks them against
the model with errors that say what to change, and is where the trainer asks about the layout:

* `local_rows`: the rows of the client's batch this rank trains (DP ranks split the batch;
  the ranks of one TP group see the same rows);
* `reduce_gradients`, after the backward pass and before clipping and DisTrO: with replicated
  DP every rank's gradients become their mean, computed in fp32 (upstream:
  `g.copy_(allreduce_avg(g.float()).to(g.dtype))`; here a sum in rank order, `ordered_sum`,
  divided by dp: when each DP rank trains one of the one-rank client's micro-batches, the
  one-rank bits for any power-of-two dp, on one host or several). With FSDP2 (`fsdp=True`) the parameters are sharded over the DP ranks
  and FSDP's reduce-scatter does the mean, so nothing is left to do here;
* `agree`: one decision for every rank (a cancelled step must stop at the same micro-batch on
  all of them, or their collectives would no longer pair up);
* `synchronize`, where a measurement or a hand-over to another thread needs the device's queued
  work done.

Ranks are numbered as upstream: rank = dp_rank * tp + tp_rank (`Devices` in parallelism.rs).
The mesh has the dimensions of size > 1, named `dp` (`dp_shard` under FSDP, as upstream's
`build_mesh`) and `tp`. With one rank there is no mesh and nothing moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torch.distributed.device_mesh import DeviceMesh


class ParallelismError(ValueError):
    """Parallel degrees that cannot work with this model or this machine; the message says how
    to fix them."""


def _chunk_count(rows: int, chunks: int) -> int:
    """How many pieces `torch.chunk` makes of `rows` rows asked for `chunks`."""
    if rows == 0:
        return 0
    size = math.ceil(rows / chunks)
    return math.ceil(rows / size)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """The data- and tensor-parallel degrees of one client, this rank and its device."""

    device: torch.device
    dp: int = 1
    tp: int = 1
    fsdp: bool = False
    """Shard the parameters over the DP ranks with FSDP2 instead of replicating them."""
    rank: int = 0
    """This rank in the client's world (0 is the client itself)."""
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """The ranks' `DeviceMesh` (None with one rank); see `psyche.modeling.sharding.build_mesh`."""

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
        if not 0 <= self.rank < self.world_size:
            raise ParallelismError(f"rank {self.rank} is outside a world of {self.world_size}")
        if self.fsdp and self.dp == 1:
            raise ParallelismError(
                "--fsdp shards the model over the data-parallel ranks: pass "
                "--data-parallelism 2 or more with it"
            )

    @property
    def world_size(self) -> int:
        """Ranks of this client: dp * tp (one device each)."""
        return self.dp * self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_leader(self) -> bool:
        """Rank 0: the process that is the client (network, identity, results)."""
        return self.rank == 0

    @property
    def dp_mesh_name(self) -> str:
        return "dp_shard" if self.fsdp else "dp"

    def require_world(self) -> None:
        """A layout of several ranks needs its mesh (the process group started)."""
        if self.world_size > 1 and self.mesh is None:
            raise ParallelismError(
                f"data parallelism {self.dp} x tensor parallelism {self.tp} = "
                f"{self.world_size} ranks need their process group: start the ranks with "
                "psyche.modeling.distributed (the client does with --data-parallelism / "
                "--tensor-parallelism)"
            )

    def check_model(self, config: Any) -> None:
        """Tensor parallelism shards the attention heads and the MLPs' inner dimensions
        (upstream's column/row-parallel Llama and DeepSeek layers): each must divide by `tp`;
        and only those models have a tensor-parallel plan."""
        if self.tp == 1:
            return
        model_type = getattr(config, "model_type", None)
        if model_type is not None and model_type not in TP_MODEL_TYPES:
            raise ParallelismError(
                f"tensor parallelism is built for {', '.join(TP_MODEL_TYPES)} models, not "
                f"{model_type!r}: use --tensor-parallelism 1 (and --data-parallelism / --fsdp)"
            )
        sizes = {
            name: getattr(config, name, None)
            for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
        }
        if model_type in DEEPSEEK_MODEL_TYPES:  # the shared experts are one MLP this wide
            moe, shared = (
                getattr(config, n, None) for n in ("moe_intermediate_size", "n_shared_experts")
            )
            if isinstance(moe, int) and isinstance(shared, int):
                sizes["moe_intermediate_size x n_shared_experts"] = moe * shared
        for name, size in sizes.items():
            if isinstance(size, int) and size % self.tp != 0:
                raise ParallelismError(
                    f"tensor parallelism {self.tp} does not divide the model's {name} ({size}): "
                    f"use --tensor-parallelism {' or '.join(map(str, _divisors(size)))}"
                )

    def check_optimizer(self, optimizer: Any) -> None:
        """DiLoCo (`OptimizerDefinition.DiLoCo`) keeps its outer state and decodes its results
        as whole tensors: on FSDP shards it gathers its residual and keeps each rank's slice
        (two-rank witnesses give the one-rank bits, `tests/client/test_parallel_witness.py`);
        on tensor-parallel parameters it is not built (it failed mid-round in its codec, mixing
        a tensor and a DTensor, and nothing checks its bits there)."""
        from psyche.core.definitions import OptimizerDefinition

        if isinstance(optimizer, OptimizerDefinition.DiLoCo) and self.tp > 1:
            raise ParallelismError(
                "DiLoCo is not built on tensor-parallel parameters (--tensor-parallelism): "
                "use --data-parallelism (with or without --fsdp), or one rank"
            )

    def check_device(self, device: torch.device) -> None:
        """The model must live on this rank's device."""
        if device != self.device:
            raise ParallelismError(
                f"the model is on {device} but this rank's device is {self.device}: build the "
                f"model on {self.device} (or the ParallelDims with the model's device)"
            )

    def local_rows(self, rows: int) -> tuple[int, int]:
        """`(start, length)` of this rank's rows of a batch of `rows` (`torch.tensor_split`
        over the DP ranks: the first `rows % dp` ranks get one more)."""
        if self.dp == 1:
            return 0, rows
        base, extra = divmod(rows, self.dp)
        r = self.dp_rank
        return r * base + min(r, extra), base + (1 if r < extra else 0)

    def micro_batches(self, rows: int, micro_batch_size: int) -> int:
        """Micro-batches every rank runs for a batch of `rows`: those of the rank with the most
        rows (a rank with fewer pads with zero-weight micro-batches, so that every forward's
        collectives pair up)."""
        return math.ceil(math.ceil(rows / self.dp) / micro_batch_size)

    def loss_scale(self, rows: int, micro_batch_size: int) -> float:
        """What each micro-batch's loss is divided by, so that after the DP mean the gradient
        is the mean over every real micro-batch of the client's batch, whatever the split: the
        real micro-batches of all ranks / dp. With one rank, or an even split, that is the
        micro-batch count (upstream's `loss_scale = steps`)."""
        steps = self.micro_batches(rows, micro_batch_size)
        if self.dp == 1:
            return steps
        base, extra = divmod(rows, self.dp)
        real = sum(_chunk_count(base + (1 if r < extra else 0), steps) for r in range(self.dp))
        return real / self.dp

    def _group(self, name: str) -> Any:
        assert self.mesh is not None
        return self.mesh.get_group(name)

    def reduce_gradients(self, grads: Iterable[torch.Tensor]) -> None:
        """Make every rank's gradients their mean over the replicated data-parallel ranks, in
        fp32: one flat fp32 buffer, summed over the DP ranks in rank order (`ordered_sum`) and
        divided by dp, copied back in each gradient's dtype. A no-op with one DP rank and under
        FSDP (its reduce-scatter already averaged the shards)."""
        if self.dp == 1 or self.fsdp:
            return
        self.require_world()
        from torch._utils import _unflatten_dense_tensors

        from psyche.modeling.sharding import local_tensor

        local = [local_tensor(g) for g in grads]
        if not local:
            return
        flat = ordered_sum([g.float() for g in local], self._group("dp"), self.dp)
        flat.div_(self.dp)
        with torch.no_grad():
            for g, mean in zip(local, _unflatten_dense_tensors(flat, local)):
                g.copy_(mean.to(g.dtype))

    def reduce_loss(self, loss: float) -> float:
        """The mean of the DP ranks' losses, as the one-rank client sums its micro-batches'
        losses: in fp32, in rank order, then divided by dp (the TP ranks of one DP rank report
        the same loss; the first of each is taken). Gathered on the CPU control group."""
        if self.dp == 1:
            return loss
        import torch.distributed as dist

        from psyche.modeling.sharding import control_group

        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world_size)]
        dist.all_gather(gathered, torch.tensor([loss], dtype=torch.float64), group=control_group())
        total = gathered[0].float()
        for value in gathered[self.tp :: self.tp]:
            total = total + value.float()
        return float(total.item()) / self.dp

    def agree(self, flag: bool) -> bool:
        """True on every rank when it is True on any (the cancel flag only the leader sees)."""
        if self.world_size == 1:
            return flag
        import torch.distributed as dist

        from psyche.modeling.sharding import control_group

        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=control_group())
        return bool(value.item())

    def synchronize(self) -> None:
        """Wait for the work queued on this rank's device (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def ordered_sum(tensors: list[torch.Tensor], group: Any, ranks: int) -> torch.Tensor:
    """The sum over the `ranks` ranks of `group` of each rank's `tensors` (flattened into one
    buffer, returned flat), added in rank order: ((r0 + r1) + r2) + ... on every element, as the
    one-rank client accumulates its micro-batches' gradients one after the other; so a client
    whose DP ranks each train one of those micro-batches gets the one-rank bits whatever the
    number of ranks and hosts. (An all-reduce adds in an order of its own: gloo's ring starts
    each chunk's sum at another rank, so four ranks differed from one in the last bits.)

    A reduce-scatter and an all-gather, as a ring all-reduce moves: each rank receives every
    rank's copy of its own 1/ranks of the buffer (`all_to_all_single`), adds them in rank
    order, and the sums are gathered back."""
    import torch.distributed as dist

    total = sum(t.numel() for t in tensors)
    chunk = math.ceil(total / ranks)
    pieces = [t.reshape(-1) for t in tensors]
    pad = chunk * ranks - total
    if pad:
        pieces.append(tensors[0].new_zeros(pad))
    flat = torch.cat(pieces)
    mine = flat.new_empty(chunk)
    ordered_reduce_scatter(mine, flat, group, ranks)
    dist.all_gather_single(flat, mine, group=group)
    return flat[:total]


def ordered_reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group: Any, ranks: int) -> None:
    """`out` = the sum over the `ranks` ranks of `group` of their `flat`'s part for this rank
    (`flat` is `ranks` equal parts, part r for rank r), added in rank order on every element:
    a reduce-scatter whose sums are those of `ordered_sum` (what FSDP2's reduce-scatter does,
    in an order of its own)."""
    import torch.distributed as dist

    received = torch.empty_like(flat)
    dist.all_to_all_single(received, flat, group=group)
    parts = received.view(ranks, -1)
    out.copy_(parts[0])
    for part in parts[1:]:
        out.add_(part)


DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TP_MODEL_TYPES = ("llama", "seed_oss", *DEEPSEEK_MODEL_TYPES)
"""Model types with a tensor-parallel plan (upstream's `hf_transformers.py` for Llama, its native
DeepSeek's column/row-parallel layers for DeepSeek)."""


def parse_devices(spec: str, world_size: int) -> list[torch.device]:
    """The device of each rank from `--device`: `cpu` (every rank on the CPU), `auto` (one
    CUDA device per rank when there are enough, else the CPU), `cuda` (CUDA devices 0..n-1) or
    `cuda:0,1,...` (exactly one per rank, no repeats). The error says what would fit."""
    spec = spec.strip().lower()
    if spec == "cpu":
        return [torch.device("cpu")] * world_size
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto":
        if available == 0:
            return [torch.device("cpu")] * world_size
        spec = "cuda"
    if spec == "cuda":
        if available < world_size:
            raise ParallelismError(
                f"--device {spec}: {world_size} ranks need {world_size} CUDA devices, "
                f"{available} present: lower --data-parallelism x --tensor-parallelism to "
                f"{max(available, 1)} or use --device cpu"
            )
        return [torch.device("cuda", i) for i in range(world_size)]
    if not spec.startswith("cuda:"):
        raise ParallelismError(
            f"--device {spec}: expected auto, cpu, cuda, cuda:N or cuda:N,M,... (one per rank)"
        )
    parts = spec[5:].split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise ParallelismError(f"--device {spec}: expected cuda:N or cuda:N,M,... (numbers)")
    indices = [int(p) for p in parts]
    if len(indices) != world_size or len(set(indices)) != len(indices):
        raise ParallelismError(
            f"--device {spec} names {len(indices)} devices for data parallelism x tensor "
            f"parallelism = {world_size} ranks: list {world_size} distinct devices"
        )
    missing = [i for i in indices if i >= available]
    if missing:
        raise ParallelismError(
            f"--device {spec}: cuda:{missing[0]} does not exist ({available} CUDA devices)"
        )
    return [torch.device("cuda", i) for i in indices]


__all__ = [
    "DEEPSEEK_MODEL_TYPES",
    "TP_MODEL_TYPES",
    "ParallelDims",
    "ParallelismError",
    "ordered_reduce_scatter",
    "ordered_sum",
    "parse_devices",
]
