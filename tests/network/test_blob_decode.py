"""Zero-copy decoding of downloaded blobs (`from_bytes(..., borrow=True)`): the same values and
errors as a copying decode, with every `Vec<u8>` field a read-only view into the blob."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.batch_id import BatchId
from psyche.core.serde import U32, DataEnum, FixedBytes, PostcardError, from_bytes, struct, to_bytes
from psyche.core.serde import variant as var
from psyche.modeling.serialized_distro import (
    SerializableTensor,
    SerializableTensorData,
    SerializedDistroResult,
    TransmittableDistroResult,
    torch_from_serializable_tensor,
)
from psyche.network.connection import decode_blob as from_blob
from psyche.network.transmittable import (
    TransmittableDownload,
    TransmittableModelConfig,
    TransmittableModelParameter,
)


def tensor(data: bytes, kind: int = 0) -> SerializableTensor:
    return SerializableTensor([len(data)], kind, False, SerializableTensorData.Full(data))


def distro(step: int, payloads: list[bytes]) -> TransmittableDownload:
    results = [SerializedDistroResult(tensor(p), tensor(p[::-1]), [4, 8], 32) for p in payloads]
    return TransmittableDownload.DistroResult(
        TransmittableDistroResult(step, 7, BatchId(1, 9), results)
    )


def views_into(value: object, blob: bytes | bytearray) -> list[memoryview]:
    """Every memoryview reachable from `value` (dataclass fields, variants, lists)."""
    found: list[memoryview] = []

    def walk(x: object) -> None:
        if isinstance(x, memoryview):
            found.append(x)
        elif isinstance(x, list | tuple):
            for y in x:
                walk(y)
        elif isinstance(x, DataEnum):
            walk(getattr(x, "value", None))
        elif hasattr(x, "__dataclass_fields__"):
            for name in x.__dataclass_fields__:
                walk(getattr(x, name))

    walk(value)
    return found


@pytest.mark.parametrize(
    "value, tp, fields",
    [
        (b"\x00" * 100_000 + b"end", bytes, 1),
        (distro(3, [b"abc", bytes(range(256)) * 40]), TransmittableDownload, 4),
        (
            TransmittableDownload.ModelParameter(
                TransmittableModelParameter(b"model.w", b"\x01\x02" * 5000)
            ),
            TransmittableDownload,
            2,
        ),
        (
            TransmittableDownload.ModelConfig(TransmittableModelConfig("{}", "tok", ["a", "b"])),
            TransmittableDownload,
            0,
        ),
    ],
)
def test_same_values_as_serde_without_copying(value: object, tp: object, fields: int) -> None:
    blob = bytearray(to_bytes(value, tp))  # a received blob is a bytearray
    decoded = from_blob(blob, tp)
    assert decoded == from_bytes(blob, tp) == value
    views = views_into(decoded, blob)
    assert len(views) == fields
    base = np.frombuffer(blob, np.uint8)
    for view in views:
        assert view.readonly and view.obj is blob
        assert np.shares_memory(np.frombuffer(view, np.uint8), base) or len(view) == 0


def test_views_are_usable_as_bytes() -> None:
    raw = np.arange(12, dtype=np.float32).tobytes()
    blob = bytearray(to_bytes(distro(1, [raw]), TransmittableDownload))
    decoded = from_blob(blob, TransmittableDownload)
    sparse_idx = decoded.value.distro_results[0].sparse_idx
    assert torch_from_serializable_tensor(sparse_idx).tolist() == list(raw)
    assert decoded.value.compute_hash() == distro(1, [raw]).value.compute_hash()
    parameter = from_blob(
        to_bytes(
            TransmittableDownload.ModelParameter(TransmittableModelParameter(b"w.\xc3\xa9", b"x")),
            TransmittableDownload,
        ),
        TransmittableDownload,
    ).value
    assert parameter.name() == "w.é"
    assert hash(parameter.param_value_bytes) == hash(b"x")


@struct(frozen=True)
class Inner:
    blob: bytes
    fixed: FixedBytes[4]


class Shape(DataEnum):
    Empty = var()
    Pair = var(tuple[bytes, U32])
    Many = var(list[Inner | None])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_hostile_input_is_refused_exactly_as_serde_refuses_it(data: bytes) -> None:
    for tp in (Shape, TransmittableDownload, bytes):
        try:
            expected = from_bytes(data, tp)
        except PostcardError as e:
            with pytest.raises(PostcardError) as got:
                from_blob(data, tp)
            assert str(got.value) == str(e)
        else:
            assert from_blob(data, tp) == expected


def test_truncations_and_trailing_bytes() -> None:
    value = Shape.Many([Inner(b"abcdef", b"wxyz"), None, Inner(b"", b"0000")])
    data = to_bytes(value, Shape)
    assert from_blob(data, Shape) == value
    for cut in range(len(data)):
        with pytest.raises(PostcardError):
            from_blob(data[:cut], Shape)
    with pytest.raises(PostcardError, match="1 trailing bytes"):
        from_blob(data + b"\x00", Shape)


def test_first_use_from_many_threads_at_once() -> None:
    from concurrent.futures import ThreadPoolExecutor

    @struct(frozen=True)
    class Fresh:  # a type no decoder was compiled for yet
        a: bytes
        b: list[Inner]

    value = Fresh(b"x" * 10, [Inner(b"y", b"1234")] * 3)
    data = to_bytes(value, Fresh)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: from_blob(data, Fresh), range(64)))
    assert all(r == value for r in results)
