"""Zero-copy decoding of downloaded blobs (`DownloadCodec.decode`, serde's borrow mode): the same
values and errors as a copying decode, with every `Vec<u8>` field a read-only view into the blob;
and the blob bytes of upstream's `TransmittableDownload` enum."""

from __future__ import annotations

import re
from typing import Annotated

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
from psyche.network.transmittable import (
    DownloadCodec,
    TransmittableModelConfig,
    TransmittableModelParameter,
    download_codec,
)

CODEC = download_codec(TransmittableDistroResult)
"""The client's blobs: upstream's enum with the DisTrO result in its first variant."""
TransmittableDownload = CODEC.wire_enum


class UpstreamTransmittableDownload(DataEnum):
    """upstream download/manager.rs, declared statically: the bytes every blob must keep."""

    DistroResult = var(TransmittableDistroResult)
    ModelParameter = var(TransmittableModelParameter)
    ModelConfig = var(TransmittableModelConfig)


def from_blob(blob: bytes | bytearray, tp: object) -> object:
    """Serde's borrow mode, which `DownloadCodec.decode` uses for every verified blob."""
    return from_bytes(blob, tp, borrow=True)


def tensor(data: bytes, kind: int = 0) -> SerializableTensor:
    return SerializableTensor([len(data)], kind, False, SerializableTensorData.Full(data))


def distro(step: int, payloads: list[bytes]) -> TransmittableDistroResult:
    results = [SerializedDistroResult(tensor(p), tensor(p[::-1]), [4, 8], 32) for p in payloads]
    return TransmittableDistroResult(step, 7, BatchId(1, 9), results)


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
    ("value", "codec", "fields"),
    [
        (b"\x00" * 100_000 + b"end", download_codec(bytes), 1),
        (distro(3, [b"abc", bytes(range(256)) * 40]), CODEC, 4),
        (TransmittableModelParameter(b"model.w", b"\x01\x02" * 5000), CODEC, 2),
        (TransmittableModelConfig("{}", "tok", ["a", "b"]), CODEC, 0),
    ],
)
def test_same_values_as_serde_without_copying(
    value: object, codec: DownloadCodec, fields: int
) -> None:
    blob = bytearray(codec.encode(value))  # a received blob is a bytearray
    decoded = codec.decode(blob)
    assert decoded == from_bytes(blob, codec.wire_enum).value == value
    views = views_into(decoded, blob)
    assert len(views) == fields
    base = np.frombuffer(blob, np.uint8)
    for view in views:
        assert view.readonly
        assert view.obj is blob
        assert np.shares_memory(np.frombuffer(view, np.uint8), base) or len(view) == 0


def test_views_are_usable_as_bytes() -> None:
    raw = np.arange(12, dtype=np.float32).tobytes()
    blob = bytearray(CODEC.encode(distro(1, [raw])))
    decoded = CODEC.decode(blob)
    sparse_idx = decoded.distro_results[0].sparse_idx
    assert torch_from_serializable_tensor(sparse_idx).tolist() == list(raw)
    assert decoded.compute_hash() == distro(1, [raw]).compute_hash()
    parameter = CODEC.decode(CODEC.encode(TransmittableModelParameter(b"w.\xc3\xa9", b"x")))
    assert parameter.name() == "w.é"
    assert hash(parameter.param_value_bytes) == hash(b"x")


@struct(frozen=True)
class Inner:
    blob: bytes
    fixed: Annotated[bytes, FixedBytes(4)]


class Shape(DataEnum):
    Empty = var()
    Pair = var(tuple[bytes, U32])
    Many = var(list[Inner | None])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_hostile_input_is_refused_exactly_as_serde_refuses_it(data: bytes) -> None:
    decoders = [
        (Shape, lambda b: from_blob(b, Shape)),
        (bytes, lambda b: from_blob(b, bytes)),
        (TransmittableDownload, CODEC.decode),
    ]
    for tp, decode in decoders:
        try:
            expected = from_bytes(data, tp)
        except PostcardError as e:
            with pytest.raises(PostcardError, match=f"^{re.escape(str(e))}$"):
                decode(data)
        else:
            if isinstance(expected, TransmittableDownload):
                expected = expected.value
            assert decode(data) == expected


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


def test_blobs_keep_upstreams_bytes() -> None:
    """Each payload travels as its variant of upstream's enum (0 DistroResult, 1 ModelParameter,
    2 ModelConfig), whichever type the application gives the DisTrO result."""
    upstream = UpstreamTransmittableDownload
    cases = [
        (distro(2, [b"xyz"]), upstream.DistroResult),
        (TransmittableModelParameter(b"w", b"\x00\x01"), upstream.ModelParameter),
        (TransmittableModelConfig("{}", "tok", ["w"]), upstream.ModelConfig),
    ]
    for payload, variant in cases:
        blob = CODEC.encode(payload)
        assert blob == to_bytes(variant(payload), upstream)
        assert blob[0] == variant.index
        assert CODEC.decode(blob) == payload
    raw = download_codec(bytes)
    assert raw.encode(b"abc") == b"\x00\x03abc"
    assert raw.encode(TransmittableModelConfig("{}", "", [])) == to_bytes(
        upstream.ModelConfig(TransmittableModelConfig("{}", "", [])), upstream
    )
    with pytest.raises(TypeError, match="not a blob payload"):
        CODEC.encode(b"abc")  # this codec's DisTrO results are not raw bytes
    with pytest.raises(PostcardError, match="invalid variant index 3"):
        CODEC.decode(b"\x03")
