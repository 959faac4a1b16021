"""The postcard codec and the TOML/JSON object form: byte vectors, hostile input, round trips."""

from __future__ import annotations

import math
from typing import Annotated, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.bloom import Bloom
from psyche.core.numeric import F32_MAX, I64_MAX, I64_MIN, U64_MAX, to_f32
from psyche.core.serde import (
    F32,
    F64,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    Array,
    DataEnum,
    FixedBytes,
    FixedStr,
    FixedVec,
    PostcardError,
    RustEnum,
    SerdeError,
    SmallBool,
    from_bytes,
    from_obj,
    max_encoded_size,
    struct,
    take_from_bytes,
    to_bytes,
    to_obj,
    variant,
    varint_len,
)


class Color(RustEnum):
    Red = 0
    Green = 1
    Blue = 2


@struct(frozen=True)
class Inner:
    a: U16
    b: str | None = None


class Shape(DataEnum):
    Empty = variant()
    Circle = variant(F64)
    Boxed = variant(Inner)
    Pair = variant(tuple[U8, I64])


SmallBloom = Bloom[2, 3]


@struct(frozen=True, kw_only=True)
class Everything:
    u8: U8
    u16: U16
    u32: U32
    u64: U64
    i8: I8
    i16: I16
    i32: I32
    i64: I64
    f32: F32
    f64: F64
    flag: bool
    small: SmallBool
    text: str
    fixed_text: Annotated[str, FixedStr(8)]
    blob: bytes
    key: Annotated[bytes, FixedBytes(4)]
    maybe: U32 | None = None
    seq: list[I32]
    few: Annotated[list[U16], FixedVec(3)]
    three: Annotated[list[U8], Array(3)]
    pair: tuple[U8, str]
    inner: Inner
    nested: list[Inner | None]
    color: Color
    shape: Shape
    bloom: SmallBloom


# ---- byte vectors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "hexbytes"),
    [(0, "00"), (127, "7f"), (128, "8001"), (300, "ac02"), (16384, "808001"),
     (U64_MAX, "ffffffffffffffffff01")],
)  # fmt: skip
def test_unsigned_varints(value: int, hexbytes: str) -> None:
    assert to_bytes(value, U64).hex() == hexbytes
    assert from_bytes(bytes.fromhex(hexbytes), U64) == value


@pytest.mark.parametrize(
    ("value", "hexbytes"),
    [(0, "00"), (-1, "01"), (1, "02"), (-2, "03"), (63, "7e"), (-64, "7f"), (64, "8001"),
     (I64_MAX, "feffffffffffffffff01"), (I64_MIN, "ffffffffffffffffff01")],
)  # fmt: skip
def test_zigzag_varints(value: int, hexbytes: str) -> None:
    assert to_bytes(value, I64).hex() == hexbytes
    assert from_bytes(bytes.fromhex(hexbytes), I64) == value


def test_fixed_width_and_small_types() -> None:
    assert to_bytes(255, U8) == b"\xff"
    assert to_bytes(-1, I8) == b"\xff"
    assert from_bytes(b"\xff", I8) == -1
    assert to_bytes(-32768, I16).hex() == "ffff03"
    assert to_bytes(65535, U16).hex() == "ffff03"
    assert to_bytes(U64_MAX >> 32, U32).hex() == "ffffffff0f"
    assert to_bytes(1.5, F32).hex() == "0000c03f"
    assert to_bytes(-2.0, F64).hex() == "00000000000000c0"
    assert to_bytes(True, bool) == b"\x01"
    assert to_bytes(False, bool) == b"\x00"
    assert from_bytes(b"\x07", SmallBool) is True
    assert from_bytes(b"\x00", SmallBool) is False


