"""A model laid out over the ranks of one client: the process group, the mesh, tensor parallelism
with DTensor, FSDP2, and the tensor helpers DisTrO and checkpoints use on sharded parameters.

What upstream's Python path does (`python/psyche/models/hf_transformers.py`,
`dtensor_helpers.py`), on torch.distributed alone (no hand-written collectives):

* `init_world` starts the ranks' process group (gloo on the CPU, NCCL on CUDA) and a gloo
  `control_group` for the leader's commands and the per-micro-batch cancel vote (CPU objects
  whatever the device);
* `build_mesh` builds the `DeviceMesh` with the dimensions of size > 1: `dp` (replicated data
  parallelism) or `dp_shard` (FSDP2), and `tp`;
* `parallelize` applies upstream's plan (a Torchtitan model's tensor parallelism is torchtitan's
  own, `psyche.modeling.torchtitan.parallelize_tp`, on torchtitan's own mesh, over whose `fsdp`
  dimension FSDP2 then shards it): tensor parallelism for Llama-family models
  (`ColwiseParallel` q/k/v/gate/up, `RowwiseParallel` o/down, `lm_head` column-parallel with a
  replicated output; embeddings and norms stay replicated), then FSDP2 (`fully_shard` on each
  `_no_split_modules` block and on the root, `MixedPrecisionPolicy(param_dtype, reduce_dtype)`),
  and activation checkpointing;
* `full_tensor` (upstream `gather_full_tensor`), `shard_like` (upstream
  `calculate_local_tensor_from_full`: every rank holds the same full tensor, so each takes its
  slice with no communication) and `local_tensor`.

Elementwise ops on a DTensor run the same kernel on the local slice, so they give that slice's
bits of the unsharded op: this is what keeps a sharded client's DisTrO state and parameters
bit-identical to a one-device client's given the same gradients.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from psyche.modeling.parallel import TP_MODEL_TYPES, ParallelDims, ParallelismError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from psyche.modeling.causal_lm import CausalLM

_CONTROL_GROUP: Any = None


def is_sharded(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view: writing to it writes the parameter); the tensor
    itself otherwise."""
    if is_sharded(tensor):
        return tensor._local_tensor
    return tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather for a sharded DTensor; the tensor itself
    otherwise). A collective: every rank of the tensor's mesh must call it, in the same order."""
    if is_sharded(tensor):
        return tensor.full_tensor()
    return tensor


