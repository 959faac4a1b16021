"""The transmitted form of DisTrO results: postcard wire types, commitment hash, and vetting.

The wire types are plain serde structs (no torch needed to encode, decode or hash them), so the
network layer can import this module cheaply. Converting to and from tensors imports torch
lazily.

Every payload that arrives from a peer goes through `distro_results_from_transmittable`, which
checks it against the layout this node expects (count, kinds, dims, byte lengths, index range,
finite values) before any tensor is built from it: a hostile payload is rejected with
`InvalidDistroResult`, never applied. All checks are deterministic, so every honest node rejects
the same payloads.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from psyche.core.batch_id import BatchId
from psyche.core.serde import (
    I64,
    U8,
    U16,
    U32,
    DataEnum,
    PostcardError,
    encode_varint,
    struct,
    take_from_bytes,
    to_bytes,
    variant,
)

if TYPE_CHECKING:
    import torch

    from psyche.modeling.distro import DistroResult, ResultLayout


class InvalidDistroResult(ValueError):
    """A received DisTrO payload that does not fit this model; it must not be applied."""


# --------------------------------------------------------------------------------------------
# Tensor kinds (c10 ScalarType order, as upstream's SerializableKind)

KIND_NAMES: tuple[str, ...] = (
    "Uint8",
    "Int8",
    "Int16",
    "Int",
    "Int64",
    "Half",
    "Float",
    "Double",
    "ComplexHalf",
    "ComplexFloat",
    "ComplexDouble",
    "Bool",
    "QInt8",
    "QUInt8",
    "QInt32",
    "BFloat16",
    "QUInt4x2",
    "QUInt2x4",
    "Bits1x8",
    "Bits2x4",
    "Bits4x2",
    "Bits8",
    "Bits16",
    "Float8e5m2",
    "Float8e4m3fn",
    "Float8e5m2fnuz",
    "Float8e4m3fnuz",
    "UInt16",
    "UInt32",
    "UInt64",
    "UInt1",
    "UInt2",
    "UInt3",
    "UInt4",
    "UInt5",
    "UInt6",
    "UInt7",
)
KIND_UINT8 = 0
KIND_BOOL = 11
KIND_BFLOAT16 = 15

# kinds a payload may carry as tensor data here, with their element size in bytes
_PLAIN_KINDS: dict[int, tuple[str, int]] = {
    0: ("uint8", 1),
    1: ("int8", 1),
    2: ("int16", 2),
    3: ("int32", 4),
    4: ("int64", 8),
    5: ("float16", 2),
    6: ("float32", 4),
    7: ("float64", 8),
    11: ("bool", 1),
    15: ("bfloat16", 2),
    27: ("uint16", 2),
    28: ("uint32", 4),
    29: ("uint64", 8),
}
_FLOAT_KINDS = frozenset({5, 6, 7, 15})


def kind_of(dtype: torch.dtype) -> int:
    """The wire kind code of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    for code, (torch_name, _) in _PLAIN_KINDS.items():
        if torch_name == name:
            return code
    raise ValueError(f"tensors of dtype {dtype} cannot be serialized")


def _dtype_of(kind: int) -> torch.dtype:
    import torch

    dtype: torch.dtype = getattr(torch, _PLAIN_KINDS[kind][0])
    return dtype


# --------------------------------------------------------------------------------------------
# Wire types


class SerializableTensorData(DataEnum):
    Full = variant(bytes)
    OneBit = variant(bytes)


@struct(frozen=True)
class SerializableTensor:
    dims: list[I64]
    kind: U8
    requires_grad: bool
    data: SerializableTensorData

    def __post_init__(self) -> None:
        if not 0 <= self.kind < len(KIND_NAMES):
            raise ValueError(f"unknown tensor kind {self.kind}")

    def raw_tensor_data(self) -> bytes:
        """The bytes the commitment hash covers (packed bits for bool tensors)."""
        data: bytes = self.data.value
        return data

    @property
    def numel(self) -> int:
        return math.prod(self.dims)


@struct(frozen=True)
class SerializedDistroResult:
    sparse_idx: SerializableTensor
    sparse_val: SerializableTensor
    xshape: list[U16]
    totalk: U32