def test_containers() -> None:
    assert to_bytes("test", str).hex() == "0474657374"
    assert to_bytes(b"\x01\x02", bytes).hex() == "020102"
    assert to_bytes(b"\x01\x02\x03\x04", Annotated[bytes, FixedBytes(4)]).hex() == "01020304"
    assert to_bytes(None, U32 | None) == b"\x00"
    assert to_bytes(300, U32 | None).hex() == "01ac02"
    assert to_bytes([1, 300], list[U32]).hex() == "0201ac02"
    assert to_bytes([1, 2, 3], Annotated[list[U8], Array(3)]).hex() == "010203"
    assert to_bytes((7, "a"), tuple[U8, str]).hex() == "070161"
    assert to_bytes(Inner(5, "x")).hex() == "05010178"
    assert to_bytes(Color.Blue, Color) == b"\x02"
    assert to_bytes(Shape.Empty(), Shape) == b"\x00"
    assert to_bytes(Shape.Boxed(Inner(1)), Shape).hex() == "020100"
    assert to_bytes(Shape.Pair((1, -1)), Shape).hex() == "030101"


# ---- hostile input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "tp", "message"),
    [
        (b"", U64, "end of input"),
        (b"\x80", U32, "end of input"),
        (b"\x05abc", str, "needed 5 bytes"),
        (b"\x01\x02", Annotated[bytes, FixedBytes(4)], "needed 4 bytes"),
        (b"\x00\x00", F32, "end of input"),
        (b"\x01", U32 | None, "end of input"),
        (b"\xff\xff\x04", U16, "does not fit in 16 bits"),
        (b"\xff\xff\xff\xff\x10", U32, "does not fit in 32 bits"),
        (b"\xff" * 10 + b"\x01", U64, "longer than 10 bytes"),
        (b"\xff" * 9 + b"\x02", U64, "does not fit in 64 bits"),
        (b"\x03", Color, "invalid variant index 3 for Color"),
        (b"\x09", Shape, "invalid variant index 9 for Shape"),
        (b"\xff\xff\xff\xff\xff\x01", Color, "varint"),
        (b"\x04\x01\x02\x03\x04", Annotated[list[U8], FixedVec(3)], "FixedVec is full"),
        (b"\x02", bool, "invalid bool byte 2"),
        (b"\x02\x00", U8 | None, "invalid option tag 2"),
        (b"\x02\xc3\x28", str, "invalid UTF-8"),
        (b"\xff\xff\xff\xff\x0f", list[U8], "claims 4294967295 items"),
        (b"\x01\x02", U8, "1 trailing bytes"),
    ],
)
def test_decode_errors(data: bytes, tp: Any, message: str) -> None:
    with pytest.raises(PostcardError, match=message):
        from_bytes(data, tp)


def test_take_from_bytes_leaves_the_rest() -> None:
    value, used = take_from_bytes(b"\x05\x01\x02", U8)
    assert (value, used) == (5, 1)


def test_encode_errors() -> None:
    with pytest.raises(PostcardError, match="out of range for u8"):
        to_bytes(256, U8)
    with pytest.raises(PostcardError, match="out of range for i64"):
        to_bytes(I64_MAX + 1, I64)
    with pytest.raises(PostcardError, match="expected u32"):
        to_bytes(True, U32)
    with pytest.raises(PostcardError, match="expected 4 bytes"):
        to_bytes(b"abc", Annotated[bytes, FixedBytes(4)])
    with pytest.raises(PostcardError, match="expected 3 items"):
        to_bytes([1, 2], Annotated[list[U8], Array(3)])
    with pytest.raises(PostcardError, match="is not a Shape"):
        to_bytes(Color.Red, Shape)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_garbage_never_crashes_the_decoder(data: bytes) -> None:
    try:
        value = from_bytes(data, Everything)
    except PostcardError:
        return
    # whatever decodes must encode back to something that decodes to the same value
    again = from_bytes(to_bytes(value), Everything)
    assert to_bytes(again) == to_bytes(value)


# ---- round trips -----------------------------------------------------------------------------


def ints(bits: int, signed: bool) -> st.SearchStrategy[int]:
    if signed:
        return st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    return st.integers(0, (1 << bits) - 1)


