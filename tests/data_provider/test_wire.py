"""The data server's vectorized reply codec against the serde declarations, byte for byte, and
on hostile input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.batch_id import BatchId
from psyche.core.serde import PostcardError, from_bytes, to_bytes
from psyche.data_provider import TokenizedData
from psyche.data_provider.wire import (
    ClientToServerMessage,
    RejectionReason,
    RequestRejected,
    RequestTrainingData,
    ServerMessageCodec,
    ServerToClientMessageWire,
    TrainingData,
    decode_varints,
    encode_varints,
    to_wire,
)

CODEC = ServerMessageCodec()
u64 = st.integers(0, 2**64 - 1)
i32_lists = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12)
small_i32_lists = st.lists(st.integers(-3000, 40000), max_size=12)


@st.composite
def samples(draw: st.DrawFn) -> TokenizedData:
    ints = draw(st.sampled_from([i32_lists, small_i32_lists]))
    optional = st.one_of(st.none(), ints)
    return TokenizedData(
        np.array(draw(ints), dtype=np.int32),
        *(None if (v := draw(optional)) is None else np.array(v, dtype=np.int32) for _ in range(3)),
    )


@settings(max_examples=200, deadline=None)
@given(u64, u64, st.lists(samples(), max_size=4))
def test_training_data_bytes_equal_serde(start: int, end: int, raw: list[TokenizedData]) -> None:
    message = TrainingData(BatchId(start, end), raw)
    encoded = CODEC.encode(message)
    assert encoded == to_bytes(to_wire(message), ServerToClientMessageWire)
    back = CODEC.decode(encoded)
    assert isinstance(back, TrainingData)
    assert back.data_ids == message.data_ids and back.raw_data == raw


@given(u64, u64, st.sampled_from(list(RejectionReason)))
def test_rejection_bytes_equal_serde(start: int, end: int, reason: RejectionReason) -> None:
    message = RequestRejected(BatchId(start, end), reason)
    encoded = CODEC.encode(message)
    assert encoded == to_bytes(
        ServerToClientMessageWire.RequestRejected(message), ServerToClientMessageWire
    )
    assert CODEC.decode(encoded) == message


def test_known_bytes() -> None:
    message = TrainingData(BatchId(1, 300), [TokenizedData(np.array([0, -1, 64], dtype=np.int32))])
    # variant 0, start 1, end 300 = ac 02, one sample, 3 ids: 0 -> 00, -1 -> 01, 64 -> 80 01,
    # then three None options.
    assert CODEC.encode(message).hex() == "0001ac02010300018001000000"
    request = ClientToServerMessage.RequestTrainingData(RequestTrainingData(BatchId(5, 9)))
    assert to_bytes(request, ClientToServerMessage).hex() == "000509"


@given(st.lists(u64, max_size=50))
def test_varints_round_trip(values: list[int]) -> None:
    array = np.array(values, dtype=np.uint64)
    encoded = encode_varints(array)
    from psyche.core.serde import encode_varint

    expected = bytearray()
    for v in values:
        encode_varint(v, expected)
    assert encoded == bytes(expected)
    decoded, _ = decode_varints(encoded)
    assert decoded.tolist() == values


def test_truncated_and_corrupted_replies_match_the_generic_decoder() -> None:
    message = TrainingData(
        BatchId(7, 8),
        [
            TokenizedData(np.arange(-5, 5, dtype=np.int32), labels=np.full(10, -100, np.int32)),
            TokenizedData(np.arange(10, dtype=np.int32), sequence_lengths=np.array([10], np.int32)),
        ],
    )
    encoded = CODEC.encode(message)
    for cut in range(len(encoded)):
        with pytest.raises(PostcardError):
            CODEC.decode(encoded[:cut])
    gen = np.random.default_rng(3)
    for _ in range(300):
        corrupt = bytearray(encoded)
        corrupt[int(gen.integers(len(corrupt)))] = int(gen.integers(256))
        # The fast decoder must accept exactly what the generic one accepts, as the same value.
        try:
            generic = from_bytes(bytes(corrupt), ServerToClientMessageWire)
        except PostcardError:
            generic = None
        try:
            fast = CODEC.decode(bytes(corrupt))
        except PostcardError:
            fast = None
        assert (fast is None) == (generic is None), bytes(corrupt).hex()
        if fast is not None:
            assert to_wire(fast) == generic


@pytest.mark.parametrize(
    "raw, problem",
    [
        ("02000000", "invalid variant index 2"),
        ("01000002", "invalid variant index 2 for RejectionReason"),
        ("0000000a", "raw_data claims 10 samples"),
        ("0000000109010200000000", "claims 9 items"),
        ("000000010100020000", "invalid option tag 2"),
        ("00000001018080808010000000", "does not fit in 32 bits"),
        ("00ffffffffffffffffff7f00", "varint"),
        ("0000000100000000ff", "unexpected end"),
        ("0000000001", "trailing"),
    ],
)
def test_malformed_replies(raw: str, problem: str) -> None:
    with pytest.raises(PostcardError, match=problem):
        CODEC.decode(bytes.fromhex(raw))
    with pytest.raises(PostcardError):
        from_bytes(bytes.fromhex(raw), ServerToClientMessageWire)
