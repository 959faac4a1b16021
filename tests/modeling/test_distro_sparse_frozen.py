"""The sparse route's bits are those of its first version (c1f6359), which this file freezes
where later work changed the code: the momentum's steps in `generate` went from whole-tensor
passes (with this node's own results decoded by one product per group) to a few block rows at
a time (`Distro._step_momentum`, `ValueSynthesis.values`), and the count of entries on each
coefficient from an int64 sum to a uint8 one (`dct._entry_counts`). A run whose clients mix
the two versions must still agree: every payload, weight and momentum bit is compared, step
by step, in float32 and bfloat16, with weight decay, a missing gradient, two own result lists
(coefficients hit twice) and ranges forced small (several per parameter)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from psyche.modeling import dct, distro
from psyche.modeling.dct import _rows
from psyche.modeling.distro import (
    Distro,
    DistroResult,
    ValueSynthesis,
    _block_dims,
    _block_view,
    _update_blocks,
    unpack_tensor_sign_from_boolean,
)

from .distro_cases import assert_same_bits, sparse_steps


def _frozen_entry_counts(idx: torch.Tensor) -> torch.Tensor:
    """c1f6359's `dct._entry_counts`."""
    blocks, entries = idx.shape
    if entries <= 64:
        return (idx.unsqueeze(-1) == idx.unsqueeze(-2)).sum(-1)
    span = int(idx.max()) + 1 if idx.numel() else 1
    keys = torch.arange(blocks, device=idx.device).unsqueeze(1) * span + idx
    unique = torch.unique(keys, return_inverse=True, return_counts=True)
    return unique[2][unique[1]]


def _frozen_synthesize_values(
    transform: dct.TransformDCT,
    idx: torch.Tensor,
    values: torch.Tensor,
    n1: int,
    n2: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """c1f6359's `SparseSynthesis.synthesize_values`: one product for a whole group."""
    counts = _frozen_entry_counts(idx)
    proto = like.new_empty((), dtype=torch.float32)
    share = values.to(torch.float32) / counts.to(torch.float32)
    rows, cols = (idx, None) if n2 == 1 else (idx.div(n2, rounding_mode="floor"), idx % n2)
    b1 = transform._basis(transform._b, n1, proto)
    a = _rows(b1, rows).mul_(share.unsqueeze(-1))
    if cols is None:
        y = a.sum(1).unsqueeze(-1)
    else:
        b2 = transform._basis(transform._b, n2, proto)
        y = torch.bmm(a.transpose(1, 2), _rows(b2, cols))
    return y.to(like.dtype)


@dataclass(frozen=True)
class _FrozenValues(ValueSynthesis):
    """A group's own decode computed whole by c1f6359's code, read by ranges."""

    blocks: torch.Tensor

    def values(self, start: int, end: int) -> torch.Tensor:
        return self.blocks[start:end]


class _Frozen(Distro):
    """c1f6359's sparse route: its own results' decode (one product per group) and momentum
    steps (whole tensors), in both the per-parameter and the batched route."""

    def _prepare_own(
        self, results: Sequence[Sequence[DistroResult]]
    ) -> list[tuple[ValueSynthesis, int]] | None:
        assert self.sparse_groups is not None
        out: list[tuple[ValueSynthesis, int] | None] = [None] * len(self.variables)
        for group in self.sparse_groups:
            like = self.variables[group[0]][1]
            xshape, idx, val = self._sparse_entries(results, group)
            n1, n2 = _block_dims(xshape)
            if val.dtype == torch.bool:
                val = unpack_tensor_sign_from_boolean(val, like.dtype)
            blocks = _frozen_synthesize_values(self.transform, idx, val, n1, n2, like)
            none = torch.empty(0)
            frozen = _FrozenValues(none, none, none, None, None, like.dtype, blocks)
            for j, index in enumerate(group):
                out[index] = (frozen, j * (idx.shape[0] // len(group)))
        return [entry for entry in out if entry is not None]

    def _step_momentum(
        self,
        index: int,
        grad: torch.Tensor,
        own: tuple[ValueSynthesis, int] | None,
        prev_lr: float,
        lr: float,
    ) -> None:
        (_, p), delta = self.variables[index], self.deltas[index]
        p.add_(delta.sign(), alpha=prev_lr)
        if own is not None:
            xshape = self.layouts_xshape(index)
            lead = _block_view(xshape)[:-1]
            blocks = own[0].values(own[1], own[1] + math.prod(lead))
            _update_blocks(delta, blocks.view(*lead, *_block_dims(xshape)), -1.0, xshape)
        if self.weight_decay != 0.0:
            p.mul_(1.0 - lr * self.weight_decay)
        if self.compression_decay != 1.0:
            delta.mul_(self.compression_decay)
        delta.add_(grad, alpha=lr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("chunk", "topk"), [(8, 3), (16, 4)])
def test_the_sparse_route_keeps_its_first_versions_bits(
    dtype: torch.dtype, chunk: int, topk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(distro, "MOMENTUM_CHUNK", 2)  # several ranges per parameter
    monkeypatch.setattr(distro, "SYNTHESIS_CHUNK", 3)
    for seed, batched in ((0, False), (1, False), (2, True)):
        now = sparse_steps(dtype, chunk, topk, seed, batched=batched)
        with monkeypatch.context() as frozen:
            frozen.setattr(dct, "_entry_counts", _frozen_entry_counts)
            then = sparse_steps(dtype, chunk, topk, seed, _Frozen, batched=batched)
        assert len(now) == len(then) == 4
        for step, (xs, ys) in enumerate(zip(now, then), 1):
            assert len(xs) == len(ys)
            for x, y in zip(xs, ys):
                assert_same_bits(x, y, f"seed {seed}, batched {batched}, step {step}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n1", "n2", "entries"), [(64, 64, 16), (8, 8, 6), (32, 1, 5)])
def test_a_range_of_the_own_decode_is_the_whole_reads(
    dtype: torch.dtype, n1: int, n2: int, entries: int
) -> None:
    g = torch.Generator().manual_seed(n1 + entries)
    blocks = 300
    idx = torch.randint(0, n1 * n2, (blocks, entries), generator=g)
    idx[:, 1] = idx[:, 0]  # a coefficient hit twice in every block
    values = torch.randn(blocks, entries, generator=g).to(dtype)
    like = torch.empty((), dtype=dtype)
    transform = dct.TransformDCT([((n1 * 4, n2 * 4), dtype, "cpu")], max(n1, n2))
    synthesis = dct.SparseSynthesis(transform).prepare_values(idx, values, n1, n2, like)
    whole = synthesis.values(0, blocks)
    assert whole.shape == (blocks, n1, n2)
    assert whole.dtype == dtype
    frozen = _frozen_synthesize_values(transform, idx, values, n1, n2, like)
    assert_same_bits(whole, frozen, "whole read")
    for step in (1, 7, 256):
        parts = [synthesis.values(s, min(s + step, blocks)) for s in range(0, blocks, step)]
        assert_same_bits(torch.cat(parts), whole, f"ranges of {step}")