fixed_texts = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=8
).map(lambda s: s.encode()[:8].decode("utf-8", errors="ignore"))
inners = st.builds(Inner, ints(16, False), st.none() | st.text(max_size=5))
shapes = st.one_of(
    st.just(Shape.Empty()),
    st.floats(allow_nan=False).map(Shape.Circle),
    inners.map(Shape.Boxed),
    st.tuples(ints(8, False), ints(64, True)).map(Shape.Pair),
)
u64s = ints(64, False)


@st.composite
def blooms(draw: st.DrawFn) -> Bloom:
    return SmallBloom(
        draw(st.lists(u64s, min_size=3, max_size=3)), draw(st.lists(u64s, min_size=2, max_size=2))
    )


def everything(allow_nan: bool = False) -> st.SearchStrategy[Everything]:
    return st.builds(
        Everything,
        u8=ints(8, False),
        u16=ints(16, False),
        u32=ints(32, False),
        u64=u64s,
        i8=ints(8, True),
        i16=ints(16, True),
        i32=ints(32, True),
        i64=ints(64, True),
        f32=st.floats(width=32, allow_nan=allow_nan),
        f64=st.floats(allow_nan=allow_nan),
        flag=st.booleans(),
        small=st.booleans(),
        text=st.text(max_size=10),
        fixed_text=fixed_texts,
        blob=st.binary(max_size=10),
        key=st.binary(min_size=4, max_size=4),
        maybe=st.none() | ints(32, False),
        seq=st.lists(ints(32, True), max_size=5),
        few=st.lists(ints(16, False), max_size=3),
        three=st.lists(ints(8, False), min_size=3, max_size=3),
        pair=st.tuples(ints(8, False), st.text(max_size=4)),
        inner=inners,
        nested=st.lists(st.none() | inners, max_size=3),
        color=st.sampled_from(Color),
        shape=shapes,
        bloom=blooms(),
    )


@settings(max_examples=150, deadline=None)
@given(everything())
def test_postcard_round_trip(value: Everything) -> None:
    assert from_bytes(to_bytes(value), Everything) == value


@settings(max_examples=50, deadline=None)
@given(everything(allow_nan=True))
def test_postcard_bytes_are_stable(value: Everything) -> None:
    encoded = to_bytes(value)
    assert to_bytes(from_bytes(encoded, Everything)) == encoded


@settings(max_examples=100, deadline=None)
@given(everything())
def test_object_round_trip(value: Everything) -> None:
    obj = to_obj(value)
    assert from_obj(obj, Everything) == value
    # u64 values beyond TOML's range are written as decimal strings
    if value.u64 > I64_MAX:
        assert obj["u64"] == str(value.u64)


@pytest.mark.parametrize(
    ("tp", "value"),
    [(U8, 0), (U8, 255), (U16, 65535), (U32, 2**32 - 1), (U64, U64_MAX), (I8, -128), (I8, 127),
     (I16, -(2**15)), (I32, 2**31 - 1), (I64, I64_MIN), (I64, I64_MAX)],
)  # fmt: skip
def test_integer_boundaries(tp: Any, value: int) -> None:
    assert from_bytes(to_bytes(value, tp), tp) == value
    assert from_obj(to_obj(value, tp), tp) == value


def test_floats_keep_their_bits() -> None:
    for value in (math.inf, -math.inf, -0.0, 5e-324):
        assert math.copysign(1, from_bytes(to_bytes(value, F64), F64)) == math.copysign(1, value)
    assert math.isnan(from_bytes(to_bytes(math.nan, F32), F32))
    assert from_bytes(to_bytes(0.1, F32), F32) == to_f32(0.1)


