"""Seeded DisTrO cases and the bit-for-bit comparison the DisTrO route tests share: parameters
of every rank and repeated shapes (`SHAPES`) with seeded gradients, the 1-bit results peers send
in a round, four steps of one client on the sparse route, and `assert_same_bits` (raw integer
views, so -0/+0 and NaN payloads count)."""

from __future__ import annotations

import random

import torch
from torch import nn

from psyche.modeling.distro import Distro, DistroResult, quantize_results

_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor, in logical order."""
    return t.detach().contiguous().view(_INT_VIEW[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, what
    assert a.shape == b.shape, what
    if a.dtype.is_floating_point:
        assert torch.equal(bits(a), bits(b)), what
    else:
        assert torch.equal(a, b), what


SHAPES = {  # repeated shapes (a transformer's layers), 1-D norms, a lone shape, a 3-D stack
    "embed": (40, 32),
    "layers.0.attn": (32, 32),
    "layers.0.mlp": (48, 32),
    "layers.0.norm": (32,),
    "layers.1.attn": (32, 32),
    "layers.1.mlp": (48, 32),
    "layers.1.norm": (32,),
    "layers.2.attn": (32, 32),
    "layers.2.mlp": (48, 32),
    "layers.2.norm": (32,),
    "experts": (3, 16, 32),
    "experts2": (3, 16, 32),
    "single_block": (8, 8),
    "single_block2": (8, 8),
}


def seeded_params(dtype: torch.dtype, seed: int, device: str) -> list[tuple[str, nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (name, nn.Parameter((torch.randn(*shape, generator=g) * 0.02).to(device, dtype)))
        for name, shape in SHAPES.items()
    ]


def seeded_grads(params: list[tuple[str, nn.Parameter]], seed: int, drop_one: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    for i, (_, p) in enumerate(params):
        grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
        p.grad = None if (drop_one and i == 3) else grad


def arriving_results(
    dtype: torch.dtype, chunk: int, topk: int, seed: int, peers: int, device: str = "cpu"
) -> list[list[DistroResult]]:
    """`peers` 1-bit result lists of a round (with a duplicate list: coefficients hit twice)."""
    out = []
    for k in range(peers):
        params = seeded_params(dtype, seed + k + 1, device)
        seeded_grads(params, 1000 * seed + k, drop_one=False)
        out.append(quantize_results(Distro(params, 0.999, chunk, topk).generate([], 0.0, 1e-3)))
    return [*out, out[0]]


def sparse_steps(
    dtype: torch.dtype,
    chunk: int,
    topk: int,
    seed: int,
    kind: type[Distro] = Distro,
    **options: bool,
) -> list[list[torch.Tensor]]:
    """Four steps of one client with three peers on the sparse route (`kind`'s): payloads,
    weights and momentum."""
    rng = random.Random(seed)
    params = seeded_params(dtype, seed, "cpu")
    distro = kind(params, 0.999, chunk, topk, rng.choice([0.0, 0.1]), sparse=True, **options)
    prev: list[list[DistroResult]] = []
    steps = []
    for step in range(1, 5):
        lr, prev_lr = 1e-3 * step, 1e-3 * (step - 1)
        distro.error_correction(prev_lr)
        seeded_grads(params, 100 * seed + step, drop_one=step == 2)
        out = distro.generate(prev, prev_lr, lr)
        distro.apply(
            [quantize_results(out), *arriving_results(dtype, chunk, topk, seed + step, 3)], lr
        )
        payload = [t for r in out for t in (r.sparse_idx, r.sparse_val)]
        weights = [p.detach().clone() for _, p in params]
        steps.append(payload + weights + [d.clone() for d in distro.deltas])
        prev = [out] if step % 2 else [out, out]  # sometimes two batches' worth
    return steps