@struct(frozen=True)
class TransmittableDistroResult:
    step: U32
    trainer_nonce: U32
    batch_id: BatchId
    distro_results: list[SerializedDistroResult]

    def comptue_hash(self) -> bytes:
        """The commitment: sha256 over step, batch bounds and every result's raw tensor bytes."""
        hasher = hashlib.sha256()
        hasher.update(self.step.to_bytes(4, "big"))
        hasher.update(self.batch_id.start.to_bytes(8, "big"))
        hasher.update(self.batch_id.end.to_bytes(8, "big"))
        for result in self.distro_results:
            hasher.update(result.sparse_idx.raw_tensor_data())
            hasher.update(result.sparse_val.raw_tensor_data())
        return hasher.digest()

    compute_hash = comptue_hash

    def to_bytes(self) -> bytes:
        return to_bytes(self, TransmittableDistroResult)


# --------------------------------------------------------------------------------------------
# Tensor <-> wire


def serializable_tensor_from_torch(tensor: torch.Tensor) -> SerializableTensor:
    """CPU, contiguous, little-endian element bytes; bool tensors packed LSB-first."""
    import numpy as np
    import torch

    t = tensor.detach().to("cpu").contiguous()
    dims = list(t.shape)
    kind = kind_of(t.dtype)
    if t.dtype == torch.bool:
        bits = t.reshape(-1).numpy()
        data = SerializableTensorData.OneBit(np.packbits(bits, bitorder="little").tobytes())
    else:
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        data = SerializableTensorData.Full(raw.numpy().tobytes())
    return SerializableTensor(
        dims=dims, kind=kind, requires_grad=bool(tensor.requires_grad), data=data
    )


def _check_tensor_bytes(t: SerializableTensor, what: str) -> None:
    if any(d < 0 for d in t.dims):
        raise InvalidDistroResult(f"{what}: negative dimension in {t.dims}")
    if t.kind not in _PLAIN_KINDS:
        raise InvalidDistroResult(f"{what}: tensors of kind {KIND_NAMES[t.kind]} are not accepted")
    n = t.numel
    raw = t.raw_tensor_data()
    match t.data:
        case SerializableTensorData.OneBit():
            if t.kind != KIND_BOOL:
                raise InvalidDistroResult(f"{what}: packed bits for a {KIND_NAMES[t.kind]} tensor")
            expected = (n + 7) // 8
        case _:
            if t.kind == KIND_BOOL:
                # Upstream always packs bool tensors; raw bool bytes could hold values other
                # than 0/1, so they are refused.
                raise InvalidDistroResult(f"{what}: a bool tensor must be bit-packed")
            expected = n * _PLAIN_KINDS[t.kind][1]
    if len(raw) != expected:
        raise InvalidDistroResult(
            f"{what}: {len(raw)} data bytes for dims {t.dims} of kind {KIND_NAMES[t.kind]} "
            f"(expected {expected})"
        )


def torch_from_serializable_tensor(t: SerializableTensor) -> torch.Tensor:
    """The tensor a `SerializableTensor` holds (after checking its byte length)."""
    import numpy as np
    import torch

    _check_tensor_bytes(t, "tensor")
    raw = t.raw_tensor_data()
    n = t.numel
    if t.kind == KIND_BOOL:
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:n]
        return torch.from_numpy(bits.astype(np.bool_)).reshape(t.dims)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
    if buf is None:
        return torch.empty(t.dims, dtype=_dtype_of(t.kind))
    return buf.view(_dtype_of(t.kind)).reshape(t.dims)


def serialize_distro_result(result: DistroResult) -> SerializedDistroResult:
    for d in result.xshape:
        if not 0 <= d <= 0xFFFF:
            raise ValueError(f"xshape dimension {d} does not fit in u16")
    if not 0 <= result.totalk <= 0xFFFF_FFFF:
        raise ValueError(f"totalk {result.totalk} does not fit in u32")
    return SerializedDistroResult(
        sparse_idx=serializable_tensor_from_torch(result.sparse_idx),
        sparse_val=serializable_tensor_from_torch(result.sparse_val),
        xshape=list(result.xshape),
        totalk=result.totalk,
    )