def test_object_errors_name_the_field() -> None:
    obj = to_obj(
        Everything(
            u8=1, u16=1, u32=1, u64=1, i8=1, i16=1, i32=1, i64=1, f32=1.0, f64=1.0, flag=True,
            small=False, text="", fixed_text="", blob=b"", key=bytes(4), seq=[], few=[],
            three=[0, 0, 0], pair=(0, ""), inner=Inner(0), nested=[], color=Color.Red,
            shape=Shape.Empty(), bloom=SmallBloom(),
        )
    )  # fmt: skip
    obj["u8"] = 256
    obj["color"] = "Purple"
    obj["nested"] = [{"a": -1}]
    with pytest.raises(SerdeError) as info:
        from_obj(obj, Everything, source="state.toml")
    text = str(info.value)
    assert text.startswith("state.toml: 3 problems")
    assert "u8: 256 is out of range for u8" in text
    assert "unknown Color variant" in text
    assert "nested[0].a" in text


def test_f32_extremes_in_objects() -> None:
    # Rust prints f32::MAX as 3.4028235e38, a decimal just above it that must round down
    assert to_obj(F32_MAX, F32) == 3.4028235e38
    assert from_obj(3.4028235e38, F32) == F32_MAX
    assert from_bytes(to_bytes(3.4028235e38, F32), F32) == F32_MAX
    with pytest.raises(SerdeError, match="out of range for f32"):
        from_obj(3.5e38, F32)


def test_plain_bytes_object_form() -> None:
    assert to_obj(b"\x01\x02", bytes) == [1, 2]
    assert from_obj([1, 2], bytes) == b"\x01\x02"
    with pytest.raises(SerdeError):
        from_obj([256], bytes)


def test_missing_option_fields_read_as_none() -> None:
    assert from_obj({"a": 3}, Inner) == Inner(3, None)
    assert from_obj([{"a": 1}, None], list[Inner | None]) == [Inner(1), None]
    obj = {"Boxed": {"a": 2}}
    assert from_obj(obj, Shape) == Shape.Boxed(Inner(2))
    assert obj == {"Boxed": {"a": 2}}  # the caller's object is left alone


@settings(max_examples=200, deadline=None)
@given(everything(), st.data())
def test_corrupted_encodings_fail_cleanly(value: Everything, data: st.DataObject) -> None:
    encoded = bytearray(to_bytes(value))
    position = data.draw(st.integers(0, len(encoded) - 1))
    action = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
    if action == "flip":
        encoded[position] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del encoded[position:]
    else:
        encoded.insert(position, data.draw(st.integers(0, 255)))
    try:
        decoded = from_bytes(bytes(encoded), Everything)
    except PostcardError:
        return
    assert isinstance(decoded, Everything)


@struct
class _Fullest:
    a: U8
    b: U16
    c: U64
    d: I32
    e: F32
    f: Annotated[str, FixedStr(10)]
    g: Annotated[list[U32], FixedVec(3)]
    h: U64 | None
    i: Annotated[bytes, FixedBytes(4)]
    j: Annotated[list[I8], Array(2)]


def test_max_encoded_size_is_what_the_fullest_value_takes() -> None:
    """What a receiver may accept for a message before decoding it (issue 24): every integer at
    its widest varint, every fixed container full, every option present."""
    fullest = _Fullest(255, 65535, U64_MAX, -(2**31), 1.0, "x" * 10, [2**32 - 1] * 3, U64_MAX,
                       b"abcd", [-1, -1])  # fmt: skip
    assert max_encoded_size(_Fullest) == len(to_bytes(fullest))
    small = _Fullest(0, 0, 0, 0, 0.0, "", [], None, bytes(4), [0, 0])
    assert len(to_bytes(small)) < len(to_bytes(fullest))
    for unbounded in (str, bytes, list[U8], tuple[U8, str]):
        assert max_encoded_size(unbounded) is None
    # a bloom filter states its own bound: its keys and words are fixed
    bloom = Bloom[16, 8]
    assert max_encoded_size(bloom) == len(to_bytes(bloom([U64_MAX] * 8, [U64_MAX] * 16)))
    assert varint_len(0) == 1
    assert varint_len(127) == 1
    assert varint_len(128) == 2
    assert varint_len(U64_MAX) == 10
