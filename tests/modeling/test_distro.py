"""The DisTrO optimizer: op order of generate/apply, residual, sign-SGD step, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from psyche.core.batch_id import BatchId
from psyche.modeling.compression import (
    batch_decompress,
    compress,
    decompress_idx,
    index_width,
)
from psyche.modeling.distro import Distro, DistroResult, quantize_results, sorted_variables
from psyche.modeling.serialized_distro import transmittable_distro_result


def _params(dtype: torch.dtype, seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "model.layers.0.mlp.down_proj.weight": (96, 128),
        "model.layers.0.input_layernorm.weight": (128,),
        "lm_head.weight": (50, 128),
        "model.embed_tokens.weight": (50, 128),
    }
    return [
        (name, nn.Parameter((torch.randn(*shape, generator=g) * 0.02).to(dtype)))
        for name, shape in shapes.items()
    ]


def _set_grads(params: list[tuple[str, nn.Parameter]], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _clone(params: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    return [(n, nn.Parameter(p.detach().clone())) for n, p in params]


def test_variables_are_sorted_bytewise() -> None:
    names = ["model.layers.2.w", "model.layers.10.w", "lm_head.weight", "Zeta", "model.norm.weight"]
    params = [(n, nn.Parameter(torch.zeros(2))) for n in names]
    order = [n for n, _ in sorted_variables(params)]
    assert order == [
        "Zeta",
        "lm_head.weight",
        "model.layers.10.w",
        "model.layers.2.w",
        "model.norm.weight",
    ]
    wrapped = [("_orig_mod.b._checkpoint_wrapped_module.w", nn.Parameter(torch.zeros(2)))]
    assert sorted_variables(wrapped)[0][0] == "b.w"


def test_scalar_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="scalar"):
        Distro([("s", nn.Parameter(torch.tensor(1.0)))], 0.999, 64, 8)


def test_layouts_describe_every_result() -> None:
    params = _params(torch.float32)
    distro = Distro(params, 0.999, 32, 8)
    _set_grads(params, 1)
    results = distro.generate([], 0.0, 1e-3)
    for layout, result in zip(distro.layouts(), results):
        assert list(layout.xshape) == result.xshape
        assert layout.totalk == result.totalk
        assert tuple(result.sparse_idx.shape) == layout.idx_shape
        assert tuple(result.sparse_val.shape) == layout.val_shape
    by_name = {lay.name: lay for lay in distro.layouts()}
    assert by_name["lm_head.weight"].xshape == (2, 4, 25, 32)  # 50 -> chunk 25, 128 -> 32
    assert by_name["lm_head.weight"].index_bytes == 2  # 800 coefficients per block
    assert by_name["model.layers.0.input_layernorm.weight"].xshape == (4, 32)
    assert by_name["model.layers.0.input_layernorm.weight"].index_bytes == 1


def _reference_generate(
    params: list[tuple[str, nn.Parameter]],
    deltas: list[torch.Tensor],
    distro: Distro,
    prev: list[list[DistroResult]],
    prev_lr: float,
    lr: float,
    decay: float,
    wd: float,
    topk: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The spec's op list for `generate`, written out literally."""
    out = []
    for i, ((_, p), delta) in enumerate(zip(sorted_variables(params), deltas)):
        with torch.no_grad():
            p.add_(delta.sign() * prev_lr)
            if prev:
                vals = [r[i].sparse_val for r in prev]
                dense = batch_decompress(
                    [r[i].sparse_idx for r in prev],
                    vals,
                    prev[0][i].xshape,
                    prev[0][i].totalk,
                    p.dtype,
                    p.device,
                )
                delta.sub_(distro.transform.decode(dense))
            if wd != 0:
                p.mul_(1.0 - lr * wd)
            if decay != 1:
                delta.mul_(decay)
            delta.add_(p.grad * lr)
            idx, val, _, _ = compress(distro.transform.encode(delta), topk)
            out.append((idx, val))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_generate_follows_upstream_op_order(dtype: torch.dtype) -> None:
    decay, wd, chunk, topk = 0.9990000128746033, 0.10000000149011612, 32, 8
    params = _params(dtype)
    ref_params = _clone(params)
    distro = Distro(params, decay, chunk, topk, wd)
    ref_distro = Distro(ref_params, decay, chunk, topk, wd)
    ref_deltas = [torch.zeros_like(p) for _, p in sorted_variables(ref_params)]
    prev: list[list[DistroResult]] = []
    ref_prev: list[list[DistroResult]] = []
    for step in range(1, 5):
        lr, prev_lr = 1e-3 * step, 1e-3 * (step - 1)
        distro.error_correction(prev_lr)
        with torch.no_grad():
            for (_, p), d in zip(sorted_variables(ref_params), ref_deltas):
                p.sub_(d.sign() * prev_lr)
        _set_grads(params, step)
        _set_grads(ref_params, step)
        results = distro.generate(prev, prev_lr, lr)
        ref = _reference_generate(
            ref_params, ref_deltas, ref_distro, ref_prev, prev_lr, lr, decay, wd, topk
        )
        for r, (idx, val) in zip(results, ref):
            assert torch.equal(r.sparse_idx, idx)
            assert torch.equal(r.sparse_val, val)
        for (_, a), (_, b) in zip(params, ref_params):
            assert torch.equal(a, b)
        prev = [results]
        ref_prev = [[DistroResult(i, v, r.xshape, r.totalk) for (i, v), r in zip(ref, results)]]


