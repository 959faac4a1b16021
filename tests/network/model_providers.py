"""Model providers the model-sharing tests share: a small model's worth of bf16 tensors
(`make_parameters`), a `SharableModel` serving them with a config and tokenizer
(`provider_model`), a joiner told every provider's address (`introduce_all`), and a provider's
record as one that announces no side channel (`without_side_channel`)."""

from __future__ import annotations

import torch

from psyche.network.connection import NetworkConnection
from psyche.network.sharable_model import SharableModel
from psyche.network.ticket import EndpointAddr, TransportAddr

CONFIG_JSON = '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}'
TOKENIZER_JSON = '{"model": {"type": "BPE"}}'


def make_parameters(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small model's worth of bf16 tensors with varied shapes (including a scalar-ish one)."""
    g = torch.Generator().manual_seed(seed)
    params = {"model.embed_tokens.weight": torch.randn(512, 64, generator=g)}
    for layer in range(4):
        prefix = f"model.layers.{layer}"
        params[f"{prefix}.self_attn.q_proj.weight"] = torch.randn(64, 64, generator=g)
        params[f"{prefix}.mlp.up_proj.weight"] = torch.randn(256, 64, generator=g)
        params[f"{prefix}.input_layernorm.weight"] = torch.randn(64, generator=g)
    params["model.norm.weight"] = torch.randn(1, generator=g)
    return {name: t.to(torch.bfloat16) for name, t in params.items()}


def provider_model(parameters: dict[str, torch.Tensor]) -> SharableModel:
    model = SharableModel()
    model.update_parameters(parameters)
    model.update_config(CONFIG_JSON, TOKENIZER_JSON)
    return model


async def introduce_all(joiner: NetworkConnection, providers: list[NetworkConnection]) -> None:
    for provider in providers:
        joiner.address_book.add(provider.endpoint_addr())


def without_side_channel(addr: EndpointAddr) -> EndpointAddr:
    """`addr` with its libp2p addresses only: a record that names no blob side channel."""
    return EndpointAddr(addr.id, [a for a in addr.addrs if isinstance(a, TransportAddr.Libp2p)])
