"""The transmitted DisTrO payload: bytes, commitment hash, size formula, hostile input."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from psyche.core.batch_id import BatchId
from psyche.core.serde import encode_varint, from_bytes, to_bytes
from psyche.modeling.distro import Distro, ResultLayout, quantize_results
from psyche.modeling.serialized_distro import (
    KIND_BFLOAT16,
    InvalidDistroResult,
    SerializableTensor,
    SerializableTensorData,
    SerializedDistroResult,
    TransmittableDistroResult,
    decode_transmittable,
    distro_results_from_reader,
    distro_results_from_transmittable,
    distro_results_to_bytes,
    serializable_tensor_from_torch,
    torch_from_serializable_tensor,
    transmittable_distro_result,
)

# -- SerializableTensor (upstream serializable_tensor.rs tests) --------------------------------


@pytest.mark.parametrize(
    "truth",
    [
        torch.tensor([0.6533, 0.2706, -0.2706, -0.6533]),
        torch.tensor([[0.6533, 0.2706, -0.2706, -0.6533], [230.4230, -25774.5, 0.0, 25.0]]),
        (torch.rand(2, 16, 2, 25, 2, 215, 6, generator=torch.Generator().manual_seed(1)) - 0.5)
        * 1000,
        torch.randn(3, 5).bfloat16(),
        torch.tensor([1, 0, 0, 1, 0, 1, 1, 1]).bool(),
        torch.tensor([[1, 0, 0, 1], [0, 1, 1, 1], [1, 0, 1, 0], [1, 1, 0, 1]]).bool(),
        (
            torch.rand(2, 16, 2, 25, 2, 215, 6, generator=torch.Generator().manual_seed(2)) - 0.5
        ).signbit(),
        torch.tensor([1, 0, 1, 0, 1]).bool(),
        torch.tensor([1]).bool(),
        torch.tensor([1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1]).bool().reshape(1, 3, 5),
        torch.arange(10, dtype=torch.uint8),
    ],
)
def test_tensor_roundtrip(truth: torch.Tensor) -> None:
    wire = serializable_tensor_from_torch(truth)
    back = torch_from_serializable_tensor(from_bytes(to_bytes(wire), SerializableTensor))
    assert back.dtype == truth.dtype
    assert torch.equal(back, truth)


def test_bool_tensors_pack_lsb_first() -> None:
    bits = serializable_tensor_from_torch(torch.tensor([0, 1, 1, 0, 1, 1, 1, 0]).bool())
    assert bits.data == SerializableTensorData.OneBit(bytes([118]))
    bits = serializable_tensor_from_torch(torch.tensor([1, 0, 0, 1, 0, 1, 1, 1, 1]).bool())
    assert bits.raw_tensor_data() == bytes([0b11101001, 0b00000001])
    assert bits.kind == 11
    assert bits.dims == [9]


def test_tensor_wire_bytes() -> None:
    t = serializable_tensor_from_torch(torch.tensor([[1.0, -2.0]], dtype=torch.bfloat16))
    # dims [1, 2] (zigzag varints), kind 15, requires_grad false, Full (variant 0), 4 bytes
    assert to_bytes(t) == bytes([2, 2, 4, KIND_BFLOAT16, 0, 0, 4, 0x80, 0x3F, 0x00, 0xC0])


def test_unknown_kind_is_rejected_on_decode() -> None:
    good = to_bytes(serializable_tensor_from_torch(torch.zeros(1)))
    bad = good[:2] + bytes([37]) + good[3:]
    with pytest.raises(ValueError, match="unknown tensor kind 37"):
        from_bytes(bad, SerializableTensor)


# -- payloads ------------------------------------------------------------------------------


def _model(dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", nn.Parameter(torch.randn(128, 192, generator=g).to(dtype))),
        ("b.bias", nn.Parameter(torch.randn(192, generator=g).to(dtype))),
        ("c.weight", nn.Parameter(torch.randn(20, 64, generator=g).to(dtype))),
    ]


def _results(quantized: bool, topk: int = 8, chunk: int = 64):  # type: ignore[no-untyped-def]
    params = _model()
    distro = Distro(params, 0.999, chunk, topk)
    g = torch.Generator().manual_seed(1)
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    results = distro.generate([], 0.0, 1e-3)
    return distro, quantize_results(results) if quantized else results


@pytest.mark.parametrize("quantized", [True, False])
def test_wire_roundtrip(quantized: bool) -> None:
    distro, results = _results(quantized)
    payload = transmittable_distro_result(results, 7, 3, BatchId(10, 19))
    blob = payload.to_bytes()
    assert blob == to_bytes(payload, TransmittableDistroResult)
    received = decode_transmittable(blob)
    assert received == payload
    back = distro_results_from_transmittable(received, distro.layouts(), require_1bit=quantized)
    for a, b in zip(results, back):
        assert torch.equal(a.sparse_idx, b.sparse_idx)
        assert torch.equal(a.sparse_val, b.sparse_val)
        assert (a.xshape, a.totalk) == (b.xshape, b.totalk)


def test_commitment_hash_covers_exactly_upstreams_bytes() -> None:
    _, results = _results(True)
    payload = transmittable_distro_result(results, 7, 3, BatchId(10, 19))
    h = hashlib.sha256()
    h.update((7).to_bytes(4, "big") + (10).to_bytes(8, "big") + (19).to_bytes(8, "big"))
    for r in results:
        h.update(r.sparse_idx.contiguous().numpy().tobytes())
        h.update(
            bytes(
                torch.tensor(r.sparse_val.reshape(-1).tolist() + [False] * 7)
                .reshape(-1)[: 8 * math.ceil(r.sparse_val.numel() / 8)]
                .reshape(-1, 8)
                .to(torch.uint8)
                .mul(torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8))
                .sum(-1, dtype=torch.uint8)
                .tolist()
            )
        )
    assert payload.comptue_hash() == h.digest()
    # nonce, dims, kinds, xshape and totalk are not covered
    other = dataclasses.replace(payload, trainer_nonce=99)
    assert other.comptue_hash() == payload.comptue_hash()
    assert dataclasses.replace(payload, step=8).comptue_hash() != payload.comptue_hash()


def _expected_payload_size(layouts: list[ResultLayout], quantized: bool, header: bytes) -> int:
    def varint_len(v: int) -> int:
        out = bytearray()
        encode_varint(v, out)
        return len(out)

    def tensor_len(dims: tuple[int, ...], nbytes: int) -> int:
        dims_len = varint_len(len(dims)) + sum(varint_len(2 * d) for d in dims)  # zigzag
        return dims_len + 1 + 1 + 1 + varint_len(nbytes) + nbytes

    size = len(header) + varint_len(len(layouts))
    for lay in layouts:
        nblocks = math.prod(lay.block_shape)
        idx_bytes = nblocks * lay.topk * lay.index_bytes
        val_bytes = math.ceil(nblocks * lay.topk / 8) if quantized else nblocks * lay.topk * 2
        size += tensor_len(lay.idx_shape, idx_bytes) + tensor_len(lay.val_shape, val_bytes)
        size += varint_len(len(lay.xshape)) + sum(varint_len(d) for d in lay.xshape)
        size += varint_len(lay.totalk)
    return size


@pytest.mark.parametrize(("quantized", "topk"), [(True, 8), (True, 4), (False, 8)])
def test_payload_size_formula(quantized: bool, topk: int) -> None:
    distro, results = _results(quantized, topk)
    payload = transmittable_distro_result(results, 300, 1, BatchId(1000, 1255))
    header = bytearray()
    for v in (300, 1, 1000, 1255):
        encode_varint(v, header)
    layouts = distro.layouts()
    assert len(payload.to_bytes()) == _expected_payload_size(layouts, quantized, bytes(header))
    # the data itself: 2-byte indices and one bit (or a bf16) per kept coefficient
    raw = sum(
        len(r.sparse_idx.raw_tensor_data()) + len(r.sparse_val.raw_tensor_data())
        for r in payload.distro_results
    )
    a = layouts[0]  # a.weight 128x192 -> 2x3 blocks of 64x64
    assert a.block_shape == (2, 3)
    assert a.index_bytes == 2
    per_block = topk * 2 + (topk / 8 if quantized else topk * 2)
    assert raw >= 6 * per_block


# -- hostile payloads ------------------------------------------------------------------------


def _good_payload() -> tuple[TransmittableDistroResult, list[ResultLayout]]:
    distro, results = _results(True)
    return transmittable_distro_result(results, 1, 0, BatchId(0, 0)), distro.layouts()


def _with_result(payload: TransmittableDistroResult, i: int, **changes: object):  # type: ignore[no-untyped-def]
    results = list(payload.distro_results)
    results[i] = dataclasses.replace(results[i], **changes)
    return dataclasses.replace(payload, distro_results=results)


def _tensor(t: SerializableTensor, **changes: object) -> SerializableTensor:
    return dataclasses.replace(t, **changes)


def _hostile_cases():  # type: ignore[no-untyped-def]
    p, _ = _good_payload()
    r0 = p.distro_results[0]  # a.weight: idx uint16 bytes [2, 3, 16], bits [2, 3, 8]
    idx_raw = bytearray(r0.sparse_idx.raw_tensor_data())
    idx_raw[0:2] = (4096).to_bytes(2, "little")
    val_f32 = serializable_tensor_from_torch(torch.ones(2, 3, 8))
    nan_val = serializable_tensor_from_torch(
        torch.full((2, 3, 8), float("nan"), dtype=torch.bfloat16)
    )
    raw_bool = _tensor(r0.sparse_val, data=SerializableTensorData.Full(bytes(48)))
    return {
        "missing result": dataclasses.replace(p, distro_results=p.distro_results[:-1]),
        "extra result": dataclasses.replace(p, distro_results=[*p.distro_results, r0]),
        "xshape": _with_result(p, 0, xshape=[2, 3, 64, 32]),
        "totalk": _with_result(p, 0, totalk=2048),
        "idx kind": _with_result(p, 0, sparse_idx=_tensor(r0.sparse_idx, kind=27)),
        "idx dims": _with_result(p, 0, sparse_idx=_tensor(r0.sparse_idx, dims=[3, 2, 16])),
        "idx out of range": _with_result(
            p,
            0,
            sparse_idx=_tensor(r0.sparse_idx, data=SerializableTensorData.Full(bytes(idx_raw))),
        ),
        "idx truncated": _with_result(
            p, 0, sparse_idx=_tensor(r0.sparse_idx, data=SerializableTensorData.Full(bytes(10)))
        ),
        "val dims": _with_result(p, 0, sparse_val=_tensor(r0.sparse_val, dims=[2, 3, 9])),
        "val bits short": _with_result(
            p, 0, sparse_val=_tensor(r0.sparse_val, data=SerializableTensorData.OneBit(bytes(5)))
        ),
        "val raw bools": _with_result(p, 0, sparse_val=raw_bool),
        "val int kind": _with_result(p, 0, sparse_val=_tensor(val_f32, kind=3)),
        "val nan": _with_result(p, 0, sparse_val=nan_val),
        "bits for floats": _with_result(
            p, 0, sparse_val=_tensor(val_f32, data=SerializableTensorData.OneBit(bytes(3)))
        ),
        "negative dims": _with_result(p, 0, sparse_val=_tensor(r0.sparse_val, dims=[-2, -3, 8])),
        "huge dims": _with_result(p, 0, sparse_idx=_tensor(r0.sparse_idx, dims=[2**40, 2**40])),
    }


@pytest.mark.parametrize("case", list(_hostile_cases()))
def test_hostile_results_are_rejected(case: str) -> None:
    payload = _hostile_cases()[case]
    _, layouts = _good_payload()
    # the payload still encodes and decodes: rejection is the validator's job
    decoded = decode_transmittable(payload.to_bytes())
    with pytest.raises(InvalidDistroResult):
        distro_results_from_transmittable(decoded, layouts)


def test_quantization_mode_can_be_required() -> None:
    payload, layouts = _good_payload()
    distro_results_from_transmittable(payload, layouts, require_1bit=True)
    with pytest.raises(InvalidDistroResult, match="full values"):
        distro_results_from_transmittable(payload, layouts, require_1bit=False)


def test_malformed_bytes_are_rejected() -> None:
    blob = _good_payload()[0].to_bytes()
    with pytest.raises(InvalidDistroResult, match="trailing"):
        decode_transmittable(blob + b"\0")
    with pytest.raises(InvalidDistroResult, match="malformed"):
        decode_transmittable(blob[:-1])
    with pytest.raises(InvalidDistroResult, match="malformed"):
        decode_transmittable(b"")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_payloads_never_crash_the_receiver(data: st.DataObject) -> None:
    """Flipped, cut or spliced bytes either decode into a valid, appliable result or are
    rejected with InvalidDistroResult: nothing else escapes."""
    payload, layouts = _good_payload()
    blob = bytearray(payload.to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, len(blob) - 1))
        if op == "flip":
            blob[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del blob[pos : pos + data.draw(st.integers(1, 8))]
        else:
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        if not blob:
            blob = bytearray(b"\x00")
    try:
        results = distro_results_from_transmittable(decode_transmittable(bytes(blob)), layouts)
    except InvalidDistroResult:
        return
    params = _model()
    Distro(params, 0.999, 64, 8).apply([results], 1e-3)
    assert all(torch.isfinite(p).all() for _, p in params)


# -- gradient dumps ------------------------------------------------------------------------------


def test_gradient_dump_stream() -> None:
    payload, _ = _good_payload()
    blob = distro_results_to_bytes(payload.distro_results)
    read = list(distro_results_from_reader(io.BytesIO(blob), chunk_size=7))
    assert read == payload.distro_results
    assert list(distro_results_from_reader(io.BytesIO(b""))) == []
    with pytest.raises(ValueError, match=r"unexpected end|remain"):
        list(distro_results_from_reader(io.BytesIO(blob[:-3]), chunk_size=64))
    assert isinstance(read[0], SerializedDistroResult)


def test_roundtrip_distro_result_1bit() -> None:
    """serialized_distro.rs: sign bits survive the wire and decompress to the true signs."""
    from psyche.modeling.compression import compress, decompress

    truth = torch.tensor(
        [
            [0.5000, 0.5000, 0.5000, 0.5000],
            [0.6533, 0.2706, -0.2706, -0.6533],
            [0.5000, -0.5000, -0.5000, 0.5000],
            [0.2706, -0.6533, 0.6533, -0.2706],
        ]
    )
    sparse_idx, raw_val, xshape, totalk = compress(truth, 2**63 - 1)
    wire = serializable_tensor_from_torch(raw_val > 0)
    sparse_val = torch_from_serializable_tensor(from_bytes(to_bytes(wire), SerializableTensor))
    assert sparse_val.dtype == torch.bool
    signs = sparse_val.to(torch.int8) * 2 - 1
    out = decompress(sparse_idx, signs, xshape, totalk, truth.dtype, "cpu")
    assert torch.equal(out, truth.sign())
