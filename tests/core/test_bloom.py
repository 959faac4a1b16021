from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.bloom import Bloom, WitnessBloom, fnv1a_64
from psyche.core.numeric import U64_MAX
from psyche.core.serde import PostcardError, SerdeError, from_bytes, from_obj, to_bytes, to_obj
from psyche.core.sha256 import sha256

DEFAULT_WITNESS_BLOOM = bytes.fromhex(
    "08" + "00" * 8 + "13" + b"bitvec::order::Lsb0".hex() + "40" + "00" + "8008" + "00" * 16
)


def test_bloom_new() -> None:
    bloom = Bloom[16, 3].new(100, [1, 2, 3])
    assert bloom.keys == (1, 2, 3)


def test_bloom_add_and_contains() -> None:
    bloom = Bloom[8, 2].new(100, [1, 2])
    bloom.add(bytes([1, 2, 3]))
    assert bloom.contains(bytes([1, 2, 3]))
    assert not bloom.contains(bytes([4, 5, 6]))


def test_bloom_clear() -> None:
    bloom = Bloom[8, 2].new(100, [1, 2])
    bloom.add(bytes([1, 2, 3]))
    assert bloom.contains(bytes([1, 2, 3]))
    bloom.clear()
    assert not bloom.contains(bytes([1, 2, 3]))
    assert bloom.keys == (1, 2)


def test_multiple_items() -> None:
    bloom = Bloom[16, 3].new(1000, [1, 2, 3])
    items = [bytes([1, 2, 3]), bytes([4, 5, 6]), bytes([7, 8, 9])]
    for item in items:
        bloom.add(item)
    for item in items:
        assert item in bloom
    assert not bloom.contains(bytes([1, 4, 7]))


def test_fnv_values() -> None:
    assert fnv1a_64(bytes([1, 2, 3]), 1) == 1912050721080479
    assert fnv1a_64(bytes([1, 2, 3]), 2) == 1874410039884497926
    # with the standard offset basis it is plain FNV-1a-64
    assert fnv1a_64(b"a", 0xCBF29CE484222325) == 0xAF63DC4C8601EC8C


def test_positions_and_words() -> None:
    bloom = Bloom[8, 2]([1, 2])
    assert bloom.positions(bytes([1, 2, 3])) == [159, 6]
    assert bloom.positions(bytes([4, 5, 6])) == [344, 105]
    bloom.add(bytes([1, 2, 3]))
    assert bloom.words == [0x40, 0, 0x80000000, 0, 0, 0, 0, 0]
    bloom = Bloom[16, 3]([1, 2, 3])
    assert bloom.positions(bytes([1, 2, 3])) == [159, 6, 29]
    assert bloom.positions(bytes([4, 5, 6])) == [856, 105, 274]
    assert bloom.positions(bytes([7, 8, 9])) == [357, 1012, 383]
    assert bloom.positions(bytes([1, 4, 7])) == [753, 192, 51]


def test_position_uses_whole_bit_length_even_if_not_power_of_two() -> None:
    bloom = Bloom[3, 2]([5, 6])
    item = b"abc"
    assert bloom.positions(item) == [fnv1a_64(item, 5) % 192, fnv1a_64(item, 6) % 192]


@settings(max_examples=100, deadline=None)
@given(
    st.binary(max_size=64),
    st.lists(st.integers(0, U64_MAX), min_size=8, max_size=8),
)
def test_all_keys_at_once_matches_reference_fnv(item: bytes, keys: list[int]) -> None:
    bloom = WitnessBloom(keys)
    assert bloom.positions(item) == [fnv1a_64(item, k) % 1024 for k in keys]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=60))
def test_no_false_negatives(items: list[bytes]) -> None:
    bloom = WitnessBloom.random(len(items), 0.01)
    for item in items:
        bloom.add(item)
    assert all(bloom.contains(item) for item in items)
    assert from_bytes(to_bytes(bloom), WitnessBloom) == bloom


def test_default_witness_bloom_postcard() -> None:
    encoded = to_bytes(WitnessBloom())
    assert len(encoded) == 49
    assert encoded == DEFAULT_WITNESS_BLOOM
    assert from_bytes(encoded, WitnessBloom) == WitnessBloom()


def test_postcard_of_a_filled_bloom() -> None:
    bloom = WitnessBloom([1, 2, 3, 4, 5, 6, 7, 2**64 - 1])
    bloom.add(sha256(b"client"))
    encoded = to_bytes(bloom)
    # keys: a Vec<u64> (length, then varints)
    assert encoded[:8] == bytes([8, 1, 2, 3, 4, 5, 6, 7])
    assert encoded[8:18] == b"\xff" * 9 + b"\x01"
    decoded = from_bytes(encoded, WitnessBloom)
    assert decoded == bloom
    assert decoded.words == bloom.words


def _with(data: bytes, offset: int, new: bytes, old_len: int = 1) -> bytes:
    return data[:offset] + new + data[offset + old_len :]


def test_deserialize_checks() -> None:
    good = DEFAULT_WITNESS_BLOOM
    cases = {
        "Expected 8 keys, got 7": bytes([7]) + good[2:],
        'invalid value: string "bitvec::order::Msb0"': _with(good, 10 + 15, b"M"),
        "invalid type: integer `32`, expected a valid `BitIdx<u64>`": _with(good, 29, b"\x20"),
        "invalid value: integer `64`, expected a valid `BitIdx<u64>`": _with(good, 30, b"\x40"),
        "must have a head-bit of `0`": _with(good, 30, b"\x03"),
        "invalid length 1023": _with(good, 31, b"\xff\x07", 2),
    }
    for message, data in cases.items():
        with pytest.raises(PostcardError, match=message.replace("[", r"\[").replace("`", ".")):
            from_bytes(data, WitnessBloom)