def test_add_form_matters_in_bf16() -> None:
    """Why generate uses `add_(g * lr)`: the fused `alpha` form rounds differently in bf16."""
    g = torch.randn(100_000, generator=torch.Generator().manual_seed(3)).bfloat16()
    d = torch.randn(100_000, generator=torch.Generator().manual_seed(4)).bfloat16()
    lr = 3.7e-4
    assert not torch.equal(d.clone().add_(g * lr), d.clone().add_(g, alpha=lr))


def test_residual_removes_what_was_sent() -> None:
    """Sending every coefficient unquantized leaves (almost) nothing in the momentum."""
    params = [("w", nn.Parameter(torch.randn(64, 64, dtype=torch.float64)))]
    distro = Distro(params, 1.0, 64, 64 * 64)
    params[0][1].grad = torch.randn(64, 64, dtype=torch.float64)
    first = distro.generate([], 0.0, 0.5)
    assert torch.allclose(distro.deltas[0], params[0][1].grad * 0.5)
    params[0][1].grad = torch.zeros(64, 64, dtype=torch.float64)
    distro.generate([first], 0.5, 0.5)
    assert distro.deltas[0].abs().max().item() < 1e-5


def test_apply_is_a_sign_sgd_step_of_exactly_lr() -> None:
    params = _params(torch.float32)
    distro = Distro(params, 0.999, 32, 8)
    _set_grads(params, 7)
    results = quantize_results(distro.generate([], 0.0, 1e-3))
    with torch.no_grad():
        for _, p in params:
            p.zero_()  # so the step itself is visible exactly
    lr = 0.25
    distro.apply([results], lr)
    for _, p in params:
        step = p.detach()
        assert set(step.unique().tolist()) <= {-lr, 0.0, lr}
        assert step.abs().sum() > 0
        assert torch.equal(p.grad, torch.zeros_like(p))


def test_apply_means_over_peers() -> None:
    """Two peers pick the same coefficient with opposite signs: it cancels out."""
    w = nn.Parameter(torch.zeros(8))
    distro = Distro([("w", w)], 1.0, 8, 1)
    idx = torch.tensor([[3]], dtype=torch.uint8)
    plus = DistroResult(idx, torch.tensor([[False]]), [1, 8], 8)
    minus = DistroResult(idx, torch.tensor([[True]]), [1, 8], 8)
    distro.apply([[plus], [minus]], 1.0)
    assert torch.equal(w.detach(), torch.zeros(8))
    distro.apply([[plus], [plus], [minus]], 1.0)
    # mean 1/3 on one DCT coefficient decodes to a dense cosine: every weight moves by lr
    assert set(w.detach().abs().unique().tolist()) == {1.0}


def test_empty_apply_changes_nothing() -> None:
    params = _params(torch.float32)
    before = [p.detach().clone() for _, p in params]
    distro = Distro(params, 0.999, 32, 8, weight_decay=0.1)
    distro.apply([], 1.0)
    assert all(torch.equal(a, p) for a, (_, p) in zip(before, params))


def test_result_lists_must_match_the_model() -> None:
    params = _params(torch.float32)
    distro = Distro(params, 0.999, 32, 8)
    _set_grads(params, 1)
    results = distro.generate([], 0.0, 1e-3)
    with pytest.raises(ValueError, match="entries"):
        distro.apply([results[:-1]], 1e-3)
    with pytest.raises(TypeError, match="list of result lists"):
        distro.apply(results, 1e-3)  # type: ignore[arg-type]


def test_missing_gradient_counts_as_zero() -> None:
    params = _params(torch.float32)
    distro = Distro(params, 0.5, 32, 8)
    _set_grads(params, 1)
    params[0][1].grad = None
    results = distro.generate([], 0.0, 1e-3, stats=True)
    names = [n for n, _ in distro.variables]
    i = names.index(params[0][0])
    assert torch.equal(distro.deltas[i], torch.zeros_like(distro.deltas[i]))
    assert results[i].stats == {f"{names[i]}.delta_energy": 0.0, f"{names[i]}.grad_energy": 0.0}