def settle_gradients(params: Iterable[torch.Tensor]) -> None:
    """Give each sharded parameter's gradient the parameter's own layout. torchtitan's TP plan
    (in its DTensor form) leaves the gradients of its row-parallel weights and of the weights
    it replicates (norms, the MoE router, MLA's low-rank projections) as `Partial` sums: on
    each rank a full-size tensor not yet added over the TP ranks. DisTrO, the DP mean and
    clipping read each rank's local slice, which must be the parameter's: a reduce-scatter (to
    a shard) or an all-reduce (to a replica) per such gradient, in `params`' order on every
    rank. Nothing moves where the layouts agree (HF TP, FSDP2, one rank), nor under FSDP2 with
    torchtitan's TP: FSDP2 gives the gradient the parameter's TP layout the same way before
    its reduce-scatter."""
    for p in params:
        grad = p.grad
        if grad is None or not is_sharded(p) or not is_sharded(grad):
            continue
        if tuple(grad.placements) != tuple(p.placements):
            p.grad = grad.redistribute(p.device_mesh, p.placements)


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` is: for a DTensor, this rank's slice as a DTensor of the same
    mesh and placements, taken from the full tensor every rank holds (no communication); `full`
    itself otherwise."""
    if not is_sharded(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        full,
        like.device_mesh,
        like.placements,
        src_data_rank=None,
    )


# --------------------------------------------------------------------------------------------
# The process group


def init_world(
    rank: int,
    world_size: int,
    init_method: str | None,
    device: torch.device,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    store: Any = None,
) -> None:
    """Join the client's process group (`init_method`, e.g. `tcp://127.0.0.1:PORT`, or a
    `torch.distributed.Store` this process serves): NCCL when the ranks are CUDA devices, gloo
    otherwise; plus the gloo control group."""
    global _CONTROL_GROUP
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None


def control_group() -> Any:
    """The gloo group for CPU-side messages (the default group when it is gloo)."""
    return _CONTROL_GROUP


def close_world() -> None:
    global _CONTROL_GROUP
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL_GROUP = None


def build_mesh(dims: ParallelDims) -> DeviceMesh | None:
    """The mesh of `dims` (dimensions of size > 1, `dp`/`dp_shard` then `tp`); None for one
    rank. Every rank must call it."""
    if dims.world_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = [], []
    for size, name in ((dims.dp, dims.dp_mesh_name), (dims.tp, "tp")):
        if size > 1:
            shape.append(size)
            names.append(name)
    return init_device_mesh(dims.device.type, tuple(shape), mesh_dim_names=tuple(names))


# --------------------------------------------------------------------------------------------
# The model over the ranks


@dataclass(frozen=True)
class ShardingOptions:
    """How a sharded model computes; each option trades memory for time (docs/client.md).

    * `param_dtype`: the dtype FSDP2 gathers parameters in for the forward and backward
      (None: the stored dtype). bf16 halves the gathered weights and activations.
    * `reduce_dtype`: the dtype FSDP2 reduce-scatters gradients in (fp32 as upstream: exact
      sums, twice bf16's traffic).
    * `activation_checkpointing`: keep only each block's input and recompute the rest in the
      backward: activation memory from O(layers x sequence x width x ~10) to O(layers x
      sequence x width), for about one more forward's time. Recomputation gives the same bits.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    activation_checkpointing: bool = False


def _mlp_plan(prefix: str) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        f"{prefix}.gate_proj": ColwiseParallel(),
        f"{prefix}.up_proj": ColwiseParallel(),
        f"{prefix}.down_proj": RowwiseParallel(),
    }


