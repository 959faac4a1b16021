"""How a DiLoCo pseudo-gradient travels: three forms, their checks, and a device-exact decode.

A payload is a `TransmittableDistroResult` (the blob type every Psyche client already hashes,
commits, witnesses and downloads) with one `SerializedDistroResult` per parameter, in DisTrO's
variable order (sorted by name). Its two tensors mean, per form:

| form     | `sparse_idx`                              | `sparse_val`                                      | `xshape` | `totalk` |
|----------|-------------------------------------------|---------------------------------------------------|----------|----------|
| `Bf16`   | uint8, `[0]`                              | bfloat16, the parameter's shape                   | `[]`     | 0        |
| `Int8`   | float32 `[groups]`: one scale per group   | int8 codes in [-127, 127], the parameter's shape  | `[]`     | group    |
| `Sparse` | DisTrO's index bytes, `[*blocks, k * w]`  | uint8 `[*blocks, 2 + ceil(k * bits / 8)]`: a bf16 | DisTrO's | DisTrO's |
|          |                                           | block scale, then k packed `bits`-bit codes       |          |          |

Int8 groups are runs of `compression_chunk**2` values of the flattened parameter (the last one
shorter); a value is `code * scale`. A sparse block is DisTrO's (`result_layouts`: a chunk x chunk
DCT block of a matrix, a chunk of a vector) with its top-k coefficients; code `q` of `b` bits
stands for `scale * (2q - (2^b - 1)) / (2^b - 1)`, so 1 bit is `+-scale` and 2 bits are
`+-scale, +-scale/3`. Both tensors' bytes are covered by the commitment hash.

`validate` refuses anything that is not exactly this for the receiver's model (kinds, dims,
byte lengths, scales finite, non-negative and at most `MAX_ABS_VALUE`, codes in range, indices
in range and distinct within a block, padding bits zero) before a tensor is built, raising
`InvalidDistroResult` with the reason.

`accumulate` adds one payload's decoded values into float32 accumulators using only elementwise
tensor ops (no matmul, no reduction, no FMA-fusable op), in the payload's own slot order: IEEE
rounding makes each op give the same bits on any CPU or GPU, so the sum over peers taken in a
fixed order is the same everywhere. The sparse form's inverse DCT is written as a sum over the
kept coefficients of `value * (basis column outer basis column)`, with the basis from `basis`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from psyche.core.definitions import DilocoTransmission
from psyche.modeling.compression import compress, decompress_idx, index_width
from psyche.modeling.diloco.basis import dct_basis
from psyche.modeling.distro import DistroResult, ResultLayout, result_layouts
from psyche.modeling.serialized_distro import (
    KIND_BFLOAT16,
    KIND_NAMES,
    KIND_UINT8,
    EntryBound,
    InvalidDistroResult,
    SerializedDistroResult,
    _check_tensor_bytes,
    torch_from_serializable_tensor,
)

KIND_INT8 = 1
KIND_FLOAT = 6

# The largest magnitude a pseudo-gradient value may have: a weight moved by more than this in
# one round means a broken or hostile peer, and the bound keeps every float32 sum of up to 2^16
# peers finite.
MAX_ABS_VALUE = 65536.0


@dataclass(frozen=True)
class DilocoLayout:
    """What one parameter's payload entry must look like."""

    name: str
    shape: tuple[int, ...]
    transmission: DilocoTransmission
    group: int = 0
    """Int8: values per scale."""
    sparse: ResultLayout | None = None
    """Sparse: DisTrO's block layout (xshape, totalk, top-k, index width)."""
    value_bits: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def groups(self) -> int:
        return -(-self.numel // self.group) if self.group else 0

    @property
    def row_bytes(self) -> int:
        """Sparse: bytes per block in `sparse_val` (scale, then packed codes)."""
        assert self.sparse is not None
        return 2 + -(-self.sparse.topk * self.value_bits // 8)


def diloco_layouts(
    variables: Sequence[tuple[str, Sequence[int]]],
    transmission: DilocoTransmission,
    *,
    chunk: int,
    topk: int,
    value_bits: int,
) -> list[DilocoLayout]:
    """Layouts from parameter names and shapes alone, in the given (DisTrO's) order."""
    out = []
    for name, shape in variables:
        shape = tuple(int(s) for s in shape)
        match transmission:
            case DilocoTransmission.Bf16:
                out.append(DilocoLayout(name, shape, transmission))
            case DilocoTransmission.Int8:
                out.append(DilocoLayout(name, shape, transmission, group=chunk * chunk))
            case DilocoTransmission.Sparse:
                if not shape:
                    raise ValueError(
                        f"parameter {name!r} is a scalar: the sparse form takes parameters of "
                        "one dimension or more"
                    )
                (sparse,) = result_layouts([(name, shape, torch.float32)], chunk, topk)
                out.append(
                    DilocoLayout(name, shape, transmission, sparse=sparse, value_bits=value_bits)
                )
    return out


# --------------------------------------------------------------------------------------------
# Encoding (the sender: nothing here needs to be bit-identical across devices)


def _levels(bits: int) -> int:
    return (1 << bits) - 1


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`[rows, k]` codes of `bits` bits -> `[rows, ceil(k * bits / 8)]` bytes, LSB first."""
    rows, k = codes.shape
    per_byte = 8 // bits
    padded = -(-k // per_byte) * per_byte
    c = torch.zeros(rows, padded, dtype=torch.int32, device=codes.device)
    c[:, :k] = codes.to(torch.int32)
    c = c.view(rows, -1, per_byte)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def _unpack_codes(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of `_pack_codes`: `[rows, nbytes]` -> `[rows, k]` int32 codes (and the rest)."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & _levels(bits)
    return codes.reshape(packed.shape[0], -1)


def _bf16_bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 `[rows]` -> `[rows, 2]` little-endian bfloat16 bytes."""
    b = values.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([b & 0xFF, b >> 8], -1).to(torch.uint8)


def _bf16_from_bytes(raw: torch.Tensor) -> torch.Tensor:
    """`[rows, 2]` bytes -> float32 `[rows]` (exact: every bf16 is a float32)."""
    bits = raw[:, 0].to(torch.int32) | (raw[:, 1].to(torch.int32) << 8)
    return (bits << 16).view(torch.float32)


def _encode_dct(x: torch.Tensor, layout: DilocoLayout) -> torch.Tensor:
    """DisTrO's block transform of `x` (float32), shaped `layout.sparse.xshape`. A parameter of
    three dimensions or more (a MoE layer's grouped experts, `[experts, out, in]`) is blocked as
    DisTrO blocks it: its last two dimensions, the leading ones a batch of matrices, which is
    the 2-D transform of the parameter seen as `[experts * out, in]` (the same arithmetic)."""
    assert layout.sparse is not None
    xshape = layout.sparse.xshape
    if len(layout.shape) >= 2:
        *lead, rows, cols, n1, n2 = xshape
        f1 = dct_basis(n1).to(x.device)
        f2 = dct_basis(n2).to(x.device)
        blocks = x.reshape(math.prod(lead) * rows, n1, cols, n2)
        return torch.einsum("ijkl,jb,ld->ikbd", blocks, f1, f2).reshape(xshape)
    count, n1 = xshape
    return x.reshape(count, n1) @ dct_basis(n1).to(x.device)


def encode(
    x: torch.Tensor, layout: DilocoLayout, domain: list[torch.Tensor] | None = None
) -> DistroResult:
    """One parameter's pseudo-gradient (float32, the parameter's shape) in its sent form.

    Values beyond `MAX_ABS_VALUE` are clamped first (the receiver would refuse them). With
    `domain`, what was compressed is appended to it as the payloads' domain reads it (the
    sparse form's DCT coefficients, the clamped values otherwise): a witness's reference."""
    x = x.detach().to(torch.float32).clamp(-MAX_ABS_VALUE, MAX_ABS_VALUE)
    if domain is not None and layout.transmission is not DilocoTransmission.Sparse:
        domain.append(x)
    device = x.device
    match layout.transmission:
        case DilocoTransmission.Bf16:
            return DistroResult(
                torch.empty(0, dtype=torch.uint8, device=device), x.to(torch.bfloat16), [], 0
            )
        case DilocoTransmission.Int8:
            flat = x.reshape(-1)
            groups, group = layout.groups, layout.group
            padded = torch.zeros(groups * group, dtype=torch.float32, device=device)
            padded[: flat.numel()] = flat
            g = padded.view(groups, group)
            scale = g.abs().amax(1) / 127.0
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes = torch.round(g / safe.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
            values = codes.reshape(-1)[: flat.numel()].reshape(layout.shape)
            return DistroResult(scale, values, [], group)
        case DilocoTransmission.Sparse:
            assert layout.sparse is not None
            coefficients = _encode_dct(x, layout)
            if domain is not None:
                domain.append(coefficients)
            idx, val, xshape, totalk = compress(coefficients, layout.sparse.topk)
            blocks = layout.sparse.block_shape
            k = val.shape[-1]
            rows = val.reshape(-1, k)
            levels = _levels(layout.value_bits)
            scale = _bf16_from_bytes(_bf16_bytes(rows.abs().amax(1)))
            safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
            codes = torch.round((rows / safe + 1.0) * (levels / 2.0)).clamp_(0, levels)
            packed = _pack_codes(codes, layout.value_bits)
            sent = torch.cat([_bf16_bytes(scale), packed], 1).reshape(*blocks, -1)
            return DistroResult(idx, sent, xshape, totalk)
    raise ValueError(f"unknown transmission {layout.transmission!r}")


# --------------------------------------------------------------------------------------------
# Checking a received entry (deterministic: every honest node refuses the same payloads)


def _reject(layout: DilocoLayout, message: str) -> InvalidDistroResult:
    return InvalidDistroResult(f"{layout.name}: {message}")


def _expect(t_kind: int, t_dims: list[int], kind: int, dims: tuple[int, ...], what: str) -> None:
    if t_kind != kind:
        raise InvalidDistroResult(f"{what} kind {KIND_NAMES[t_kind]}, expected {KIND_NAMES[kind]}")
    if tuple(t_dims) != dims:
        raise InvalidDistroResult(f"{what} dims {list(t_dims)}, expected {list(dims)}")


def validate(result: SerializedDistroResult, layout: DilocoLayout) -> None:
    """Raise `InvalidDistroResult` unless `result` is a well-formed entry for `layout`."""
    idx, val = result.sparse_idx, result.sparse_val
    what = layout.name
    _check_tensor_bytes(idx, f"{what}.sparse_idx")
    _check_tensor_bytes(val, f"{what}.sparse_val")
    match layout.transmission:
        case DilocoTransmission.Bf16:
            if result.xshape or result.totalk != 0:
                raise _reject(layout, "a bf16 entry has xshape [] and totalk 0")
            _expect(idx.kind, idx.dims, KIND_UINT8, (0,), f"{what}.sparse_idx")
            _expect(val.kind, val.dims, KIND_BFLOAT16, layout.shape, f"{what}.sparse_val")
            values = torch_from_serializable_tensor(val).to(torch.float32)
            if values.numel() and not bool(values.abs().le(MAX_ABS_VALUE).all()):
                raise _reject(layout, f"a value is NaN, infinite or beyond {MAX_ABS_VALUE:g}")
        case DilocoTransmission.Int8:
            if result.xshape or result.totalk != layout.group:
                raise _reject(layout, f"an int8 entry has xshape [] and totalk {layout.group}")
            _expect(idx.kind, idx.dims, KIND_FLOAT, (layout.groups,), f"{what}.sparse_idx")
            _expect(val.kind, val.dims, KIND_INT8, layout.shape, f"{what}.sparse_val")
            scales = torch_from_serializable_tensor(idx)
            if scales.numel() and not bool(
                (scales.ge(0.0) & scales.le(MAX_ABS_VALUE / 127.0)).all()
            ):
                raise _reject(
                    layout, f"a scale is negative, NaN, or beyond {MAX_ABS_VALUE / 127.0:g}"
                )
            codes = np.frombuffer(val.raw_tensor_data(), dtype=np.int8)
            if codes.size and int(codes.min()) < -127:
                raise _reject(layout, "an int8 code is -128 (codes are in [-127, 127])")
        case DilocoTransmission.Sparse:
            _validate_sparse(result, layout)


def _validate_sparse(result: SerializedDistroResult, layout: DilocoLayout) -> None:
    sparse = layout.sparse
    assert sparse is not None
    idx, val = result.sparse_idx, result.sparse_val
    what = layout.name
    if tuple(result.xshape) != sparse.xshape:
        raise _reject(layout, f"xshape {result.xshape}, expected {list(sparse.xshape)}")
    if result.totalk != sparse.totalk:
        raise _reject(layout, f"totalk {result.totalk}, expected {sparse.totalk}")
    _expect(idx.kind, idx.dims, KIND_UINT8, sparse.idx_shape, f"{what}.sparse_idx")
    row_shape = (*sparse.block_shape, layout.row_bytes)
    _expect(val.kind, val.dims, KIND_UINT8, row_shape, f"{what}.sparse_val")
    dtype = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<i8"}[sparse.index_bytes]
    indices = np.frombuffer(idx.raw_tensor_data(), dtype=dtype).astype(np.int64)
    if indices.size:
        if int(indices.max()) >= sparse.totalk or int(indices.min()) < 0:
            raise _reject(
                layout,
                f"index {int(indices.max())} out of range for blocks of {sparse.totalk}",
            )
        rows = np.sort(indices.reshape(-1, sparse.topk), axis=1)
        if sparse.topk > 1 and bool((rows[:, 1:] == rows[:, :-1]).any()):
            raise _reject(layout, "an index repeats within a block")
    raw = np.frombuffer(val.raw_tensor_data(), dtype=np.uint8).reshape(-1, layout.row_bytes)
    if raw.size:
        scales = _bf16_from_bytes(torch.from_numpy(raw[:, :2].copy()))
        if not bool((scales.ge(0.0) & scales.le(MAX_ABS_VALUE)).all()):
            raise _reject(layout, f"a block scale is negative, NaN, or beyond {MAX_ABS_VALUE:g}")
        used = sparse.topk * layout.value_bits
        spare = layout.row_bytes * 8 - 16 - used
        if spare:
            last = raw[:, -1].astype(np.int32) >> (8 - spare)
            if bool((last != 0).any()):
                raise _reject(layout, "padding bits after the last code are not zero")


def check_payload_entries(
    results: Sequence[SerializedDistroResult], layouts: Sequence[DilocoLayout]
) -> None:
    """Every entry of a payload against the model's layouts."""
    if len(results) != len(layouts):
        raise InvalidDistroResult(
            f"payload has {len(results)} entries; the model has {len(layouts)} parameters"
        )
    for result, layout in zip(results, layouts):
        validate(result, layout)


# --------------------------------------------------------------------------------------------
# Decoding (bit-identical on every device: elementwise ops only, in a fixed order)


def _sparse_values(
    result: DistroResult, layout: DilocoLayout, device: torch.device
) -> torch.Tensor:
    """`[rows, k]` float32 values of a sparse entry: `scale * ((2q - L) / L)`."""
    assert layout.sparse is not None
    k = layout.sparse.topk
    raw = result.sparse_val.to(device).reshape(-1, layout.row_bytes)
    scale = _bf16_from_bytes(raw[:, :2])
    codes = _unpack_codes(raw[:, 2:], layout.value_bits, k)[:, :k]
    levels = float(_levels(layout.value_bits))
    unit = (codes.to(torch.float32) * 2.0 - levels) / levels
    return unit * scale.unsqueeze(1)


def _sparse_indices(
    result: DistroResult, layout: DilocoLayout, device: torch.device
) -> torch.Tensor:
    assert layout.sparse is not None
    idx = decompress_idx(layout.sparse.totalk, result.sparse_idx.to(device))
    return idx.reshape(-1, layout.sparse.topk)


def new_accumulator(layout: DilocoLayout, device: torch.device | str) -> torch.Tensor:
    """A zero float32 accumulator for `layout` (sparse: in block layout, see `finish`)."""
    if layout.transmission is DilocoTransmission.Sparse:
        assert layout.sparse is not None
        return torch.zeros(layout.sparse.xshape, dtype=torch.float32, device=device)
    return torch.zeros(layout.shape, dtype=torch.float32, device=device)


def entry_values(result: DistroResult, layout: DilocoLayout, device: torch.device) -> torch.Tensor:
    """The float32 values an entry carries, flat: the parameter's values for the dense forms,
    the kept DCT coefficients (block by block, in slot order) for the sparse one. The DCT is
    orthonormal, so their L2 norm is the decoded update's in every form."""
    match layout.transmission:
        case DilocoTransmission.Bf16:
            return result.sparse_val.to(device).reshape(-1).to(torch.float32)
        case DilocoTransmission.Int8:
            scales = result.sparse_idx.to(device)
            per_value = scales.repeat_interleave(layout.group)[: layout.numel]
            return result.sparse_val.to(device).reshape(-1).to(torch.float32) * per_value
        case _:
            return _sparse_values(result, layout, device).reshape(-1)


def accumulate(
    acc: torch.Tensor, result: DistroResult, layout: DilocoLayout, scale: float = 1.0
) -> None:
    """`acc += decode(result) * scale`, elementwise, in the entry's slot order (each value is
    multiplied by `scale`, rounded to float32, before it is added; a scale of 1 multiplies
    nothing)."""
    device = acc.device
    match layout.transmission:
        case DilocoTransmission.Bf16 | DilocoTransmission.Int8:
            values = entry_values(result, layout, device)
            if scale != 1.0:
                values = values * scale
            acc.add_(values.view(layout.shape))
        case DilocoTransmission.Sparse:
            sparse = layout.sparse
            assert sparse is not None
            values = _sparse_values(result, layout, device)
            if scale != 1.0:
                values = values * scale
            indices = _sparse_indices(result, layout, device)
            if len(layout.shape) >= 2:
                n1, n2 = sparse.xshape[-2:]
                b1 = dct_basis(n1).to(device).t().contiguous()  # [freq, spatial]
                b2 = dct_basis(n2).to(device).t().contiguous()
                view = acc.view(-1, n1, n2)
                for slot in range(sparse.topk):
                    i = indices[:, slot]
                    outer = b1[i // n2].unsqueeze(2) * b2[i % n2].unsqueeze(1)
                    view.add_(outer * values[:, slot].view(-1, 1, 1))
            else:
                _count, n1 = sparse.xshape
                b1 = dct_basis(n1).to(device).t().contiguous()
                for slot in range(sparse.topk):
                    acc.add_(b1[indices[:, slot]] * values[:, slot].view(-1, 1))


def finish(acc: torch.Tensor, layout: DilocoLayout) -> torch.Tensor:
    """An accumulator in the parameter's shape (a sparse one leaves its block layout: a
    permutation, exact; leading dimensions of a 3-D+ parameter stay in front)."""
    if layout.transmission is DilocoTransmission.Sparse and len(layout.shape) >= 2:
        blocks = acc.reshape(-1, *acc.shape[-4:])  # [lead, rows, cols, n1, n2]
        return blocks.permute(0, 1, 3, 2, 4).reshape(layout.shape)
    return acc.reshape(layout.shape)


def decode(result: DistroResult, layout: DilocoLayout, device: torch.device | str) -> torch.Tensor:
    """One entry's values as a float32 tensor of the parameter's shape."""
    acc = new_accumulator(layout, device)
    accumulate(acc, result, layout)
    return finish(acc, layout)


def sent_bytes(layout: DilocoLayout) -> int:
    """Tensor bytes one entry carries (what the hash covers; the postcard framing adds a few)."""
    match layout.transmission:
        case DilocoTransmission.Bf16:
            return 2 * layout.numel
        case DilocoTransmission.Int8:
            return layout.numel + 4 * layout.groups
        case _:
            assert layout.sparse is not None
            blocks = math.prod(layout.sparse.block_shape)
            width = index_width(layout.sparse.totalk)
            return blocks * (layout.sparse.topk * width + layout.row_bytes)


def entry_bound(layout: DilocoLayout) -> EntryBound:
    """The one entry `validate` accepts for `layout`, as a size bound (the forms fix every
    tensor's kind and dims, so the bound is exact)."""
    match layout.transmission:
        case DilocoTransmission.Bf16:
            return EntryBound((0,), 0, layout.shape, 2 * layout.numel, (), 0)
        case DilocoTransmission.Int8:
            groups = layout.groups
            return EntryBound((groups,), 4 * groups, layout.shape, layout.numel, (), layout.group)
        case _:
            sparse = layout.sparse
            assert sparse is not None
            rows = (*sparse.block_shape, layout.row_bytes)
            return EntryBound(
                sparse.idx_shape,
                math.prod(sparse.idx_shape),
                rows,
                math.prod(rows),
                sparse.xshape,
                sparse.totalk,
            )
