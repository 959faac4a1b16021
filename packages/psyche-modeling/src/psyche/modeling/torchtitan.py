"""The `Torchtitan` architecture: torchtitan's model definitions behind `CausalLM`.

Upstream's Python path (`TorchtitanAuto`) converts a Hugging Face config to torchtitan's model
arguments, builds torchtitan's model, trains it with its own cross entropy on shifted logits,
and converts to and from Hugging Face checkpoints with torchtitan's state-dict adapter. Here the
same for llama3 (Hugging Face `llama`, `qwen2` and `seed_oss` configs map to it, as upstream)
and deepseek_v3 (MLA attention, MoE with grouped experts, shared experts and a grouped top-k
router):

* `build(hf_config, device, dtype, seed)`: a torchtitan `Llama3Model` / `DeepSeekV3Model`
  from the config, its parameters initialized by torchtitan's own `init_states` after
  `torch.manual_seed(seed)` (so every client of a run builds the same random model): the model
  itself (its parameters keep torchtitan's names, `layers.0.attention.qkv_linear.wq.weight`,
  ..., which DisTrO sorts and every client of the run shares) with a Hugging Face-style
  `forward`;
* `from_hf` / `to_hf`: state dicts through torchtitan's state-dict adapters, so a Torchtitan
  model loads a Hugging Face checkpoint and writes one Hugging Face loads.

The attention is torch's scaled-dot-product attention with a causal mask (torchtitan's
language-model backends are flex and varlen, which need a compiler or CUDA; SDPA is its inner
attention for whole sequences). Tensor parallelism is torchtitan's own plan (`parallelize_tp`); FSDP2
shards torchtitan's blocks as its `apply_fsdp` does (`psyche.modeling.sharding`), also over
TP (torchtitan's 2-D layout: FSDP2 on its mesh's `fsdp` dimension); replicated data
parallelism works as for any model. Not built: torchtitan's other models (qwen3, gpt-oss,
...), sequence, context and expert parallelism, RoPE scaling (so no YaRN mscale),
torch.compile, multi-token prediction. Both models' checkpoints go through torchtitan's
adapters, and tests/modeling/test_torchtitan.py loads each in transformers with the Torchtitan
logits. torchtitan is the `psyche-modeling[torchtitan]` extra, which the
project's setup installs; without it this module says how to install it.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from psyche.modeling.parallel import ParallelDims

LLAMA3_MODEL_TYPES = ("llama", "qwen2", "seed_oss")
"""Hugging Face model types upstream maps to torchtitan's llama3."""
DEEPSEEK_V3_MODEL_TYPES = ("deepseek_v3",)
"""... and to torchtitan's deepseek_v3 (MLA attention, MoE)."""

INSTALL = (
    "the Torchtitan architecture needs the torchtitan package and triton, which torchtitan "
    "imports: psyche-modeling[torchtitan] (./scripts/setup.sh installs it; triton has wheels "
    "for Linux only)"
)


class TorchtitanError(ValueError):
    """torchtitan is missing, or the config has no torchtitan model here (one line)."""


