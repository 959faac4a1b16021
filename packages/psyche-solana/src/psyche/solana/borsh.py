"""borsh: the byte format of Anchor instruction arguments and of ordinary (non zero-copy) accounts.

Rules, as Anchor's derives apply them to upstream's types: fields in declaration order with no
padding, little-endian integers and floats, `bool` one byte (0 or 1), `Option` a 0/1 byte then the
value, `String`/`Vec<T>` a u32 length then the items, `[T; N]` N items, and enums a u8 variant
index then the payload. Upstream's own types add:

* `FixedString<L>` is `[u8; L]`: L raw bytes, NUL padded, no length;
* `FixedVec<T, N>` is `{data: [T; N], len: u64}`: all N slots (unused ones zero) then the length;
* `SmallBoolean` is a u8 (any non-zero value reads as true);
* `Bloom<U, K>` has a hand-written impl: the K keys then the U bit words, all u64.

Codecs are compiled once per `WireType` (from `psyche.core.serde`) into closures. Decoding checks
every length against the remaining input and raises `BorshError`.
"""

from __future__ import annotations

import struct as _struct
from collections.abc import Callable
from typing import Any, TypeVar

from psyche.core.bloom import Bloom
from psyche.core.fixed import fixed_str_from_bytes
from psyche.core.serde.schema import (
    WArray,
    WBool,
    WBytes,
    WDataEnum,
    WFloat,
    WInt,
    WireType,
    WOption,
    WProxy,
    WSeq,
    WSmallBool,
    WStr,
    WStruct,
    WTuple,
    WUnitEnum,
    wire_type,
)

T = TypeVar("T")

Encoder = Callable[[Any, bytearray], None]
Decoder = Callable[[memoryview, int], tuple[Any, int]]

_U32 = _struct.Struct("<I")
_U64 = _struct.Struct("<Q")


class BorshError(ValueError):
    """Bytes that are not a valid borsh encoding of the expected type (or an unencodable value)."""


def _int_struct(bits: int, signed: bool) -> _struct.Struct:
    code = {8: "b", 16: "h", 32: "i", 64: "q"}[bits]
    return _struct.Struct("<" + (code if signed else code.upper()))


def _take(buf: memoryview, pos: int, n: int) -> tuple[bytes, int]:
    end = pos + n
    if n < 0 or end > len(buf):
        raise BorshError(f"unexpected end of input: needed {n} bytes, {len(buf) - pos} left")
    return bytes(buf[pos:end]), end


def fixed_str_bytes(value: str, capacity: int) -> bytes:
    """The L bytes of a `FixedString<L>`: UTF-8 cut to L bytes, NUL padded."""
    raw = value.encode("utf-8")[:capacity]
    return raw + bytes(capacity - len(raw))


def fixed_str_decode(raw: bytes, capacity: int) -> str:
    """A `FixedString<L>`'s text: the bytes before the first NUL, as lossy UTF-8."""
    return fixed_str_from_bytes(raw.split(b"\0", 1)[0], capacity)


# --------------------------------------------------------------------------------------------
# Static sizes (needed to zero-fill the unused slots of a FixedVec)


def static_size(wt: WireType) -> int | None:
    """The borsh size of every value of `wt`, or None when it varies."""
    if isinstance(wt, WInt):
        return wt.marker.bits // 8
    if isinstance(wt, WFloat):
        return wt.bits // 8
    if isinstance(wt, WBool | WSmallBool | WUnitEnum):
        return 1
    if isinstance(wt, WStr):
        return wt.capacity
    if isinstance(wt, WBytes):
        return wt.length
    if isinstance(wt, WArray):
        item = static_size(wt.item)
        return None if item is None else item * wt.length
    if isinstance(wt, WSeq):
        if wt.capacity is None:
            return None
        item = static_size(wt.item)
        return None if item is None else item * wt.capacity + 8
    if isinstance(wt, WTuple | WStruct):
        parts = wt.items if isinstance(wt, WTuple) else [f for _, f in wt.fields]
        total = 0
        for part in parts:
            size = static_size(part)
            if size is None:
                return None
            total += size
        return total
    if isinstance(wt, WProxy) and issubclass(wt.cls, Bloom):
        return 8 * (wt.cls.num_keys + wt.cls.num_words)
    return None


# --------------------------------------------------------------------------------------------
# Compilation

_encoders: dict[int, Encoder] = {}
_decoders: dict[int, Decoder] = {}


def _encoder(wt: WireType) -> Encoder:
    enc = _encoders.get(id(wt))
    if enc is None:
        holder: list[Encoder] = []
        _encoders[id(wt)] = lambda v, out: holder[0](v, out)
        enc = _build_encoder(wt)
        holder.append(enc)
        _encoders[id(wt)] = enc
    return enc


