"""The data server's vectorized reply codec against the serde declarations, byte for byte, and
on hostile input."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.batch_id import BatchId
from psyche.core.serde import PostcardError, from_bytes, to_bytes
from psyche.data_provider import TokenizedData
from psyche.data_provider.wire import (
    ClientToServerMessage,
    RawTrainingData,
    RawTrainingDataWire,
    RejectionReason,
    RequestRejected,
    RequestTrainingData,
    ServerMessageCodec,
    ServerToClientMessageWire,
    TrainingData,
    UpstreamRequestCodec,
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
    assert back.data_ids == message.data_ids
    assert back.raw_data == raw


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
    assert_truncations_refused(encoded)
    for corrupt in corruptions(encoded, seed=3):
        assert_fast_agrees_with_generic(corrupt)


def assert_truncations_refused(encoded: bytes) -> None:
    """Every proper prefix of a message is refused."""
    for cut in range(len(encoded)):
        with pytest.raises(PostcardError):
            CODEC.decode(encoded[:cut])


def corruptions(encoded: bytes, seed: int, count: int = 300) -> Iterator[bytes]:
    """`count` copies of `encoded`, each with one byte set to a random value."""
    gen = np.random.default_rng(seed)
    for _ in range(count):
        corrupt = bytearray(encoded)
        corrupt[int(gen.integers(len(corrupt)))] = int(gen.integers(256))
        yield bytes(corrupt)


def assert_fast_agrees_with_generic(data: bytes) -> None:
    """The fast decoder accepts exactly what the generic one accepts, as the same value; only
    for the raw-token extension it may refuse more (it also checks widths and lengths)."""
    try:
        generic = from_bytes(data, ServerToClientMessageWire)
    except PostcardError:
        generic = None
    try:
        fast = CODEC.decode(data)
    except PostcardError:
        fast = None
    if isinstance(generic, ServerToClientMessageWire.RawTrainingData) and fast is None:
        return
    assert (fast is None) == (generic is None), data.hex()
    if fast is not None:
        assert to_wire(fast) == generic


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("03000000", "invalid variant index 3"),
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


# ---------------------------------------------------------------------------------------------
# The raw-token extension


def raw_wire(start: int, end: int, seq_len: int, width: int, tokens: bytes) -> bytes:
    return to_bytes(
        ServerToClientMessageWire.RawTrainingData(
            RawTrainingDataWire(BatchId(start, end), seq_len, width, tokens)
        ),
        ServerToClientMessageWire,
    )


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2**64 - 40),
    st.integers(1, 6),
    st.integers(1, 9),
    st.sampled_from([(0, 2**16 - 1), (-(2**31), 2**31 - 1)]),
    st.randoms(use_true_random=False),
)
def test_raw_training_data_round_trips_in_the_narrowest_width(
    start: int, n: int, seq_len: int, bounds: tuple[int, int], rnd
) -> None:
    lo, hi = bounds
    tokens = np.array([[rnd.randint(lo, hi) for _ in range(seq_len)] for _ in range(n)], np.int32)
    message = RawTrainingData(BatchId(start, start + n - 1), tokens)
    encoded = CODEC.encode(message)
    width = 2 if tokens.min() >= 0 and tokens.max() < 2**16 else 4
    body = tokens.astype("<u2" if width == 2 else "<i4").tobytes()
    assert encoded == raw_wire(start, start + n - 1, seq_len, width, body)
    back = CODEC.decode(encoded)
    assert isinstance(back, RawTrainingData)
    assert back.data_ids == message.data_ids
    assert back.tokens.dtype == np.int32
    assert np.array_equal(back.tokens, tokens)
    assert to_wire(back) == from_bytes(encoded, ServerToClientMessageWire)


def test_raw_known_bytes_and_request() -> None:
    message = RawTrainingData(BatchId(3, 4), np.array([[1, 2], [300, 65535]], np.int32))
    # variant 2, start 3, end 4, seq_len 2, width 2, 8 bytes, then u16 LE tokens
    assert CODEC.encode(message).hex() == "0203040202" + "08" + "010002002c01ffff"
    request = ClientToServerMessage.RequestRawTrainingData(RequestTrainingData(BatchId(5, 9)))
    assert to_bytes(request, ClientToServerMessage).hex() == "010509"
    upstream = UpstreamRequestCodec()
    with pytest.raises(PostcardError, match="invalid variant index 1"):
        upstream.decode(bytes.fromhex("010509"))
    plain = ClientToServerMessage.RequestTrainingData(RequestTrainingData(BatchId(5, 9)))
    assert upstream.decode(upstream.encode(plain)) == plain


@pytest.mark.parametrize(
    ("start", "end", "seq_len", "width", "nbytes", "extra", "problem"),
    [
        (0, 1, 2, 3, 12, b"", "token width 3"),
        (0, 1, 2, 2, 6, b"", "needs 8"),
        (0, 1, 2, 2, 10, b"", "needs 8"),
        (2, 1, 2, 2, 0, b"", "empty batch"),
        (0, 1, 0, 2, 0, b"", "empty batch"),
        (0, 2**64 - 1, 1, 2, 4, b"", "needs"),
        (0, 1, 2, 4, 16, b"\x00", "trailing|follow the header"),
    ],
)
def test_malformed_raw_replies(
    start: int, end: int, seq_len: int, width: int, nbytes: int, extra: bytes, problem: str
) -> None:
    data = raw_wire(start, end, seq_len, width, bytes(nbytes)) + extra
    with pytest.raises(PostcardError, match=problem):
        CODEC.decode(data)


def test_truncated_and_corrupted_raw_replies_are_refused_or_exact() -> None:
    message = RawTrainingData(BatchId(7, 9), np.arange(-6, 6, dtype=np.int32).reshape(3, 4))
    encoded = CODEC.encode(message)
    assert_truncations_refused(encoded)
    for corrupt in corruptions(encoded, seed=5):
        assert_fast_agrees_with_generic(corrupt)
        try:
            back = CODEC.decode(corrupt)
        except PostcardError:
            continue
        if isinstance(back, RawTrainingData):  # accepted: the shape is what the header says
            n = back.data_ids.end - back.data_ids.start + 1
            assert back.tokens.shape[0] == n
            assert back.tokens.dtype == np.int32