def available() -> str | None:
    """None when torchtitan's llama3 imports, else why not."""
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as e:
        return f"{INSTALL} ({e})"
    return None


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if scaling not in (None, "default"):
        raise TorchtitanError(f"Torchtitan: RoPE scaling {scaling!r} is not built (only default)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))


def model_config(config: Any) -> Any:
    """torchtitan's model config for a Hugging Face config: llama3 or deepseek_v3, with
    torchtitan's tensor-parallel layout declared on every part (its `set_*_sharding_config`,
    without sequence or expert parallelism), as torchtitan declares it whatever the degrees:
    it only acts when `parallelize_tp` lays the model over a mesh."""
    why = available()
    if why is not None:
        raise TorchtitanError(why)
    if config.model_type in LLAMA3_MODEL_TYPES:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        titan = llama3_config(config)
        set_llama3_sharding_config(titan, enable_sp=False)
        return titan
    if config.model_type in DEEPSEEK_V3_MODEL_TYPES:
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

        titan = deepseek_v3_config(config)
        set_deepseek_v3_sharding_config(titan, enable_sp=False, enable_ep=False)
        return titan
    raise TorchtitanError(
        f"Torchtitan is built for {', '.join(LLAMA3_MODEL_TYPES + DEEPSEEK_V3_MODEL_TYPES)} "
        f"configs (torchtitan's llama3 and deepseek_v3), not {config.model_type!r}"
    )


def _inits() -> tuple[dict[str, Any], dict[str, Any]]:
    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    return linear, {"weight": nn.init.ones_}


def _ends(config: Any, cls: Any, layers: list[Any], dim: int, **extra: Any) -> Any:
    """The model config around `layers`: embeddings, final norm, output head."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    linear, norm = _inits()
    vocab, eps = int(config.vocab_size), float(getattr(config, "rms_norm_eps", 1e-5))
    return cls(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=bool(getattr(config, "tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init={"weight": partial(nn.init.normal_, std=1.0)},
        ),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=linear),
        layers=layers,
        **extra,
    )


def deepseek_v3_config(config: Any) -> Any:
    """torchtitan's `DeepSeekV3Model.Config` for a Hugging Face deepseek_v3 config: MLA
    attention, the first `first_k_dense_replace` layers dense, the others MoE (routed experts
    as torchtitan's grouped experts, shared experts, a grouped top-k router)."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import build_mla_moe_layers
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    linear, norm = _inits()
    experts = {
        name: partial(nn.init.trunc_normal_, std=0.02) for name in ("w1_EFD", "w2_EDF", "w3_EFD")
    }
    rope_dim = int(config.qk_rope_head_dim)
    layers = build_mla_moe_layers(
        n_layers=int(config.num_hidden_layers),
        n_dense_layers=int(config.first_k_dense_replace),
        dim=int(config.hidden_size),
        n_heads=int(config.num_attention_heads),
        q_lora_rank=int(config.q_lora_rank or 0),
        kv_lora_rank=int(config.kv_lora_rank),
        qk_nope_head_dim=int(config.qk_nope_head_dim),
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(config.v_head_dim),
        mscale=1.0,
        dense_hidden_dim=int(config.intermediate_size),
        moe_hidden_dim=int(config.moe_intermediate_size),
        num_experts=int(config.n_routed_experts),
        num_shared_experts=int(config.n_shared_experts),
        router_top_k=int(config.num_experts_per_tok),
        router_score_func=getattr(config, "scoring_func", "sigmoid"),
        router_num_expert_groups=int(config.n_group),
        router_num_limited_groups=int(config.topk_group),
        router_route_scale=float(getattr(config, "routed_scaling_factor", 1.0)),
        router_route_norm=bool(getattr(config, "norm_topk_prob", True)),
        attn_backend="flex",  # replaced by SDPA below
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=linear,
        norm_init=norm,
        depth_init=lambda _layer: linear,
        depth_experts_init=lambda _layer: experts,
        rope=ComplexRoPE.Config(
            dim=rope_dim,
            max_seq_len=int(config.max_position_embeddings),
            theta=_rope_theta(config),
            scaling="none",
        ),
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return _ends(config, DeepSeekV3Model.Config, layers, int(config.hidden_size), mtp_layers=[])


def llama3_config(config: Any) -> Any:
    """torchtitan's `Llama3Model.Config` for a Hugging Face llama-style config."""
    from torchtitan.models.common import ComplexRoPE, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    dim, heads = int(config.hidden_size), int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    eps = float(getattr(config, "rms_norm_eps", 1e-5))
    linear, norm = _inits()
    rope = ComplexRoPE.Config(
        dim=dim // heads,
        max_seq_len=int(config.max_position_embeddings),
        theta=_rope_theta(config),
        scaling="none",
    )
    blocks = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm),
            attention=make_gqa_config(
                dim=dim,
                n_heads=heads,
                n_kv_heads=kv_heads,
                wqkv_param_init=linear,
                wo_param_init=linear,
                inner_attention=ScaledDotProductAttention.Config(),
                rope=rope,
                fuse_qkv=False,
            ),
            feed_forward=make_ffn_config(
                dim=dim,
                hidden_dim=int(config.intermediate_size),
                w1_param_init=linear,
                w2w3_param_init=linear,
            ),
        )
        for _ in range(int(config.num_hidden_layers))
    ]
    return _ends(config, Llama3Model.Config, blocks, dim)


_LM_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _lm_class(base: type[nn.Module]) -> type[nn.Module]:
    """`base` (a torchtitan decoder class) with the Hugging Face-style forward `CausalLM`
    calls; the instance keeps its class's state, so names, init and submodules are
    torchtitan's."""

    def forward(
        self: Any,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **_: Any,
    ) -> SimpleNamespace:
        logits = base.forward(self, input_ids, positions=position_ids)
        if isinstance(logits, DTensor):  # tensor-parallel: sharded over the vocabulary
            logits = logits.full_tensor()
        loss = None
        if labels is not None:
            # upstream's TorchtitanAuto: cross entropy of the shifted fp32 logits, mean over
            # the labels that are not -100
            vocab = logits.shape[-1]
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, vocab),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits, loss=loss)

    if base not in _LM_CLASSES:
        _LM_CLASSES[base] = type(f"Torchtitan{base.__name__}", (base,), {"forward": forward})
    return _LM_CLASSES[base]