def _decoder(wt: WireType) -> Decoder:
    dec = _decoders.get(id(wt))
    if dec is None:
        holder: list[Decoder] = []
        _decoders[id(wt)] = lambda b, p: holder[0](b, p)
        dec = _build_decoder(wt)
        holder.append(dec)
        _decoders[id(wt)] = dec
    return dec


def _build_encoder(wt: WireType) -> Encoder:
    if isinstance(wt, WInt):
        m = wt.marker
        packer = _int_struct(m.bits, m.signed).pack
        lo, hi, name = m.min, m.max, m.rust_name

        def enc_int(v: Any, out: bytearray) -> None:
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise BorshError(f"{v!r} is not a {name}")
            out += packer(v)

        return enc_int

    if isinstance(wt, WFloat):
        packf = _struct.Struct("<f" if wt.bits == 32 else "<d").pack

        def enc_float(v: Any, out: bytearray) -> None:
            try:
                out += packf(v)
            except (_struct.error, OverflowError, TypeError) as e:
                raise BorshError(f"cannot encode {v!r} as f{wt.bits}: {e}") from e

        return enc_float

    if isinstance(wt, WBool | WSmallBool):

        def enc_bool(v: Any, out: bytearray) -> None:
            out.append(1 if v else 0)

        return enc_bool

    if isinstance(wt, WStr):
        cap = wt.capacity
        if cap is not None:

            def enc_fixed_str(v: Any, out: bytearray) -> None:
                out += fixed_str_bytes(v, cap)

            return enc_fixed_str

        def enc_str(v: Any, out: bytearray) -> None:
            raw = v.encode("utf-8")
            out += _U32.pack(len(raw))
            out += raw

        return enc_str

    if isinstance(wt, WBytes):
        length = wt.length
        if length is not None:

            def enc_fixed_bytes(v: Any, out: bytearray) -> None:
                raw = bytes(v)
                if len(raw) != length:
                    raise BorshError(f"expected {length} bytes, got {len(raw)}")
                out += raw

            return enc_fixed_bytes

        def enc_bytes(v: Any, out: bytearray) -> None:
            out += _U32.pack(len(v))
            out += bytes(v)

        return enc_bytes

    if isinstance(wt, WOption):
        inner = _encoder(wt.inner)

        def enc_option(v: Any, out: bytearray) -> None:
            if v is None:
                out.append(0)
            else:
                out.append(1)
                inner(v, out)

        return enc_option

    if isinstance(wt, WSeq):
        item = _encoder(wt.item)
        cap = wt.capacity
        if cap is not None:
            item_size = static_size(wt.item)
            if item_size is None:
                raise TypeError(f"FixedVec items of {wt.item!r} have no fixed borsh size")
            size = item_size

            def enc_fixed_vec(v: Any, out: bytearray) -> None:
                if len(v) > cap:
                    raise BorshError(f"{len(v)} items exceed the FixedVec capacity {cap}")
                for x in v:
                    item(x, out)
                out += bytes(size * (cap - len(v)))
                out += _U64.pack(len(v))

            return enc_fixed_vec

        def enc_vec(v: Any, out: bytearray) -> None:
            out += _U32.pack(len(v))
            for x in v:
                item(x, out)

        return enc_vec

    if isinstance(wt, WArray):
        item = _encoder(wt.item)
        length = wt.length

        def enc_array(v: Any, out: bytearray) -> None:
            if len(v) != length:
                raise BorshError(f"expected {length} items, got {len(v)}")
            for x in v:
                item(x, out)

        return enc_array

    if isinstance(wt, WTuple):
        items = [_encoder(i) for i in wt.items]

        def enc_tuple(v: Any, out: bytearray) -> None:
            if len(v) != len(items):
                raise BorshError(f"expected a {len(items)}-tuple, got {len(v)} items")
            for e, x in zip(items, v):
                e(x, out)

        return enc_tuple

    if isinstance(wt, WStruct):
        fields = [(name, _encoder(f)) for name, f in wt.fields]

        def enc_struct(v: Any, out: bytearray) -> None:
            for name, e in fields:
                e(getattr(v, name), out)

        return enc_struct

    if isinstance(wt, WUnitEnum):
        cls = wt.cls

        def enc_unit_enum(v: Any, out: bytearray) -> None:
            if not isinstance(v, cls):
                raise BorshError(f"{v!r} is not a {cls.__name__}")
            out.append(v.value)

        return enc_unit_enum

    if isinstance(wt, WDataEnum):
        table: dict[type, tuple[int, Encoder | None]] = {
            var: (var.index, None if payload is None else _encoder(payload))
            for var, payload in wt.variants
        }
        enum_name = wt.cls.__name__

        def enc_data_enum(v: Any, out: bytearray) -> None:
            entry = table.get(type(v))
            if entry is None:
                raise BorshError(f"{v!r} is not a {enum_name}")
            index, payload_enc = entry
            out.append(index)
            if payload_enc is not None:
                payload_enc(v.value, out)

        return enc_data_enum

    if isinstance(wt, WProxy) and issubclass(wt.cls, Bloom):

        def enc_bloom(v: Any, out: bytearray) -> None:
            for word in (*v.keys, *v.words):
                out += _U64.pack(word)

        return enc_bloom

    raise TypeError(f"no borsh encoder for {wt!r}")