def test_deserialize_rejects_truncated_and_trailing() -> None:
    with pytest.raises(PostcardError):
        from_bytes(DEFAULT_WITNESS_BLOOM[:-1], WitnessBloom)
    with pytest.raises(PostcardError, match="trailing"):
        from_bytes(DEFAULT_WITNESS_BLOOM + b"\x00", WitnessBloom)


def test_toml_form_round_trips() -> None:
    bloom = WitnessBloom.random(10, 0.01)
    bloom.add(b"x")
    obj = to_obj(bloom)
    assert obj["bits"]["order"] == "bitvec::order::Lsb0"
    assert obj["bits"]["head"] == {"width": 64, "index": 0}
    assert obj["bits"]["bits"] == 1024
    assert len(obj["bits"]["data"]) == 16
    assert from_obj(obj, WitnessBloom) == bloom
    obj["keys"] = obj["keys"][:3]
    with pytest.raises(SerdeError, match="Expected 8 keys, got 3"):
        from_obj(obj, WitnessBloom)


def test_words_view_round_trips() -> None:
    bloom = WitnessBloom.random(10, 0.01)
    bloom.add(b"item")
    words = bloom.to_words()
    assert len(words) == 24
    assert words[:8] == list(bloom.keys)
    assert WitnessBloom.from_words(words) == bloom
    with pytest.raises(ValueError, match="expected 24 u64 values, got 23"):
        WitnessBloom.from_words(words[:-1])


def test_random_keys_are_fresh_and_bits_empty() -> None:
    a, b = WitnessBloom.random(256, 0.01), WitnessBloom.random(256, 0.01)
    assert a.keys != b.keys
    assert a.words == [0] * 16
    # degenerate inputs do not fail (upstream only asserts the computed size)
    for n, p in [(0, 0.01), (5, 0.0), (0, 0.0), (5, 2.0)]:
        assert len(WitnessBloom.random(n, p).keys) == 8


def test_num_bits_formula() -> None:
    assert Bloom.num_bits(256, 0.01) == 2454.0
    assert Bloom.num_bits(0, 0.01) == 0.0
    assert Bloom.num_bits(5, 0.0) == float("inf")


def test_construction_errors() -> None:
    with pytest.raises(ValueError, match="Expected 8 keys"):
        WitnessBloom([1, 2])
    with pytest.raises(ValueError, match="exceeds"):
        WitnessBloom.new(1025, [0] * 8)
    with pytest.raises(ValueError, match="u64"):
        WitnessBloom([-1] * 8)
    with pytest.raises(TypeError):
        Bloom()


def test_value_semantics() -> None:
    bloom = WitnessBloom.random(4, 0.01)
    bloom.add(b"a")
    copy = bloom.copy()
    assert copy == bloom
    copy.add(b"b")
    assert copy != bloom
    assert pickle.loads(pickle.dumps(bloom)) == bloom
    assert Bloom[16, 8] is WitnessBloom
    assert WitnessBloom() != Bloom[16, 7]()


def test_debug_form() -> None:
    bloom = Bloom[2, 1]([0])
    bloom.add(b"")
    assert repr(bloom) == "Bloom { keys.len: 1, bits: " + f"{1:016x}" + "0" * 16 + " }"


class NamedBloom(Bloom, num_words=16, num_keys=8):
    """A sized bloom declared as a subclass: the same type as Bloom[16, 8] on the wire."""


def test_named_subclass_form() -> None:
    bloom = NamedBloom.random(4, 0.01)
    bloom.add(b"a")
    assert to_bytes(bloom) == to_bytes(WitnessBloom(bloom.keys, bloom.words))
    decoded = from_bytes(to_bytes(bloom), NamedBloom)
    assert type(decoded) is NamedBloom
    assert decoded == bloom == WitnessBloom(bloom.keys, bloom.words)
    again = pickle.loads(pickle.dumps(bloom))
    assert type(again) is NamedBloom
    assert again == bloom
    with pytest.raises(ValueError, match="needs words >= 1"):
        Bloom[0, 8]


def _bloom_with_bits(keys: list[int], positions: set[int]) -> Bloom:
    words = [0] * WitnessBloom.num_words
    for position in positions:
        words[position // 64] |= 1 << (position % 64)
    return WitnessBloom(keys, words)


def test_an_item_is_present_only_when_every_one_of_its_bits_is_set() -> None:
    keys = [1, 2, 3, 4, 5, 6, 7, 8]
    item = b"probe"
    positions = set(WitnessBloom(keys).positions(item))
    assert len(positions) >= 2, "the probe must set several distinct bits"
    assert _bloom_with_bits(keys, positions).contains(item)
    for missing in sorted(positions):
        # Every bit of the item but one: absent.
        assert not _bloom_with_bits(keys, positions - {missing}).contains(item)
        # Exactly one of the item's bits: absent.
        assert not _bloom_with_bits(keys, {missing}).contains(item)


def test_an_added_item_sharing_some_bits_does_not_make_another_present() -> None:
    # A small filter, so that some item shares part (not all) of its bits with the added one.
    bloom = Bloom[1, 2]([1, 2])
    added = b"added"
    bloom.add(added)
    set_bits = set(bloom.positions(added))
    partial = next(
        candidate
        for candidate in (i.to_bytes(2, "little") for i in range(1 << 16))
        if len(set(bloom.positions(candidate)) & set_bits) > 0
        and not set(bloom.positions(candidate)) <= set_bits
    )
    shared = set(bloom.positions(partial)) & set_bits
    assert shared
    assert not set(bloom.positions(partial)) <= set_bits
    assert not bloom.contains(partial)
    assert partial not in bloom