def test_lookahead_is_undone_by_generate() -> None:
    params = [("w", nn.Parameter(torch.zeros(16)))]
    distro = Distro(params, 1.0, 16, 4)
    distro.deltas[0].copy_(torch.linspace(-1, 1, 16))
    distro.error_correction(0.5)
    assert torch.equal(params[0][1].detach(), -0.5 * torch.linspace(-1, 1, 16).sign())
    params[0][1].grad = torch.zeros(16)
    distro.generate([], 0.5, 0.0)
    assert torch.equal(params[0][1].detach(), torch.zeros(16))
    distro.zero_optim()
    assert torch.equal(distro.deltas[0], torch.zeros(16))


def _run(params: list[tuple[str, nn.Parameter]], steps: int) -> list[bytes]:
    distro = Distro(params, 0.999, 32, 4, weight_decay=0.1)
    prev: list[list[DistroResult]] = []
    payloads = []
    for step in range(1, steps + 1):
        lr, prev_lr = 1e-3, 1e-3 if step > 1 else 0.0
        distro.error_correction(prev_lr)
        _set_grads(params, 100 + step)
        results = distro.generate(prev, prev_lr, lr)
        sent = quantize_results(results)
        payloads.append(transmittable_distro_result(sent, step, 0, BatchId(step, step)).to_bytes())
        if prev:
            distro.apply([quantize_results(prev[0])], lr)
        prev = [results]
    return payloads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_instances_are_bit_identical(dtype: torch.dtype) -> None:
    a, b = _params(dtype, seed=5), _params(dtype, seed=5)
    assert _run(a, 6) == _run(b, 6)
    for (_, pa), (_, pb) in zip(a, b):
        assert torch.equal(pa, pb)


def test_apply_matches_upstreams_op_sequence_bit_for_bit() -> None:
    """Several peers (1-bit and full values mixed), bf16: same bits as upstream's literal ops."""
    from psyche.modeling.distro import unpack_tensor_sign_from_boolean

    peers = []
    for seed in range(3):
        params = _params(torch.bfloat16, seed=seed)
        distro = Distro(params, 0.999, 32, 8)
        _set_grads(params, 50 + seed)
        peers.append(distro.generate([], 0.0, 1e-3))
    results = [quantize_results(peers[0]), quantize_results(peers[1]), peers[2]]
    params = _params(torch.bfloat16, seed=9)
    ref_params = _clone(params)
    distro = Distro(params, 0.999, 32, 8)
    ref = Distro(ref_params, 0.999, 32, 8)
    lr = 3.7e-4
    distro.apply(results, lr)
    with torch.no_grad():
        for i, (_, p) in enumerate(ref.variables):
            idx = [r[i].sparse_idx for r in results]
            vals = [
                unpack_tensor_sign_from_boolean(r[i].sparse_val, p.dtype)
                if r[i].sparse_val.dtype == torch.bool
                else r[i].sparse_val
                for r in results
            ]
            dense = batch_decompress(
                idx, vals, results[0][i].xshape, results[0][i].totalk, p.dtype, "cpu"
            )
            p.grad = torch.zeros_like(p)
            p.grad.copy_(ref.transform.decode(dense))
            p.grad.sign_()
        for _, p in ref.variables:
            p.add_(p.grad, alpha=-lr)
    for (_, a), (_, b) in zip(params, ref_params):
        assert torch.equal(a, b)


def test_generate_sends_each_blocks_largest_magnitude_coefficients() -> None:
    """The selection checked with numpy against the momentum's DCT coefficients (mixed signs)."""
    topk = 8
    params = _params(torch.float32)
    distro = Distro(params, 0.999, 32, topk)
    _set_grads(params, 3)
    results = distro.generate([], 0.0, 1e-3)
    differs_from_signed = False
    for delta, result in zip(distro.deltas, results):
        blocks = distro.transform.encode(delta).numpy().reshape(-1, result.totalk)
        assert (blocks < 0).any()
        assert (blocks > 0).any()
        order = np.argsort(-np.abs(blocks), axis=-1, kind="stable")[:, :topk]
        signed = np.argsort(-blocks, axis=-1, kind="stable")[:, :topk]
        differs_from_signed |= any(set(a) != set(b) for a, b in zip(order, signed))
        width = index_width(result.totalk)
        idx = decompress_idx(result.totalk, result.sparse_idx).reshape(-1, topk)
        val = result.sparse_val.reshape(-1, topk).numpy()
        assert result.sparse_idx.shape[-1] == topk * width
        for row, top, got_idx, got_val in zip(blocks, order, idx.tolist(), val):
            assert dict(zip(got_idx, got_val.tolist())) == {int(i): float(row[i]) for i in top}
    assert differs_from_signed  # the precondition: a signed top-k would have chosen otherwise
