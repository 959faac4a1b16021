"""Top-k sparsification of DCT blocks and its inverse, with index byte views sized to the block.

Indices travel as the raw little-endian bytes of the narrowest unsigned type that holds the block
size (`uint8` up to 256 coefficients, `uint16` up to 65536, `uint32` beyond); those bytes are what
the commitment hash covers, so the choice must match upstream exactly.

`decompress` is upstream's dense scatter-mean, but it only takes that route when it must: the
mean of the values that land on one coefficient is computed from the touched coefficients alone
whenever that provably gives the same bits (see `_sparse_mean`), which for DisTrO's 1-bit payloads
is always (the per-coefficient sums of +-1 values are small exact integers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

U8_LIMIT = 256
U16_LIMIT = 65536
U32_LIMIT = 4294967296

# Below this many coefficients upstream's dense op costs no more than the index bookkeeping of
# the sparse route and the column-major layout, so small tensors keep the plain route (both give
# the same bits; this is only about speed).
FAST_ROUTE_MIN_NUMEL = 1 << 15

# Largest n such that every integer in [-n, n] is exact in the dtype: a running sum of at most n
# values of +-1 never rounds there.
_EXACT_INTEGERS = {
    torch.bfloat16: 2**8,
    torch.float16: 2**11,
    torch.float32: 2**24,
    torch.float64: 2**53,
}


def index_width(max_value: int) -> int:
    """Bytes per transmitted index for blocks of `max_value` coefficients (8 = raw int64)."""
    if max_value <= U8_LIMIT:
        return 1
    if max_value <= U16_LIMIT:
        return 2
    if max_value <= U32_LIMIT:
        return 4
    return 8


def compress_idx(max_value: int, idx: torch.Tensor) -> torch.Tensor:
    """int64 indices -> byte view (last dim grows by the index width)."""
    if max_value <= U8_LIMIT:
        return idx.to(torch.uint8)
    if max_value <= U16_LIMIT:
        return idx.to(torch.uint16).view(torch.uint8)
    if max_value <= U32_LIMIT:
        return idx.to(torch.uint32).view(torch.uint8)
    return idx


def decompress_idx(max_value: int, idx: torch.Tensor) -> torch.Tensor:
    """Byte view from `compress_idx` -> int64 indices."""
    if max_value <= U8_LIMIT:
        viewed = idx.view(torch.uint8)
    elif max_value <= U16_LIMIT:
        viewed = idx.view(torch.uint16)
    elif max_value <= U32_LIMIT:
        viewed = idx.view(torch.uint32)
    else:
        viewed = idx
    return viewed.to(torch.int64)


def clamp_topk(last_dim: int, topk: int) -> int:
    if topk > last_dim:
        return last_dim
    if topk < 1:
        return 1
    return topk


def compress(
    x: torch.Tensor, topk: int, magnitudes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """Keep the `topk` largest-magnitude coefficients of each block.

    Returns `(idx bytes, signed values, xshape, totalk)`; blocks are the last dimension, or the
    last two flattened for encoded 2-D parameters. The top-k is unsorted, as upstream's.
    `magnitudes` (the blocks' shape, contiguous), used for blocks stored as block rows only,
    receives `|x|` in place of a fresh tensor.
    """
    xshape = list(x.shape)
    if len(xshape) > 2 and not x.is_contiguous() and x.transpose(-3, -2).is_contiguous():
        return _compress_block_rows(x, topk, magnitudes)
    if len(xshape) > 2:
        # `reshape`, not `view`: the encoded tensor is contiguous on the CPU but a permuted view
        # of the einsum's output on CUDA (the values, and so the top-k, are the same either way)
        x = x.reshape(*xshape[:-2], xshape[-2] * xshape[-1])
    totalk = x.shape[-1]
    k = clamp_topk(totalk, topk)
    idx = x.abs().topk(k, dim=-1, largest=True, sorted=False).indices
    val = x.gather(-1, idx)
    return compress_idx(totalk, idx), val, xshape, totalk


def _compress_block_rows(
    x: torch.Tensor, topk: int, magnitudes: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """`compress` of encoded blocks `[..., I, J, n1, n2]` stored as block rows `[..., I, n1, J,
    n2]` (`TransformDCT.encode_separable(contiguous=False)`): the magnitudes are written in
    block order as they are taken (one pass instead of a transposing copy and then `abs`), and
    the kept values are read from the block rows where they lie. The same top-k input and the
    same values as `compress` of the contiguous copy, so the same bits."""
    xshape = list(x.shape)
    n1, n2 = xshape[-2], xshape[-1]
    totalk = n1 * n2
    k = clamp_topk(totalk, topk)
    if magnitudes is None:
        magnitudes = torch.empty(xshape, dtype=x.dtype, device=x.device)
    torch.abs(x, out=magnitudes)
    idx = magnitudes.view(*xshape[:-2], totalk).topk(k, dim=-1, largest=True, sorted=False).indices
    rows = x.transpose(-3, -2)  # contiguous [R, n1, J, n2] once leading dims are flattened
    blocks_j = xshape[-3]
    flat = idx.view(-1, blocks_j, k)
    r = torch.arange(flat.shape[0], device=x.device).view(-1, 1, 1)
    j = torch.arange(blocks_j, device=x.device).view(1, -1, 1)
    offset = ((r * n1 + flat.div(n2, rounding_mode="floor")) * blocks_j + j) * n2 + flat % n2
    val = rows.reshape(-1).take(offset).view(idx.shape)
    return compress_idx(totalk, idx), val, xshape, totalk


def decompress(
    idx: torch.Tensor,
    val: torch.Tensor,
    xshape: Sequence[int],
    totalk: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    transposed: bool = False,
) -> torch.Tensor:
    """Scatter values back into dense blocks; colliding indices average (untouched stay 0).

    The result has exactly the bits of upstream's `zeros(xshape).scatter_reduce_(-1, idx, val,
    "mean", include_self=False)`. With `transposed` (encoded 2-D parameters only) each block is
    stored column-major: same logical shape and values, the last two dims swapped in memory,
    which is the order `TransformDCT.decode` reads (see `dct.decode_reads_transposed`).
    Tensors of fewer than `FAST_ROUTE_MIN_NUMEL` coefficients always take upstream's plain
    route (and ignore `transposed`): there it is as fast.
    """
    totalk = abs(totalk)
    idx = decompress_idx(totalk, idx)
    val = val.to(dtype)
    xshape = list(xshape)
    dense = torch.zeros(math.prod(xshape), dtype=dtype, device=device)
    # upstream scatters along the last dim of this view (a 2-D parameter's blocks flattened)
    blocks = [*xshape[:-2], xshape[-2] * xshape[-1]] if len(xshape) > 2 else xshape
    # small tensors, and indices upstream's scatter rejects (it raises below), take its route
    fast = dense.numel() >= FAST_ROUTE_MIN_NUMEL and _in_range(idx, blocks[-1])
    transposed = fast and transposed and len(xshape) > 2
    if transposed:
        n1, n2 = xshape[-2], xshape[-1]
        # coefficient k*n2 + l of a block sits at l*n1 + k once the block is column-major
        idx = (idx % n2) * n1 + idx // n2
    if not (fast and _sparse_mean(idx, val, blocks, dense)):
        dense.view(blocks).scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
    if transposed:
        return dense.view(*xshape[:-2], xshape[-1], xshape[-2]).transpose(-1, -2)
    return dense.view(xshape)


def _in_range(idx: torch.Tensor, block: int) -> bool:
    if idx.numel() == 0:
        return True
    low, high = torch.aminmax(idx)
    return int(low) >= 0 and int(high) < block


def _sparse_mean(
    idx: torch.Tensor, val: torch.Tensor, blocks: list[int], dense: torch.Tensor
) -> bool:
    """Write into `dense` (flat, zeros) the scatter-mean along the last dim of
    `dense.view(blocks)` from the touched coefficients alone; False (`dense` untouched) where
    that is not provably bit-identical to upstream's dense op.

    Upstream's mean sets every touched coefficient to +0, adds the values that land on it (in
    index order on a CPU, in atomic order on CUDA), counts them in the dtype, and divides sum
    by count in the dtype (untouched ones: 0 / 1 = +0). Two cases reproduce that exactly
    without a pass over the dense tensor:

    * every touched coefficient got one value `v` (no duplicate index): the mean is
      `(+0 + v) / 1`, computed here with the same elementwise ops, so the bits agree for
      every non-NaN `v` (-0 becomes +0 in both); NaN payload bits may differ between kernels,
      so any NaN takes the dense route;
    * every value is +1 or -1 (1-bit payloads) and no coefficient got more values than the
      dtype holds exact integers: then every partial sum is an exact integer, whatever the
      order, so the sum is `count - 2 * negatives`, counted in int64 here, and the division
      is the same `div_` of the same two numbers in the dtype. (This is also why upstream's
      own op is deterministic on CUDA for 1-bit payloads.)

    Only integer sorts and writes to distinct positions are used (deterministic on CUDA too:
    no float atomics). The caller has checked that every index is in range; shapes that
    upstream's op would broadcast return False, so that the caller runs upstream's op.
    """
    *lead, block = blocks
    dtype = dense.dtype
    if not dtype.is_floating_point or idx.numel() == 0:
        return False
    if list(idx.shape) != [*lead, idx.shape[-1]] or val.shape != idx.shape:
        return False
    rows = math.prod(lead)
    offsets = torch.arange(rows, device=idx.device, dtype=torch.int64).mul_(block)
    keys = (idx.reshape(rows, -1) + offsets.unsqueeze(1)).reshape(-1)
    values = val.reshape(-1)
    touched, counts = torch.unique(keys, sorted=True, return_counts=True)
    if touched.numel() == keys.numel():
        if bool(torch.isnan(values).any()):
            return False
        # upstream: scatter_(+0), += v, count 1, div_ -- the same three ops, on the values only
        dense[keys] = torch.zeros_like(values).add_(values).div_(torch.ones_like(values))
        return True
    limit = _EXACT_INTEGERS.get(dtype)
    if limit is None or not bool(((values == 1) | (values == -1)).all()):
        return False
    if int(counts.max()) > limit:
        return False
    neg_keys, neg_counts = torch.unique(keys[values < 0], sorted=True, return_counts=True)
    negatives = torch.zeros_like(counts)
    negatives[torch.searchsorted(touched, neg_keys)] = neg_counts
    sums = counts - 2 * negatives
    dense[touched] = sums.to(dtype).div_(counts.to(dtype))
    return True


def batch_decompress(
    idx: Sequence[torch.Tensor],
    val: Sequence[torch.Tensor],
    xshape: Sequence[int],
    totalk: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Decompress many peers' results for one parameter at once: per-coefficient mean over the
    peers that selected it."""
    idx_concat = torch.cat(list(idx), -1).to(device)
    val_concat = torch.cat(list(val), -1).to(device)
    return decompress(idx_concat, val_concat, xshape, totalk, dtype, device)


class CompressDCT:
    """Upstream's name for the compress/decompress pair."""

    compress = staticmethod(compress)
    decompress = staticmethod(decompress)
    batch_decompress = staticmethod(batch_decompress)
