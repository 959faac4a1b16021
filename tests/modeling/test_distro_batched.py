"""DisTrO's batched route (same-shaped parameters in one call, `_foreach` elementwise ops; the
default on CUDA) against the per-parameter route (upstream's op order, the default on the CPU):
payloads, parameters and momentum over several steps with peers, duplicate lists, 1-bit and
full-valued results, weight decay and parameters of every rank.

In bf16 (a GPU client's dtype) the two routes give the same bits, on the CPU here and on CUDA in
the `gpu` test. In float32 the CPU's matrix multiply rounds a stack of parameters differently
from each alone (its blocking depends on the row count), so there the batched route is checked
to be deterministic and to move the weights as the per-parameter route does."""

from __future__ import annotations

import random

import pytest
import torch

from psyche.modeling.distro import Distro, DistroResult, quantize_results

from .distro_cases import assert_same_bits, seeded_grads, seeded_params


def _run(
    batched_route: bool, device: str, dtype: torch.dtype, chunk: int, topk: int, seed: int
) -> list[tuple[list[list[DistroResult]], list[torch.Tensor], list[torch.Tensor]]]:
    """Four steps of one client with three peers; per step: its payloads, weights, momentum."""
    rng = random.Random(seed)
    params = seeded_params(dtype, seed, device)
    wd = rng.choice([0.0, 0.1])
    distro = Distro(params, 0.999, chunk, topk, wd, batched=batched_route)
    assert (distro.groups is not None) == batched_route
    distro.keep_encoded = True  # what a witness reads as its reference (the screening)
    peers = [seeded_params(dtype, seed + k + 1, device) for k in range(3)]
    peer_distros = [Distro(p, 0.999, chunk, topk, wd, batched=False) for p in peers]
    prev: list[list[DistroResult]] = []
    steps = []
    for step in range(1, 5):
        lr, prev_lr = 1e-3 * step, 1e-3 * (step - 1)
        distro.error_correction(prev_lr)
        seeded_grads(params, 100 * seed + step, drop_one=rng.random() < 0.3)
        out = distro.generate(prev, prev_lr, lr)
        peer_out = []
        for k, (p, d) in enumerate(zip(peers, peer_distros)):
            seeded_grads(p, 1000 * seed + 10 * step + k, drop_one=False)
            peer_out.append(d.generate([], prev_lr, lr))
        arriving = [quantize_results(out)] + [quantize_results(r) for r in peer_out]
        if rng.random() < 0.5:  # a duplicate list: the same indices twice
            arriving.append(arriving[rng.randrange(len(arriving))])
        if rng.random() < 0.3:  # full values mixed in: the per-parameter route decodes those
            arriving.append(peer_out[0])
        rng.shuffle(arriving)
        distro.apply(arriving, lr)
        assert all(p.grad is None or not p.grad.any() for _, p in params)
        weights = [p.detach().clone() for _, p in params]
        assert distro.encoded is not None
        assert len(distro.encoded) == len(params)
        for result, coefficients in zip(out, distro.encoded):
            assert list(coefficients.shape) == list(result.xshape)
        encoded = [c.clone() for c in distro.encoded]
        steps.append(([out, encoded], weights, [d.clone() for d in distro.deltas]))
        # next round: own unquantized results, sometimes two batches' worth
        prev = [out] if rng.random() < 0.7 else [out, out]
    return steps


def _assert_identical(a: list, b: list) -> None:  # type: ignore[type-arg]
    """Payloads, kept coefficients, weights and momentum, step by step, bit for bit."""
    for step, ((out_a, w_a, m_a), (out_b, w_b, m_b)) in enumerate(zip(a, b), 1):
        for x, y in zip(out_a[0], out_b[0]):
            assert torch.equal(x.sparse_idx, y.sparse_idx), f"step {step} indices"
            assert_same_bits(x.sparse_val, y.sparse_val, f"step {step} values")
            assert (x.xshape, x.totalk) == (y.xshape, y.totalk)
        for x, y in zip(out_a[1], out_b[1]):  # the kept coefficients (a witness's reference)
            assert_same_bits(x, y, f"step {step} encoded")
        for x, y in zip(w_a, w_b):
            assert_same_bits(x, y, f"step {step} weights")
        for x, y in zip(m_a, m_b):
            assert_same_bits(x, y, f"step {step} momentum")


def _compare(device: str, dtype: torch.dtype, chunk: int, topk: int, seed: int) -> None:
    batched = _run(True, device, dtype, chunk, topk, seed)
    plain = _run(False, device, dtype, chunk, topk, seed)
    if dtype == torch.bfloat16:
        _assert_identical(batched, plain)
        return
    _assert_identical(batched, _run(True, device, dtype, chunk, topk, seed))  # deterministic
    # the same training: a weight differs only where a last-bit difference in a coefficient
    # flipped a top-k choice or a sign, a step of 2 lr at most
    moved = differ = 0
    for (_, w_b, _), (_, w_p, _) in zip(batched, plain):
        for x, y in zip(w_b, w_p):
            moved += x.numel()
            differ += int((x != y).sum())
            assert float((x - y).abs().max()) <= 2 * 4e-3 * 4 + 1e-6
    assert differ <= 0.02 * moved, f"{differ} of {moved} weights differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("chunk", "topk"), [(16, 4), (8, 3), (64, 8)])
def test_the_batched_route_gives_the_per_parameter_bits(
    dtype: torch.dtype, chunk: int, topk: int
) -> None:
    for seed in range(3):
        _compare("cpu", dtype, chunk, topk, seed)


def test_groups_hold_same_shaped_parameters_and_single_blocks_stay_alone() -> None:
    distro = Distro(seeded_params(torch.float32, 0, "cpu"), 0.999, 16, 4, batched=True)
    names = [n for n, _ in distro.variables]
    assert distro.groups is not None
    named = sorted(sorted(names[i] for i in g) for g in distro.groups)
    assert ["layers.0.attn", "layers.1.attn", "layers.2.attn"] in named
    assert ["layers.0.norm", "layers.1.norm", "layers.2.norm"] in named
    assert ["experts", "experts2"] in named
    assert ["single_block"] in named
    assert ["single_block2"] in named
    assert sorted(i for g in distro.groups for i in g) == list(range(len(names)))


def test_a_group_larger_than_the_stack_limit_is_split(monkeypatch: pytest.MonkeyPatch) -> None:
    from psyche.modeling import distro as distro_module

    monkeypatch.setattr(distro_module, "MAX_STACK_NUMEL", 2 * 48 * 32)  # two mlp weights
    distro = Distro(seeded_params(torch.float32, 0, "cpu"), 0.999, 16, 4, batched=True)
    names = [n for n, _ in distro.variables]
    assert distro.groups is not None
    named = [[names[i] for i in g] for g in distro.groups]
    assert ["layers.0.mlp", "layers.1.mlp"] in named
    assert ["layers.2.mlp"] in named
    assert ["embed"] in named  # larger than the limit alone: a stack of one


def test_the_per_parameter_route_is_the_default_on_the_cpu() -> None:
    assert Distro(seeded_params(torch.float32, 0, "cpu"), 0.999, 16, 4).groups is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batched_route_gives_the_per_parameter_bits_on_cuda(dtype: torch.dtype) -> None:
    assert Distro(seeded_params(dtype, 0, "cuda"), 0.999, 16, 4).groups is not None  # the default
    for chunk, topk in [(16, 4), (64, 8)]:
        for seed in range(3):
            _compare("cuda", dtype, chunk, topk, seed)
