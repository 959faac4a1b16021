"""FixedString / FixedVec semantics (upstream fixed_string.rs, fixed_vec.rs, serde_utils.rs)."""

from __future__ import annotations

from typing import Annotated

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.fixed import (
    FixedStringError,
    FixedVecError,
    fixed_str_debug,
    fixed_str_deserialize,
    fixed_str_display,
    fixed_str_from_str_truncated,
    fixed_str_is_empty,
    fixed_str_serialize,
    fixed_str_try_from,
    fixed_vec_extend,
    fixed_vec_insert,
    fixed_vec_push,
    fixed_vec_remove,
    fixed_vec_try_from,
    vec_to_array,
)
from psyche.core.serde import (
    U32,
    FixedStr,
    FixedVec,
    PostcardError,
    SerdeError,
    from_bytes,
    from_obj,
    struct,
    to_bytes,
    to_obj,
)

# ---- FixedString -----------------------------------------------------------------------------


def test_try_from_error_text() -> None:
    assert fixed_str_try_from("run", 32) == "run"
    with pytest.raises(FixedStringError, match=r"string of length 5 doesn't fit in FixedString<4>"):
        fixed_str_try_from("héll", 4)  # 5 UTF-8 bytes


def test_from_str_truncated_may_cut_a_character() -> None:
    assert fixed_str_from_str_truncated("abcdef", 4) == "abcd"
    assert fixed_str_from_str_truncated("abcé", 4) == "abc\ufffd"
    assert fixed_str_from_str_truncated("ab", 4) == "ab"


def test_debug_and_display() -> None:
    assert fixed_str_debug("run", 32) == '"run" (3/32 bytes, 29 zeroes)'
    assert fixed_str_debug("abcd", 4) == '"abcd" (4/4 bytes, 0 zeroes)'
    assert fixed_str_debug("", 8) == '"" (0/8 bytes, 8 zeroes)'
    assert fixed_str_display("ab\0cd", 8) == "ab"
    assert fixed_str_debug("ab\0cd", 8) == '"ab" (2/8 bytes, 6 zeroes)'
    assert fixed_str_is_empty("")
    assert fixed_str_is_empty("\0x")
    assert not fixed_str_is_empty("x")


def test_serialize_trims_nuls_at_both_ends() -> None:
    assert fixed_str_serialize("\0ab\0cd\0", 8) == "ab\0cd"
    assert fixed_str_serialize("abcdef", 4) == "abcd"


def test_deserialize_truncates_silently() -> None:
    assert fixed_str_deserialize("abcdef", 4) == "abcd"
    assert fixed_str_deserialize("ab\0\0", 8) == "ab"


@struct(frozen=True)
class Named:
    name: Annotated[str, FixedStr(4)]


def test_postcard_truncates_lossily_like_upstream() -> None:
    # A sender's 5-byte "abcé" is cut to 4 bytes, 61 62 63 c3; upstream writes those back out
    # as lossy UTF-8: "abc" + U+FFFD.
    wire = bytes([5]) + "abcé".encode()
    value = from_bytes(wire, Named)
    assert value.name == "abc\ufffd"
    assert to_bytes(value) == bytes([6]) + "abc\ufffd".encode()
    # and that form is stable from then on
    assert from_bytes(to_bytes(value), Named) == value


def test_postcard_rejects_invalid_utf8() -> None:
    with pytest.raises(PostcardError, match="UTF-8"):
        from_bytes(bytes([2, 0xC3, 0x28]), Named)


def test_postcard_nul_handling() -> None:
    assert from_bytes(bytes([3]) + b"ab\0", Named).name == "ab"
    assert to_bytes(Named("\0ab")) == bytes([2]) + b"ab"
    assert to_obj(Named("\0ab\0")) == {"name": "ab"}


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=12), st.integers(1, 12))
def test_fixed_string_wire_form_is_stable_after_one_round(text: str, capacity: int) -> None:
    once = fixed_str_serialize(fixed_str_deserialize(text, capacity), capacity)
    twice = fixed_str_serialize(fixed_str_deserialize(once, capacity), capacity)
    assert once == twice


def test_from_obj_reports_overlong_strings() -> None:
    with pytest.raises(SerdeError, match="name: string of 5 bytes doesn't fit in FixedString<4>"):
        from_obj({"name": "abcde"}, Named)


# ---- serde_utils (upstream's three round trips) ------------------------------------------------


