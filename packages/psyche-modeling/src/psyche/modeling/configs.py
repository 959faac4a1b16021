"""Llama (and a tiny DeepSeek) configs built in code (no downloads) for tests, benchmarks and
`psyche-train`.

`20m` follows the small Llama-2-style models upstream's test runs use; `1b` is a TinyLlama-1.1B
shape. Dimensions are multiples of 64 so DisTrO's 64x64 blocks tile them exactly.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 64,
    },
    "20m": {
        "vocab_size": 32000,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "max_position_embeddings": 2048,
    },
    "1b": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
    },
}


def llama_config_dict(preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """A config.json-style dict for a Llama model (`model_type` included, embeddings untied)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **PRESETS[preset],
    }
    config.update(overrides)
    return config


DEEPSEEK_TINY: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
"""A two-layer DeepSeek-V3 (MLA attention, a dense layer then an MoE layer of 4 routed experts
and one shared expert) for tests."""


def deepseek_config_dict(**overrides: Any) -> dict[str, Any]:
    """A config.json-style dict of the tiny DeepSeek-V3 (`DEEPSEEK_TINY`) with `overrides`."""
    return {**DEEPSEEK_TINY, **overrides}