def transmittable_distro_result(
    results: Sequence[DistroResult], step: int, trainer_nonce: int, batch_id: BatchId
) -> TransmittableDistroResult:
    return TransmittableDistroResult(
        step=step,
        trainer_nonce=trainer_nonce,
        batch_id=batch_id,
        distro_results=[serialize_distro_result(r) for r in results],
    )


def validate_serialized_distro_result(
    result: SerializedDistroResult, layout: ResultLayout, *, require_1bit: bool | None = None
) -> None:
    """Raise `InvalidDistroResult` unless `result` is a well-formed result for `layout`.

    `require_1bit`: True accepts only sign bits, False only full values, None either.
    """
    what = layout.name
    if tuple(result.xshape) != layout.xshape:
        raise InvalidDistroResult(f"{what}: xshape {result.xshape}, expected {list(layout.xshape)}")
    if result.totalk != layout.totalk:
        raise InvalidDistroResult(f"{what}: totalk {result.totalk}, expected {layout.totalk}")
    idx, val = result.sparse_idx, result.sparse_val
    _check_tensor_bytes(idx, f"{what}.sparse_idx")
    _check_tensor_bytes(val, f"{what}.sparse_val")
    if idx.kind != KIND_UINT8:
        raise InvalidDistroResult(f"{what}: sparse_idx kind {KIND_NAMES[idx.kind]}, expected Uint8")
    if tuple(idx.dims) != layout.idx_shape:
        raise InvalidDistroResult(
            f"{what}: sparse_idx dims {idx.dims}, expected {list(layout.idx_shape)}"
        )
    if tuple(val.dims) != layout.val_shape:
        raise InvalidDistroResult(
            f"{what}: sparse_val dims {val.dims}, expected {list(layout.val_shape)}"
        )
    is_bits = val.kind == KIND_BOOL
    if not is_bits and val.kind not in _FLOAT_KINDS:
        raise InvalidDistroResult(f"{what}: sparse_val kind {KIND_NAMES[val.kind]} is not a float")
    if require_1bit is True and not is_bits:
        raise InvalidDistroResult(f"{what}: this run sends 1-bit values, got full values")
    if require_1bit is False and is_bits:
        raise InvalidDistroResult(f"{what}: this run sends full values, got 1-bit values")
    _check_index_range(idx.raw_tensor_data(), layout)
    if not is_bits:
        _check_finite(val)


def _check_index_range(raw: bytes, layout: ResultLayout) -> None:
    import numpy as np

    dtype = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<i8"}[layout.index_bytes]
    indices = np.frombuffer(raw, dtype=dtype)
    if indices.size and (int(indices.max()) >= layout.totalk or int(indices.min()) < 0):
        raise InvalidDistroResult(
            f"{layout.name}: index {int(indices.max())} out of range for blocks of {layout.totalk}"
        )


def _check_finite(val: SerializableTensor) -> None:
    import torch

    t = torch_from_serializable_tensor(val)
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise InvalidDistroResult("sparse_val holds NaN or infinite values")


def distro_result_from_serialized(result: SerializedDistroResult) -> DistroResult:
    """Unchecked conversion (for this node's own payloads); peers' go through the checked one."""
    import torch

    from psyche.modeling.distro import DistroResult

    idx = torch_from_serializable_tensor(result.sparse_idx)
    val = torch_from_serializable_tensor(result.sparse_val)
    if torch.cuda.is_available():
        idx, val = idx.pin_memory(), val.pin_memory()
    return DistroResult(
        sparse_idx=idx, sparse_val=val, xshape=list(result.xshape), totalk=result.totalk
    )


def distro_results_from_transmittable(
    payload: TransmittableDistroResult,
    layouts: Sequence[ResultLayout],
    *,
    require_1bit: bool | None = None,
) -> list[DistroResult]:
    """Check a peer's payload against this model's layouts, then build its tensors."""
    if len(payload.distro_results) != len(layouts):
        raise InvalidDistroResult(
            f"payload has {len(payload.distro_results)} results; the model has "
            f"{len(layouts)} parameters"
        )
    for result, layout in zip(payload.distro_results, layouts):
        validate_serialized_distro_result(result, layout, require_1bit=require_1bit)
    return [distro_result_from_serialized(r) for r in payload.distro_results]


# --------------------------------------------------------------------------------------------
# The largest payload a run can produce