@struct(frozen=True)
class MyOptionalStrStruct:
    field: Annotated[str, FixedStr(64)] | None = None


@struct(frozen=True)
class MyStrStruct:
    field: Annotated[str, FixedStr(64)]


def test_serialize_deserialize_optional_string_some() -> None:
    value = MyOptionalStrStruct("\x01" * 64)
    encoded = to_bytes(value)
    assert encoded == bytes([1, 64]) + b"\x01" * 64
    assert from_bytes(encoded, MyOptionalStrStruct) == value


def test_serialize_deserialize_optional_string_none() -> None:
    value = MyOptionalStrStruct(None)
    assert to_bytes(value) == b"\x00"
    assert from_bytes(b"\x00", MyOptionalStrStruct) == value
    assert from_obj({}, MyOptionalStrStruct) == value


def test_serialize_deserialize_string() -> None:
    value = MyStrStruct("\x01" * 64)
    assert from_bytes(to_bytes(value), MyStrStruct) == value


def test_vec_to_array() -> None:
    assert vec_to_array([1, 2, 3], 2, 0) == [1, 2]
    assert vec_to_array([1], 3, 0) == [1, 0, 0]


# ---- FixedVec --------------------------------------------------------------------------------

CAP = 6


def test_initial_state() -> None:
    vec: list[int] = []
    assert len(vec) == 0
    assert fixed_vec_remove(vec, 0) is None


def test_push_and_access() -> None:
    vec: list[int] = []
    for x in (1, 2, 3):
        fixed_vec_push(vec, x, CAP)
    assert vec == [1, 2, 3]
    assert len(vec) < CAP


def test_pop() -> None:
    vec = fixed_vec_try_from([1, 2, 3], CAP)
    assert vec.pop() == 3
    assert vec == [1, 2]


def test_insert_and_remove() -> None:
    vec = fixed_vec_try_from([1, 2, 3], CAP)
    fixed_vec_insert(vec, 1, 9, CAP)
    assert vec == [1, 9, 2, 3]
    assert fixed_vec_remove(vec, 1) == 9
    assert vec == [1, 2, 3]
    assert fixed_vec_remove(vec, 3) is None
    with pytest.raises(FixedVecError, match="Index out of bounds"):
        fixed_vec_insert(vec, 4, 0, CAP)


def test_full_vec_behavior() -> None:
    vec: list[int] = []
    fixed_vec_extend(vec, [1, 2, 3, 4, 5, 6], CAP)
    assert len(vec) == CAP
    with pytest.raises(FixedVecError, match="FixedVec is full"):
        fixed_vec_push(vec, 7, CAP)
    with pytest.raises(FixedVecError, match="FixedVec is full"):
        fixed_vec_insert(vec, 1, 9, CAP)
    assert vec == [1, 2, 3, 4, 5, 6]


def test_extend_is_partial_on_overflow() -> None:
    vec = [1, 2, 3, 4, 5]
    with pytest.raises(FixedVecError, match="FixedVec is full"):
        fixed_vec_extend(vec, [6, 7, 8], CAP)
    assert vec == [1, 2, 3, 4, 5, 6]
    with pytest.raises(FixedVecError, match="FixedVec is full"):
        fixed_vec_try_from(range(7), CAP)


def test_retain() -> None:
    vec = fixed_vec_try_from([1, 2, 3, 4, 5, 6], CAP)
    vec[:] = [x for x in vec if x % 2 == 0]
    assert vec == [2, 4, 6]


def test_clear() -> None:
    vec = fixed_vec_try_from([1, 2, 3, 4, 5, 6], CAP)
    vec.clear()
    assert vec == []
    fixed_vec_push(vec, 1, CAP)
    assert vec == [1]


def test_clear_empty_vec() -> None:
    vec: list[int] = []
    vec.clear()
    assert vec == []


@struct(frozen=True)
class Holder:
    items: Annotated[list[U32], FixedVec(3)]


def test_fixed_vec_wire_capacity() -> None:
    assert to_bytes(Holder([1, 2, 3])) == bytes([3, 1, 2, 3])
    with pytest.raises(PostcardError, match="FixedVec is full"):
        from_bytes(bytes([4, 1, 2, 3, 4]), Holder)
    with pytest.raises(PostcardError):
        to_bytes(Holder([1, 2, 3, 4]))
    with pytest.raises(SerdeError, match="items: at most 3 items fit, found 4"):
        from_obj({"items": [1, 2, 3, 4]}, Holder)
