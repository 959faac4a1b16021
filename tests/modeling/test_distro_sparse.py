"""DisTrO's sparse route (`Distro(sparse=True)`, `psyche.modeling.dct.SparseSynthesis`): the apply
of 1-bit results decodes from the kept coefficients as the signs of an exact integer synthesis.

What is tested: two independent instances give the same bits; so do the batched and the
per-parameter route, one and two threads, a contiguous and a strided parameter, and (on a GPU)
CUDA and the CPU; the signs are exactly those of an int64 reference computation, with many
entries on one coefficient too; the update differs from upstream's dense route in a few
coordinates in 10^4 only; results that are not 1-bit keep upstream's route; upstream's route
stays the default (its bits against the frozen reference: `test_distro_fast_paths`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psyche.modeling.compression import compress
from psyche.modeling.dct import SparseSynthesis, TransformDCT, _integer_basis_rows
from psyche.modeling.distro import Distro, DistroResult, quantize_results

from .distro_cases import (
    SHAPES,
    arriving_results,
    assert_same_bits,
    seeded_grads,
    seeded_params,
    sparse_steps,
)


def _assert_same_steps(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    for step, (xs, ys) in enumerate(zip(a, b), 1):
        for x, y in zip(xs, ys):
            assert_same_bits(x, y, f"step {step}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("chunk", "topk"), [(16, 4), (8, 3), (64, 8)])
def test_two_independent_instances_agree_bit_for_bit(
    dtype: torch.dtype, chunk: int, topk: int
) -> None:
    for seed in range(2):
        _assert_same_steps(
            sparse_steps(dtype, chunk, topk, seed), sparse_steps(dtype, chunk, topk, seed)
        )


def _apply_once(
    dtype: torch.dtype,
    results: list[list[DistroResult]],
    sparse: bool,
    batched: bool = False,
    device: str = "cpu",
    strided: bool = False,
) -> list[torch.Tensor]:
    """The weights after one apply of `results` from the same starting weights."""
    params = seeded_params(dtype, 7, "cpu")
    if strided:  # the same values in a transposed layout: not one plain view
        params = [
            (n, nn.Parameter(p.detach().mT.contiguous().mT)) if p.dim() > 1 else (n, p)
            for n, p in params
        ]
    params = [(n, nn.Parameter(p.detach().to(device))) for n, p in params]
    Distro(params, 0.999, 16, 4, sparse=sparse, batched=batched).apply(results, 1e-3)
    return [p.detach().cpu() for _, p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_apply_is_the_same_whatever_the_route_threads_or_layout(dtype: torch.dtype) -> None:
    results = arriving_results(dtype, 16, 4, 3, 4)
    plain = _apply_once(dtype, results, sparse=True)
    for x, y in zip(plain, _apply_once(dtype, results, sparse=True, batched=True)):
        assert_same_bits(x, y, "batched")
    for x, y in zip(plain, _apply_once(dtype, results, sparse=True, strided=True)):
        assert_same_bits(x, y, "strided")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = _apply_once(dtype, results, sparse=True)
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(plain, other):
        assert_same_bits(x, y, "threads")


@pytest.mark.parametrize("peers", [1, 4, 20])
@pytest.mark.parametrize(("n1", "n2"), [(16, 16), (64, 64), (12, 8), (32, 1)])
def test_the_signs_are_those_of_the_exact_integer_synthesis(peers: int, n1: int, n2: int) -> None:
    g = torch.Generator().manual_seed(peers * 100 + n1 + n2)
    blocks, totalk = 300, n1 * n2
    # few distinct positions, so that many entries land on one coefficient
    idx = torch.randint(0, min(totalk, 12), (blocks, peers * 4), generator=g)
    negative = torch.rand(idx.shape, generator=g) < 0.5
    synthesis = SparseSynthesis(TransformDCT([((n1, n2), torch.float32, "cpu")], max(n1, n2)))
    signs = synthesis.synthesize_signs(idx, negative, n1, n2, torch.bfloat16)

    # the reference: per block, the integer coefficient matrix and Q1^T M Q2 in int64
    q1 = torch.tensor(_integer_basis_rows(n1), dtype=torch.int64)
    q2 = torch.tensor(_integer_basis_rows(n2), dtype=torch.int64) if n2 > 1 else None
    counts = (idx.unsqueeze(-1) == idx.unsqueeze(-2)).sum(-1)
    share = (1024 + counts // 2) // counts
    weights = torch.where(negative, -share, share)
    dense = torch.zeros(blocks, totalk, dtype=torch.int64).scatter_add_(1, idx, weights)
    if q2 is None:
        y = dense @ q1
    else:
        y = q1.t() @ dense.view(blocks, n1, n2) @ q2
    expected = y.sign().view(blocks, n1, n2).to(torch.bfloat16)
    assert_same_bits(signs, expected, "signs")
    assert int((y == 0).sum()) < y.numel()


def test_the_integer_basis_is_upstreams_basis_rounded() -> None:
    for n in [*range(1, 65), 96, 128]:
        transform = TransformDCT([((n,), torch.float32, "cpu")], n)
        upstream = transform._b[(n, torch.float32, torch.device("cpu"))].double()
        q = torch.tensor(_integer_basis_rows(n), dtype=torch.float64)
        scaled = q * (upstream[0, 0] / 4096.0)  # row k = 0 is 2^12 exactly
        assert float((scaled - upstream).abs().max()) <= 2.0**-12 * float(upstream[0, 0]), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_update_differs_from_upstreams_route_in_a_few_coordinates(dtype: torch.dtype) -> None:
    # 64 x 64 blocks, the documented setting: 4 peers' top-8
    params = [("a", nn.Parameter(torch.zeros(256, 512, dtype=dtype)))]
    results = []
    for k in range(4):
        peer = [("a", nn.Parameter(torch.zeros(256, 512, dtype=dtype)))]
        g = torch.Generator().manual_seed(k)
        peer[0][1].grad = torch.randn(256, 512, generator=g).to(dtype)
        results.append(quantize_results(Distro(peer, 0.999, 64, 8).generate([], 0.0, 1.0)))
    weights = {}
    for sparse in (False, True):
        copy = [("a", nn.Parameter(params[0][1].detach().clone()))]
        Distro(copy, 0.999, 64, 8, sparse=sparse).apply(results, 1.0)
        weights[sparse] = copy[0][1].detach()
    differ = int((weights[True] != weights[False]).sum())
    assert int((weights[True] != 0).sum()) > 0.99 * weights[True].numel()
    assert differ <= 1e-3 * weights[True].numel(), differ


def test_generate_decodes_its_own_results_as_upstreams_route_does_within_rounding() -> None:
    params = {s: seeded_params(torch.float32, 5, "cpu") for s in (False, True)}
    distros = {s: Distro(params[s], 0.999, 16, 4, sparse=s) for s in (False, True)}
    for s in (False, True):
        seeded_grads(params[s], 11, drop_one=False)
    outs = {s: distros[s].generate([], 0.0, 1e-3) for s in (False, True)}
    for s in (False, True):
        seeded_grads(params[s], 12, drop_one=False)
        distros[s].generate([outs[s], outs[s]], 1e-3, 1e-3)
    for x, y in zip(distros[False].deltas, distros[True].deltas):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_that_are_not_one_bit_keep_upstreams_route(dtype: torch.dtype) -> None:
    params = seeded_params(dtype, 9, "cpu")
    seeded_grads(params, 9, drop_one=False)
    full = Distro(params, 0.999, 16, 4).generate([], 0.0, 1e-3)  # unquantized values
    results = [full, *arriving_results(dtype, 16, 4, 9, 2)]
    for x, y in zip(
        _apply_once(dtype, results, sparse=True), _apply_once(dtype, results, sparse=False)
    ):
        assert_same_bits(x, y, "full values")


def test_upstreams_dense_route_is_the_default() -> None:
    distro = Distro(seeded_params(torch.float32, 0, "cpu"), 0.999, 16, 4)
    assert distro.synthesis is None
    assert Distro(seeded_params(torch.float32, 0, "cpu"), 0.999, 16, 4, sparse=True).synthesis
    assert len(SHAPES) == len(distro.variables)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_apply_on_cuda_gives_the_cpus_bits(dtype: torch.dtype) -> None:
    results = arriving_results(dtype, 16, 4, 4, 4)
    cpu = _apply_once(dtype, results, sparse=True)
    on_cuda = [
        [DistroResult(r.sparse_idx.cuda(), r.sparse_val.cuda(), r.xshape, r.totalk) for r in result]
        for result in results
    ]
    for batched in (False, True):
        gpu = _apply_once(dtype, on_cuda, sparse=True, batched=batched, device="cuda")
        for x, y in zip(cpu, gpu):
            assert_same_bits(x, y, f"cuda, batched {batched}")


@pytest.mark.parametrize("shape", [(128, 256), (3, 128, 192), (256, 64), (64, 64)])
def test_the_top_k_read_from_the_block_rows_is_the_contiguous_copys(shape: tuple[int, ...]) -> None:
    """The sparse route's encode leaves its blocks in block-row order and `compress` reads them
    there (no transposing copy): the same indices and values, bit for bit."""
    transform = TransformDCT([(shape, torch.float32, "cpu")], 64)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    rows = transform.encode_separable(x, contiguous=False)
    copied = transform.encode_separable(x)
    assert torch.equal(rows, copied)
    idx, val, xshape, totalk = compress(rows, 8)
    ref_idx, ref_val, ref_xshape, ref_totalk = compress(copied, 8)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(val, ref_val)
    assert (xshape, totalk) == (ref_xshape, ref_totalk)