@dataclass(frozen=True)
class EntryBound:
    """The largest form of one payload entry (`SerializedDistroResult`) a receiver accepts:
    its tensors' dims and the most data bytes each may carry."""

    idx_dims: tuple[int, ...]
    idx_bytes: int
    val_dims: tuple[int, ...]
    val_bytes: int
    xshape: tuple[int, ...]
    totalk: int


def _varint_len(value: int) -> int:
    out = bytearray()
    encode_varint(value, out)
    return len(out)


def _no_data(dims: tuple[int, ...]) -> SerializableTensor:
    return SerializableTensor(
        dims=list(dims), kind=0, requires_grad=False, data=SerializableTensorData.Full(b"")
    )


def payload_size_bound(entries: Sequence[EntryBound]) -> int:
    """The size in bytes of the largest `TransmittableDistroResult` whose entries fit `entries`
    (step, nonce and batch id at their widest encodings): no payload a receiver with these
    layouts accepts is larger, so a ticket announcing more is refused before any download.
    The framing is encoded for real; only the data bytes are counted."""

    def data(n: int) -> int:  # n data bytes and their length prefix, over none
        return n + _varint_len(n) - _varint_len(0)

    widest = TransmittableDistroResult(
        step=0xFFFF_FFFF,
        trainer_nonce=0xFFFF_FFFF,
        batch_id=BatchId(2**64 - 1, 2**64 - 1),
        distro_results=[],
    )
    size = len(widest.to_bytes()) - _varint_len(0) + _varint_len(len(entries))
    for e in entries:
        skeleton = SerializedDistroResult(
            sparse_idx=_no_data(e.idx_dims),
            sparse_val=_no_data(e.val_dims),
            xshape=list(e.xshape),
            totalk=e.totalk,
        )
        size += len(to_bytes(skeleton, SerializedDistroResult))
        size += data(e.idx_bytes) + data(e.val_bytes)
    return size


def distro_entry_bound(layout: ResultLayout, *, require_1bit: bool | None = None) -> EntryBound:
    """The largest entry `validate_serialized_distro_result` accepts for `layout`: the index
    bytes its shape fixes, and values as sign bits (1-bit runs) or at the widest float kind a
    receiver accepts (8 bytes)."""
    values = math.prod(layout.val_shape)
    val_bytes = (values + 7) // 8 if require_1bit is True else values * 8
    return EntryBound(
        idx_dims=layout.idx_shape,
        idx_bytes=math.prod(layout.idx_shape),
        val_dims=layout.val_shape,
        val_bytes=val_bytes,
        xshape=layout.xshape,
        totalk=layout.totalk,
    )


def decode_transmittable(data: bytes | bytearray | memoryview) -> TransmittableDistroResult:
    """Decode a payload; malformed bytes raise `InvalidDistroResult`."""
    try:
        value, used = take_from_bytes(data, TransmittableDistroResult)
    except PostcardError as e:
        raise InvalidDistroResult(f"malformed DisTrO payload: {e}") from e
    if used != len(data):
        raise InvalidDistroResult(f"{len(data) - used} trailing bytes after the DisTrO payload")
    return value


# --------------------------------------------------------------------------------------------
# Gradient dumps (`--write-gradients-dir`): concatenated results, no count prefix


def distro_results_to_bytes(results: Sequence[SerializedDistroResult]) -> bytes:
    return b"".join(to_bytes(r, SerializedDistroResult) for r in results)


def distro_results_from_reader(
    reader: BinaryIO, chunk_size: int = 1 << 16
) -> Iterator[SerializedDistroResult]:
    """Yield results from a stream of concatenated encodings; a truncated tail raises.

    A result that does not decode yet is retried with more data (the codec cannot tell a cut
    from a corruption), so a corrupt stream raises once the reader is exhausted.
    """
    buffer = bytearray()
    eof = False
    while True:
        if buffer:
            try:
                value, used = take_from_bytes(buffer, SerializedDistroResult)
            except PostcardError:
                if eof:
                    raise
            else:
                del buffer[:used]
                yield value
                continue
        elif eof:
            return
        chunk = reader.read(chunk_size)
        if chunk:
            buffer += chunk
        else:
            eof = True