def build(config: Any, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """A randomly initialized torchtitan model for the Hugging Face `config` (see the module);
    `model.hf_config` is the Hugging Face config, `model.titan_config` torchtitan's."""
    titan_config = model_config(config)
    torch.manual_seed(seed)
    model = titan_config.build()  # torchtitan's module: its own methods (init_states) below
    model.init_states()
    model.__class__ = _lm_class(type(model))
    model.titan_config = titan_config
    model.hf_config = config  # `model.config` stays torchtitan's (its code reads it)
    model.to(device)
    with torch.no_grad():  # parameters only: the RoPE table is a complex buffer
        for p in model.parameters():
            p.data = p.data.to(dtype)
    built: torch.nn.Module = model
    return built


def parallelize_tp(model: nn.Module, dims: ParallelDims) -> DeviceMesh:
    """Lay `model` (built by `build`, whole and identical on every rank) over `dims`' tensor-
    parallel ranks with torchtitan's own plan (`Module.parallelize`, what its
    `parallelize_llama` / `parallelize_deepseekv3` run for TP), in its DTensor form
    (`spmd_backend="partial_dtensor"`: parameters become DTensors on the `tp` mesh, which
    DisTrO, clipping and checkpoints already handle). llama3: q/k/v, w1/w3 column-parallel,
    wo/w2 row-parallel, the embedding and lm_head sharded over the vocabulary, norms
    replicated. deepseek_v3: wq (or wq_b) and wkv_b column-parallel, wo row-parallel, the
    low-rank wkv_a/wq_a and their norms replicated, dense and shared-expert FFNs as llama3's,
    routed experts sharded on their hidden dimension, the router replicated. The logits leave
    lm_head sharded over the vocabulary; `forward` gathers them.

    torchtitan builds its own meshes over the same ranks (rank = dp_rank * tp + tp_rank, as
    `ParallelDims`: its `fsdp` dimension is `dims.dp` under FSDP, else its `dp_replicate`
    is); it takes their device type from the machine (CUDA when present), so it is told the
    ranks' device here. Returns torchtitan's `fsdp` mesh: under FSDP the blocks must be
    sharded over it (FSDP2 lays a TP DTensor over a second mesh dimension only when both
    meshes are one mesh's, as torchtitan's `parallelize_llama` passes its own). Every rank of
    the client must call it (a collective)."""
    from torchtitan.distributed import parallel_dims as titan_dims

    layout = titan_dims.ParallelDims(
        dp_replicate=1 if dims.fsdp else dims.dp,
        dp_shard=dims.dp if dims.fsdp else 1,
        cp=1,
        tp=dims.tp,
        pp=1,
        ep=1,
        world_size=dims.world_size,
        spmd_backend="partial_dtensor",
    )
    machine = titan_dims.device_type
    titan_dims.device_type = dims.device.type
    try:
        layout.build_mesh()
    finally:
        titan_dims.device_type = machine
    parallelize: Any = getattr(model, "parallelize")  # noqa: B009 (torchtitan's Module)
    parallelize(layout)
    fsdp_mesh: DeviceMesh = layout.get_mesh("fsdp")
    return fsdp_mesh


def _adapter(model: nn.Module) -> Any:
    hf_config: Any = getattr(model, "hf_config")  # noqa: B009 (set by `build`)
    if hf_config.model_type in DEEPSEEK_V3_MODEL_TYPES:
        from torchtitan.models.deepseek_v3 import DeepSeekV3StateDictAdapter

        return DeepSeekV3StateDictAdapter(model.titan_config, None)
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    return Llama3StateDictAdapter(model.titan_config, None)


def from_hf(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict in `model`'s torchtitan names."""
    return dict(_adapter(model).from_hf(state))


def to_hf(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model`'s state dict in Hugging Face names (what a checkpoint holds)."""
    return dict(_adapter(model).to_hf(state))


__all__ = [
    "DEEPSEEK_V3_MODEL_TYPES",
    "LLAMA3_MODEL_TYPES",
    "TorchtitanError",
    "available",
    "build",
    "from_hf",
    "parallelize_tp",
    "to_hf",
]
