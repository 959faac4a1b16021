"""Top-k sparsification of DCT blocks and its inverse, with index byte views sized to the block.

Indices travel as the raw little-endian bytes of the narrowest unsigned type that holds the block
size (`uint8` up to 256 coefficients, `uint16` up to 65536, `uint32` beyond); those bytes are what
the commitment hash covers, so the choice must match upstream exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

U8_LIMIT = 256
U16_LIMIT = 65536
U32_LIMIT = 4294967296


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


def compress(x: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """Keep the `topk` largest-magnitude coefficients of each block.

    Returns `(idx bytes, signed values, xshape, totalk)`; blocks are the last dimension, or the
    last two flattened for encoded 2-D parameters. The top-k is unsorted, as upstream's.
    """
    xshape = list(x.shape)
    if len(xshape) > 2:
        x = x.view(*xshape[:-2], xshape[-2] * xshape[-1])
    totalk = x.shape[-1]
    k = clamp_topk(totalk, topk)
    idx = x.abs().topk(k, dim=-1, largest=True, sorted=False).indices
    val = x.gather(-1, idx)
    return compress_idx(totalk, idx), val, xshape, totalk


def decompress(
    idx: torch.Tensor,
    val: torch.Tensor,
    xshape: Sequence[int],
    totalk: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Scatter values back into dense blocks; colliding indices average (untouched stay 0)."""
    totalk = abs(totalk)
    idx = decompress_idx(totalk, idx)
    val = val.to(dtype)
    xshape = list(xshape)
    x = torch.zeros(xshape, dtype=dtype, device=device)
    if len(xshape) > 2:
        x = x.view(*xshape[:-2], xshape[-2] * xshape[-1])
    x.scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
    return x.reshape(xshape)


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
