"""In-memory (`#[repr(C)]`) layout of upstream types: how the zero-copy coordinator account is stored.

The on-chain `CoordinatorAccount` is not borsh: Anchor hands the program a pointer into the
account bytes (bytemuck), so the bytes are the Rust structs' memory layout on a 64-bit
little-endian machine. Layouts are computed here from the same `psyche.core.serde` declarations
that drive postcard and borsh, with rustc's rules:

* a struct places its fields in order, each at the next multiple of its alignment; its size is
  rounded up to its largest alignment;
* a field-less enum is a C `int` (u32), except the `#[repr(u8)]` ones named in the rules;
* an enum with data is `{tag: u32, union}`, the union at the next multiple of its largest variant
  alignment; unused union bytes are left as they are;
* `Option<T>` (for the T used here: byte arrays and f32, which have no niche) is a one-byte tag
  then T at T's alignment;
* `FixedVec<T, N>` is `{data: [T; N], len: u64}`: the length comes after the data;
* `Bloom<U, K>` is `{keys: [u64; K], bits: [u64; U]}`;
* a few upstream structs are not `repr(C)`, and rustc reorders their fields: the rules name the
  order it chose.

Decoding reads only the used slots of a FixedVec and ignores padding (which is not zero in real
accounts); encoding writes into a zero-filled buffer, so padding and unused slots come out zero.
"""

from __future__ import annotations

import struct as _struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from psyche.core.bloom import Bloom
from psyche.core.serde import schema
from psyche.core.serde.schema import DataEnum, RustEnum, wire_type
from psyche.solana.borsh import fixed_str_bytes, fixed_str_decode

Encode = Callable[[Any, bytearray, int], None]
Decode = Callable[[memoryview, int], Any]

_U8 = _struct.Struct("<B")
_U32 = _struct.Struct("<I")
_U64 = _struct.Struct("<Q")


class ReprCError(ValueError):
    """Bytes that do not hold a valid value of the expected type, or a value that cannot be
    stored."""


def align_up(offset: int, align: int) -> int:
    return (offset + align - 1) // align * align