def _build_decoder(wt: WireType) -> Decoder:
    if isinstance(wt, WInt):
        m = wt.marker
        s = _int_struct(m.bits, m.signed)
        size, unpack = s.size, s.unpack_from

        def dec_int(b: memoryview, p: int) -> tuple[int, int]:
            if p + size > len(b):
                raise BorshError(f"unexpected end of input in {m.rust_name}")
            return unpack(b, p)[0], p + size

        return dec_int

    if isinstance(wt, WFloat):
        s = _struct.Struct("<f" if wt.bits == 32 else "<d")
        size, unpackf = s.size, s.unpack_from

        def dec_float(b: memoryview, p: int) -> tuple[float, int]:
            if p + size > len(b):
                raise BorshError("unexpected end of input in float")
            return unpackf(b, p)[0], p + size

        return dec_float

    if isinstance(wt, WBool):

        def dec_bool(b: memoryview, p: int) -> tuple[bool, int]:
            if p >= len(b):
                raise BorshError("unexpected end of input in bool")
            if b[p] > 1:
                raise BorshError(f"invalid bool byte {b[p]}")
            return b[p] == 1, p + 1

        return dec_bool

    if isinstance(wt, WSmallBool):

        def dec_small_bool(b: memoryview, p: int) -> tuple[bool, int]:
            if p >= len(b):
                raise BorshError("unexpected end of input in SmallBoolean")
            return b[p] != 0, p + 1

        return dec_small_bool

    if isinstance(wt, WStr):
        cap = wt.capacity
        if cap is not None:

            def dec_fixed_str(b: memoryview, p: int) -> tuple[str, int]:
                raw, p = _take(b, p, cap)
                return fixed_str_decode(raw, cap), p

            return dec_fixed_str

        def dec_str(b: memoryview, p: int) -> tuple[str, int]:
            if p + 4 > len(b):
                raise BorshError("unexpected end of input in string length")
            (n,) = _U32.unpack_from(b, p)
            raw, p = _take(b, p + 4, n)
            try:
                return raw.decode("utf-8"), p
            except UnicodeDecodeError as e:
                raise BorshError(f"invalid UTF-8 in string: {e}") from e

        return dec_str

    if isinstance(wt, WBytes):
        length = wt.length
        if length is not None:

            def dec_fixed_bytes(b: memoryview, p: int) -> tuple[bytes, int]:
                return _take(b, p, length)

            return dec_fixed_bytes

        def dec_bytes(b: memoryview, p: int) -> tuple[bytes, int]:
            if p + 4 > len(b):
                raise BorshError("unexpected end of input in bytes length")
            (n,) = _U32.unpack_from(b, p)
            return _take(b, p + 4, n)

        return dec_bytes

    if isinstance(wt, WOption):
        inner = _decoder(wt.inner)

        def dec_option(b: memoryview, p: int) -> tuple[Any, int]:
            if p >= len(b):
                raise BorshError("unexpected end of input in option")
            tag = b[p]
            if tag == 0:
                return None, p + 1
            if tag == 1:
                return inner(b, p + 1)
            raise BorshError(f"invalid option tag {tag}")

        return dec_option

    if isinstance(wt, WSeq):
        item = _decoder(wt.item)
        cap = wt.capacity
        if cap is not None:

            def dec_fixed_vec(b: memoryview, p: int) -> tuple[list[Any], int]:
                slots = []
                for _ in range(cap):
                    x, p = item(b, p)
                    slots.append(x)
                if p + 8 > len(b):
                    raise BorshError("unexpected end of input in FixedVec length")
                (n,) = _U64.unpack_from(b, p)
                if n > cap:
                    raise BorshError(f"FixedVec length {n} exceeds its capacity {cap}")
                return slots[:n], p + 8

            return dec_fixed_vec

        def dec_vec(b: memoryview, p: int) -> tuple[list[Any], int]:
            if p + 4 > len(b):
                raise BorshError("unexpected end of input in vec length")
            (n,) = _U32.unpack_from(b, p)
            p += 4
            if n > len(b) - p:
                raise BorshError(f"vec claims {n} items but only {len(b) - p} bytes remain")
            out = []
            for _ in range(n):
                x, p = item(b, p)
                out.append(x)
            return out, p

        return dec_vec

    if isinstance(wt, WArray):
        item = _decoder(wt.item)
        length = wt.length

        def dec_array(b: memoryview, p: int) -> tuple[list[Any], int]:
            out = []
            for _ in range(length):
                x, p = item(b, p)
                out.append(x)
            return out, p

        return dec_array

    if isinstance(wt, WTuple):
        items = [_decoder(i) for i in wt.items]

        def dec_tuple(b: memoryview, p: int) -> tuple[tuple[Any, ...], int]:
            out = []
            for d in items:
                x, p = d(b, p)
                out.append(x)
            return tuple(out), p

        return dec_tuple

    if isinstance(wt, WStruct):
        fields = [(name, _decoder(f)) for name, f in wt.fields]
        cls = wt.cls

        def dec_struct(b: memoryview, p: int) -> tuple[Any, int]:
            values = {}
            for name, d in fields:
                values[name], p = d(b, p)
            try:
                return cls(**values), p
            except (TypeError, ValueError) as e:
                raise BorshError(f"invalid {cls.__name__}: {e}") from e

        return dec_struct

    if isinstance(wt, WUnitEnum):
        members = list(wt.cls)
        enum_name = wt.cls.__name__

        def dec_unit_enum(b: memoryview, p: int) -> tuple[Any, int]:
            if p >= len(b):
                raise BorshError(f"unexpected end of input in {enum_name}")
            i = b[p]
            if i >= len(members):
                raise BorshError(f"invalid variant index {i} for {enum_name}")
            return members[i], p + 1

        return dec_unit_enum

    if isinstance(wt, WDataEnum):
        table = [
            (var, None if payload is None else _decoder(payload)) for var, payload in wt.variants
        ]
        enum_name = wt.cls.__name__

        def dec_data_enum(b: memoryview, p: int) -> tuple[Any, int]:
            if p >= len(b):
                raise BorshError(f"unexpected end of input in {enum_name}")
            i = b[p]
            if i >= len(table):
                raise BorshError(f"invalid variant index {i} for {enum_name}")
            var, payload_dec = table[i]
            if payload_dec is None:
                return var(), p + 1
            x, p = payload_dec(b, p + 1)
            return var(x), p

        return dec_data_enum

    if isinstance(wt, WProxy) and issubclass(wt.cls, Bloom):
        cls = wt.cls
        count = cls.num_keys + cls.num_words
        words_struct = _struct.Struct(f"<{count}Q")

        def dec_bloom(b: memoryview, p: int) -> tuple[Any, int]:
            if p + words_struct.size > len(b):
                raise BorshError("unexpected end of input in bloom")
            values = words_struct.unpack_from(b, p)
            return cls(values[: cls.num_keys], values[cls.num_keys :]), p + words_struct.size

        return dec_bloom

    raise TypeError(f"no borsh decoder for {wt!r}")


# --------------------------------------------------------------------------------------------
# Public API


def to_borsh(value: Any, tp: Any = None) -> bytes:
    """The borsh encoding of `value` as type `tp` (default: `type(value)`)."""
    out = bytearray()
    _encoder(wire_type(type(value) if tp is None else tp))(value, out)
    return bytes(out)


def encode_borsh_into(value: Any, tp: Any, out: bytearray) -> None:
    _encoder(wire_type(tp))(value, out)


def take_borsh(data: bytes | bytearray | memoryview, tp: type[T] | Any) -> tuple[T, int]:
    """Decode one value from the front of `data`; returns it and the number of bytes used."""
    try:
        return _decoder(wire_type(tp))(memoryview(data), 0)
    except RecursionError as e:
        raise BorshError("input nests too deeply") from e


def from_borsh(data: bytes | bytearray | memoryview, tp: type[T] | Any) -> T:
    """Decode a value that must use all of `data` (Anchor's instruction decoder allows trailing
    bytes; use `take_borsh` for that)."""
    value, used = take_borsh(data, tp)
    if used != len(data):
        raise BorshError(f"{len(data) - used} trailing bytes after {getattr(tp, '__name__', tp)}")
    return value