def _tp_plan(layer: Any) -> dict[str, Any]:
    """The plan of one decoder layer. Llama (upstream's `hf_transformers.py`): q/k/v and
    gate/up column-parallel, o and down row-parallel. DeepSeek (upstream's native
    `deepseek.rs`): the heads' projections (`q_proj`, or `q_b_proj` after the low-rank
    `q_a_proj`, and `kv_b_proj`) column-parallel, `o_proj` row-parallel; the low-rank
    `q_a_proj`/`kv_a_proj_with_mqa` and their norms replicated (they are small and every head
    reads them); a dense layer's MLP and an MoE layer's shared experts as Llama's MLP; the
    router and the routed experts (transformers keeps them as one 3-D tensor per projection)
    replicated, each rank computing all of them on its replicated input."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    attention = layer.self_attn
    if hasattr(attention, "kv_b_proj"):
        query = "q_proj" if getattr(attention, "q_proj", None) is not None else "q_b_proj"
        plan = {
            f"self_attn.{query}": ColwiseParallel(),
            "self_attn.kv_b_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
        }
        shared = hasattr(layer.mlp, "shared_experts")
        return {**plan, **_mlp_plan("mlp.shared_experts" if shared else "mlp")}
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        **_mlp_plan("mlp"),
    }


def parallelize(model: CausalLM, dims: ParallelDims, options: ShardingOptions) -> CausalLM:
    """`model` (whole, on this rank's device, identical on every rank) laid out as `dims` says,
    as a new `CausalLM` over the same module. Every rank must call it."""
    from psyche.modeling.causal_lm import CausalLM

    dims.check_model(model.config)
    module = model.model
    if options.activation_checkpointing and getattr(
        module, "supports_gradient_checkpointing", False
    ):
        enable = getattr(module, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers >= 5.x's name
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            # nn.Module types attributes as Tensor | Module; a transformers model has the method.
            getattr(module, "gradient_checkpointing_enable")(  # noqa: B009
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    if dims.world_size > 1:
        dims.require_world()
        mesh = dims.mesh
        assert mesh is not None
        fsdp_mesh = mesh[dims.dp_mesh_name] if dims.fsdp else None
        if dims.tp > 1 and model.architecture == "Torchtitan":
            from psyche.modeling import torchtitan

            # FSDP2 over torchtitan's own mesh, the one its TP DTensors live on
            titan_fsdp_mesh = torchtitan.parallelize_tp(module, dims)
            if dims.fsdp:
                fsdp_mesh = titan_fsdp_mesh
        elif dims.tp > 1:
            _apply_tp(module, mesh["tp"])
        if fsdp_mesh is not None:
            _apply_fsdp(module, fsdp_mesh, options)
    return CausalLM(module, model.architecture, source_dir=model.source_dir)


def _apply_tp(module: Any, tp_mesh: Any) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    if module.config.model_type not in TP_MODEL_TYPES:
        raise ParallelismError(f"no tensor-parallel plan for {module.config.model_type!r}")
    for layer in module.model.layers:
        parallelize_module(layer, tp_mesh, _tp_plan(layer))
        latent = getattr(layer.self_attn, "kv_a_proj_with_mqa", None)
        if latent is not None:
            width = layer.self_attn.qk_rope_head_dim
            latent.register_forward_hook(
                lambda _m, _i, out, width=width: _SumGradTail.apply(out, width, tp_mesh.get_group())
            )
    parallelize_module(module, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})


class _SumGradTail(torch.autograd.Function):
    """DeepSeek's MLA under TP: `kv_a_proj_with_mqa`'s output is replicated, its head `kv_nope`
    feeds the column-parallel `kv_b_proj` (whose input gradient DTensor sums over the ranks),
    but its tail `k_rot` (the rotary key every head shares) is read by this rank's heads only,
    so its gradient is a partial sum. Identity forward; backward sums the last `width` columns
    of the gradient over `group` (upstream's `copy_to_model_parallel`, on that part only)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, width: int, group: Any) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import torch.distributed as dist

        grad = grad.clone()
        tail = grad[..., -ctx.width :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.width :] = tail
        return grad, None, None


def _apply_fsdp(module: Any, dp_mesh: Any, options: ShardingOptions) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype
    )
    for block in [*_blocks(module), module]:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        block.set_custom_reduce_scatter(_ordered_reduce_scatter())


def _ordered_reduce_scatter() -> Any:
    """FSDP2's gradient reduce-scatter with the sums added in rank order (`parallel.
    ordered_reduce_scatter`), as replicated DP's mean is: so FSDP over any power-of-two number
    of ranks, each training one of the one-rank client's micro-batches, gives the one-rank
    gradients bit for bit (gloo's own reduce-scatter adds in another order, which differed from
    one rank in the last bits at 4 ranks). FSDP asks for a sum or, with fp32 or bf16
    gradients, a mean (the sum divided by the ranks: exact for a power of two)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    from psyche.modeling.parallel import ordered_reduce_scatter

    class OrderedReduceScatter(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: Any,
            op: Any,
            async_op: bool = False,
        ) -> None:
            ranks = dist.get_world_size(group)
            ordered_reduce_scatter(output_tensor, input_tensor, group, ranks)
            if op == dist.ReduceOp.AVG:
                output_tensor.div_(ranks)
            elif op != dist.ReduceOp.SUM:
                raise ParallelismError(f"FSDP asked for a reduce-scatter by {op}: not built")

    return OrderedReduceScatter()


def _blocks(module: Any) -> list[Any]:
    """The modules FSDP2 shards one by one (gathered one at a time): a transformers model's
    `_no_split_modules` (its decoder layers), a torchtitan model's transformer blocks (its
    `layers`, as torchtitan's own `apply_fsdp` shards them)."""
    if hasattr(module, "titan_config"):
        layers = module.layers
        return list(layers.values() if hasattr(layers, "values") else layers)
    inner = getattr(module, "model", None)
    names = set(getattr(inner, "_no_split_modules", None) or module._no_split_modules or [])
    if not names:
        raise ParallelismError(f"cannot tell the blocks of {type(module).__name__} to shard")
    return [sub for sub in module.modules() if type(sub).__name__ in names]


__all__ = [
    "ShardingOptions",
    "build_mesh",
    "close_world",
    "control_group",
    "full_tensor",
    "init_world",
    "is_sharded",
    "local_tensor",
    "parallelize",
    "settle_gradients",
    "shard_like",
]