@dataclass(frozen=True)
class ReprCRules:
    """What the declarations alone do not say about the memory layout."""

    # `#[repr(u8)]` field-less enums; every other field-less enum is a 4-byte C int.
    u8_enums: frozenset[type] = frozenset()
    # Structs that are not `#[repr(C)]`: their fields in the order rustc placed them.
    field_orders: Mapping[type, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Layout:
    size: int
    align: int
    encode: Encode
    decode: Decode
    # For structs: (field name, offset, layout) in memory order.
    fields: tuple[tuple[str, int, Layout], ...] = ()

    def offset_of(self, path: str) -> int:
        """Byte offset of a dotted field path, e.g. `"coordinator.epoch_state.rounds_head"`."""
        offset, layout = 0, self
        for name in path.split("."):
            for field_name, field_offset, field_layout in layout.fields:
                if field_name == name:
                    offset += field_offset
                    layout = field_layout
                    break
            else:
                raise KeyError(f"no field {name!r} in layout ({path})")
        return offset


class ReprC:
    """A layout engine for one set of rules; layouts are computed once per type."""

    def __init__(self, rules: ReprCRules) -> None:
        self.rules = rules
        self._cache: dict[int, Layout] = {}

    def layout(self, tp: Any) -> Layout:
        return self._layout(wire_type(tp))

    def decode(self, data: bytes | bytearray | memoryview, tp: Any, offset: int = 0) -> Any:
        layout = self.layout(tp)
        buf = memoryview(data)
        if offset + layout.size > len(buf):
            raise ReprCError(f"need {layout.size} bytes at offset {offset}, have {len(buf)}")
        return layout.decode(buf, offset)

    def encode(self, value: Any, tp: Any) -> bytes:
        layout = self.layout(tp)
        buf = bytearray(layout.size)
        layout.encode(value, buf, 0)
        return bytes(buf)

    def encode_into(self, value: Any, tp: Any, buf: bytearray, offset: int = 0) -> None:
        layout = self.layout(tp)
        if offset + layout.size > len(buf):
            raise ReprCError(f"need {layout.size} bytes at offset {offset}, have {len(buf)}")
        layout.encode(value, buf, offset)

    # ---- compilation ---------------------------------------------------------------------

    def _layout(self, wt: schema.WireType) -> Layout:
        cached = self._cache.get(id(wt))
        if cached is None:
            cached = self._build(wt)
            self._cache[id(wt)] = cached
        return cached

    def _build(self, wt: schema.WireType) -> Layout:
        if isinstance(wt, schema.WInt):
            return _primitive(_int_struct(wt.marker.bits, wt.marker.signed), wt.marker.rust_name)
        if isinstance(wt, schema.WFloat):
            return _primitive(_struct.Struct("<f" if wt.bits == 32 else "<d"), f"f{wt.bits}")
        if isinstance(wt, schema.WBool | schema.WSmallBool):
            return _bool_layout()
        if isinstance(wt, schema.WStr):
            if wt.capacity is None:
                raise TypeError("a String has no fixed layout; use Annotated[str, FixedStr(N)]")
            return _fixed_str_layout(wt.capacity)
        if isinstance(wt, schema.WBytes):
            if wt.length is None:
                raise TypeError(
                    "a Vec<u8> has no fixed layout; use Annotated[bytes, FixedBytes(N)]"
                )
            return _fixed_bytes_layout(wt.length)
        if isinstance(wt, schema.WArray):
            return _array_layout(self._layout(wt.item), wt.length)
        if isinstance(wt, schema.WSeq):
            if wt.capacity is None:
                raise TypeError("a Vec has no fixed layout; use Annotated[list[T], FixedVec(N)]")
            return _fixed_vec_layout(self._layout(wt.item), wt.capacity)
        if isinstance(wt, schema.WOption):
            return _option_layout(self._layout(wt.inner))
        if isinstance(wt, schema.WStruct):
            return self._struct_layout(wt)
        if isinstance(wt, schema.WUnitEnum):
            return _unit_enum_layout(wt.cls, wt.cls in self.rules.u8_enums)
        if isinstance(wt, schema.WDataEnum):
            variants = [
                (var, None if payload is None else self._layout(payload))
                for var, payload in wt.variants
            ]
            return _data_enum_layout(wt.cls, variants)
        if isinstance(wt, schema.WProxy) and issubclass(wt.cls, Bloom):
            return _bloom_layout(wt.cls)
        raise TypeError(f"no repr(C) layout for {wt!r}")

    def _struct_layout(self, wt: schema.WStruct) -> Layout:
        by_name = dict(wt.fields)
        order = self.rules.field_orders.get(wt.cls, tuple(by_name))
        if sorted(order) != sorted(by_name):
            raise TypeError(f"field order for {wt.cls.__name__} must name every field once")
        placed: list[tuple[str, int, Layout]] = []
        offset, align = 0, 1
        for name in order:
            lay = self._layout(by_name[name])
            offset = align_up(offset, lay.align)
            placed.append((name, offset, lay))
            offset += lay.size
            align = max(align, lay.align)
        size = align_up(offset, align)
        cls = wt.cls
        fields = tuple(placed)

        def encode(v: Any, buf: bytearray, off: int) -> None:
            for name, field_off, lay in fields:
                lay.encode(getattr(v, name), buf, off + field_off)

        def decode(b: memoryview, off: int) -> Any:
            values = {name: lay.decode(b, off + field_off) for name, field_off, lay in fields}
            try:
                return cls(**values)
            except (TypeError, ValueError) as e:
                raise ReprCError(f"invalid {cls.__name__}: {e}") from e

        return Layout(size, align, encode, decode, fields)


def _int_struct(bits: int, signed: bool) -> _struct.Struct:
    code = {8: "b", 16: "h", 32: "i", 64: "q"}[bits]
    return _struct.Struct("<" + (code if signed else code.upper()))


def _primitive(s: _struct.Struct, name: str) -> Layout:
    pack_into, unpack_from = s.pack_into, s.unpack_from

    def encode(v: Any, buf: bytearray, off: int) -> None:
        try:
            pack_into(buf, off, v)
        except (_struct.error, OverflowError, TypeError) as e:
            raise ReprCError(f"cannot store {v!r} as {name}: {e}") from e

    def decode(b: memoryview, off: int) -> Any:
        return unpack_from(b, off)[0]

    return Layout(s.size, s.size, encode, decode)


def _bool_layout() -> Layout:
    def encode(v: Any, buf: bytearray, off: int) -> None:
        buf[off] = 1 if v else 0

    def decode(b: memoryview, off: int) -> bool:
        return b[off] != 0

    return Layout(1, 1, encode, decode)


def _fixed_str_layout(capacity: int) -> Layout:
    def encode(v: Any, buf: bytearray, off: int) -> None:
        buf[off : off + capacity] = fixed_str_bytes(v, capacity)

    def decode(b: memoryview, off: int) -> str:
        return fixed_str_decode(bytes(b[off : off + capacity]), capacity)

    return Layout(capacity, 1, encode, decode)


def _fixed_bytes_layout(length: int) -> Layout:
    def encode(v: Any, buf: bytearray, off: int) -> None:
        raw = bytes(v)
        if len(raw) != length:
            raise ReprCError(f"expected {length} bytes, got {len(raw)}")
        buf[off : off + length] = raw

    def decode(b: memoryview, off: int) -> bytes:
        return bytes(b[off : off + length])

    return Layout(length, 1, encode, decode)


def _array_layout(item: Layout, length: int) -> Layout:
    stride = item.size

    def encode(v: Any, buf: bytearray, off: int) -> None:
        if len(v) != length:
            raise ReprCError(f"expected {length} items, got {len(v)}")
        for i, x in enumerate(v):
            item.encode(x, buf, off + i * stride)

    def decode(b: memoryview, off: int) -> list[Any]:
        return [item.decode(b, off + i * stride) for i in range(length)]

    return Layout(stride * length, item.align, encode, decode)


def _fixed_vec_layout(item: Layout, capacity: int) -> Layout:
    stride = item.size
    len_offset = align_up(stride * capacity, 8)
    align = max(item.align, 8)
    size = align_up(len_offset + 8, align)

    def encode(v: Any, buf: bytearray, off: int) -> None:
        if len(v) > capacity:
            raise ReprCError(f"{len(v)} items exceed the FixedVec capacity {capacity}")
        for i, x in enumerate(v):
            item.encode(x, buf, off + i * stride)
        _U64.pack_into(buf, off + len_offset, len(v))

    def decode(b: memoryview, off: int) -> list[Any]:
        (n,) = _U64.unpack_from(b, off + len_offset)
        if n > capacity:
            raise ReprCError(f"FixedVec length {n} exceeds its capacity {capacity}")
        return [item.decode(b, off + i * stride) for i in range(n)]

    return Layout(
        size,
        align,
        encode,
        decode,
        (("data", 0, _array_layout(item, capacity)), ("len", len_offset, _primitive(_U64, "u64"))),
    )


def _option_layout(inner: Layout) -> Layout:
    payload_offset = align_up(1, inner.align)
    size = align_up(payload_offset + inner.size, inner.align)

    def encode(v: Any, buf: bytearray, off: int) -> None:
        if v is None:
            buf[off] = 0
        else:
            buf[off] = 1
            inner.encode(v, buf, off + payload_offset)

    def decode(b: memoryview, off: int) -> Any:
        tag = b[off]
        if tag == 0:
            return None
        if tag == 1:
            return inner.decode(b, off + payload_offset)
        raise ReprCError(f"invalid Option tag {tag}")

    return Layout(size, inner.align, encode, decode)


def _unit_enum_layout(cls: type[RustEnum], as_u8: bool) -> Layout:
    members = list(cls)
    s = _U8 if as_u8 else _U32

    def encode(v: Any, buf: bytearray, off: int) -> None:
        if not isinstance(v, cls):
            raise ReprCError(f"{v!r} is not a {cls.__name__}")
        s.pack_into(buf, off, v.value)

    def decode(b: memoryview, off: int) -> Any:
        (tag,) = s.unpack_from(b, off)
        if tag >= len(members):
            raise ReprCError(f"invalid {cls.__name__} tag {tag}")
        return members[tag]

    return Layout(s.size, s.size, encode, decode)


def _data_enum_layout(
    cls: type[DataEnum], variants: list[tuple[type[DataEnum], Layout | None]]
) -> Layout:
    payloads = [lay for _, lay in variants if lay is not None]
    union_align = max((lay.align for lay in payloads), default=1)
    union_size = align_up(max((lay.size for lay in payloads), default=0), union_align)
    union_offset = align_up(4, union_align)
    align = max(4, union_align)
    size = align_up(union_offset + union_size, align)
    table = {var: (var.index, lay) for var, lay in variants}
    by_tag = variants

    def encode(v: Any, buf: bytearray, off: int) -> None:
        entry = table.get(type(v))
        if entry is None:
            raise ReprCError(f"{v!r} is not a {cls.__name__}")
        index, lay = entry
        _U32.pack_into(buf, off, index)
        if lay is not None:
            lay.encode(v.value, buf, off + union_offset)

    def decode(b: memoryview, off: int) -> Any:
        (tag,) = _U32.unpack_from(b, off)
        if tag >= len(by_tag):
            raise ReprCError(f"invalid {cls.__name__} tag {tag}")
        var, lay = by_tag[tag]
        if lay is None:
            return var()
        return var(lay.decode(b, off + union_offset))

    return Layout(size, align, encode, decode)


def _bloom_layout(cls: type[Bloom]) -> Layout:
    count = cls.num_keys + cls.num_words
    words = _struct.Struct(f"<{count}Q")

    def encode(v: Any, buf: bytearray, off: int) -> None:
        words.pack_into(buf, off, *v.keys, *v.words)

    def decode(b: memoryview, off: int) -> Any:
        values = words.unpack_from(b, off)
        return cls(values[: cls.num_keys], values[cls.num_keys :])

    return Layout(words.size, 8, encode, decode)
