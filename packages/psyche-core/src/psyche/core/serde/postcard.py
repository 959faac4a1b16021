"""postcard 1.x: the byte format of every upstream wire message and signed payload.

Rules (serde data model → bytes): u8/i8 one raw byte; wider integers LEB128 varints (signed ones
zigzag first); f32/f64 little-endian; bool 0/1; Option 0 or 1+value; strings, byte strings and
sequences are length-prefixed; fixed arrays, tuples and structs are their items back to back; enums
are the varint variant index followed by the payload.

Encoders and decoders are compiled once per type from the `WireType` tree into closures.
Decoding never trusts the input: every length is checked against the remaining bytes and every
capacity against its declared bound, and failures raise `PostcardError`.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from psyche.core.fixed import fixed_str_from_bytes, fixed_str_serialize
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


class PostcardError(ValueError):
    """Bytes that are not a valid postcard encoding of the expected type."""


# --------------------------------------------------------------------------------------------
# Primitives


def encode_varint(value: int, out: bytearray) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def decode_varint(buf: memoryview, pos: int, bits: int) -> tuple[int, int]:
    max_bytes = (bits + 6) // 7
    result = 0
    shift = 0
    end = len(buf)
    for i in range(max_bytes):
        if pos >= end:
            raise PostcardError("unexpected end of input in varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            if result >> bits:
                raise PostcardError(f"varint does not fit in {bits} bits")
            if i > 0 and byte == 0:
                # Rust's postcard accepts non-canonical varints; so do we, but keep the check
                # cheap and explicit here for readers.
                pass
            return result, pos
        shift += 7
    raise PostcardError(f"varint longer than {max_bytes} bytes for a {bits}-bit integer")


def _zigzag(value: int, bits: int) -> int:
    return ((value << 1) ^ (value >> (bits - 1))) & ((1 << bits) - 1)


def _unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _take(buf: memoryview, pos: int, n: int) -> tuple[bytes, int]:
    end = pos + n
    if n < 0 or end > len(buf):
        raise PostcardError(f"unexpected end of input: needed {n} bytes, {len(buf) - pos} left")
    return bytes(buf[pos:end]), end


# --------------------------------------------------------------------------------------------
# Compilation

_encoders: dict[int, Encoder] = {}
_decoders: dict[tuple[int, bool], Decoder] = {}
# Compilation publishes only finished closures, so decoding may run in worker threads while
# another thread compiles a new type. Placeholders for recursive types stay private to the
# compiling thread.
_compile_lock = threading.RLock()
_building_encoders: dict[int, Encoder] = {}
_building_decoders: dict[tuple[int, bool], Decoder] = {}


def _encoder(wt: WireType) -> Encoder:
    key = id(wt)
    enc = _encoders.get(key)
    if enc is not None:
        return enc
    with _compile_lock:
        enc = _encoders.get(key) or _building_encoders.get(key)
        if enc is not None:
            return enc
        holder: list[Encoder] = []
        _building_encoders[key] = lambda v, out: holder[0](v, out)
        try:
            enc = _build_encoder(wt)
        finally:
            del _building_encoders[key]
        holder.append(enc)
        _encoders[key] = enc
        return enc


def _decoder(wt: WireType, borrow: bool = False) -> Decoder:
    key = (id(wt), borrow)
    dec = _decoders.get(key)
    if dec is not None:
        return dec
    with _compile_lock:
        dec = _decoders.get(key) or _building_decoders.get(key)
        if dec is not None:
            return dec
        holder: list[Decoder] = []
        _building_decoders[key] = lambda b, p: holder[0](b, p)
        try:
            dec = _build_decoder(wt, borrow)
        finally:
            del _building_decoders[key]
        holder.append(dec)
        _decoders[key] = dec
        return dec


def _check_int(value: Any, lo: int, hi: int, name: str) -> None:
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)):
        raise PostcardError(f"expected {name}, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise PostcardError(f"{value} out of range for {name}")


def _build_encoder(wt: WireType) -> Encoder:
    if isinstance(wt, WInt):
        m = wt.marker
        lo, hi, name, bits = m.min, m.max, m.rust_name, m.bits
        if bits == 8:
            fmt = "<b" if m.signed else "<B"
            pack = struct.Struct(fmt).pack

            def enc_u8(v: Any, out: bytearray) -> None:
                _check_int(v, lo, hi, name)
                out += pack(v)

            return enc_u8
        if m.signed:

            def enc_signed(v: Any, out: bytearray) -> None:
                _check_int(v, lo, hi, name)
                encode_varint(_zigzag(v, bits), out)

            return enc_signed

        def enc_unsigned(v: Any, out: bytearray) -> None:
            _check_int(v, lo, hi, name)
            encode_varint(v, out)

        return enc_unsigned

    if isinstance(wt, WFloat):
        packf = struct.Struct("<f" if wt.bits == 32 else "<d").pack

        def enc_float(v: Any, out: bytearray) -> None:
            try:
                out += packf(v)
            except (struct.error, OverflowError) as e:
                raise PostcardError(f"cannot encode {v!r} as f{wt.bits}: {e}") from e

        return enc_float

    if isinstance(wt, WBool | WSmallBool):

        def enc_bool(v: Any, out: bytearray) -> None:
            out.append(1 if v else 0)

        return enc_bool

    if isinstance(wt, WStr):
        cap = wt.capacity

        def enc_str(v: Any, out: bytearray) -> None:
            if cap is not None:
                # A FixedString writes its bytes as lossy UTF-8 with NULs trimmed at both ends.
                v = fixed_str_serialize(v, cap)
            raw = v.encode("utf-8")
            encode_varint(len(raw), out)
            out += raw

        return enc_str

    if isinstance(wt, WBytes):
        length = wt.length
        if length is not None:

            def enc_fixed_bytes(v: Any, out: bytearray) -> None:
                if len(v) != length:
                    raise PostcardError(f"expected {length} bytes, got {len(v)}")
                out += v

            return enc_fixed_bytes

        def enc_bytes(v: Any, out: bytearray) -> None:
            encode_varint(len(v), out)
            out += v

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

        def enc_seq(v: Any, out: bytearray) -> None:
            if cap is not None and len(v) > cap:
                raise PostcardError(f"{len(v)} items exceed the capacity {cap}")
            encode_varint(len(v), out)
            for x in v:
                item(x, out)

        return enc_seq

    if isinstance(wt, WArray):
        item = _encoder(wt.item)
        length = wt.length

        def enc_array(v: Any, out: bytearray) -> None:
            if len(v) != length:
                raise PostcardError(f"expected {length} items, got {len(v)}")
            for x in v:
                item(x, out)

        return enc_array

    if isinstance(wt, WTuple):
        items = [_encoder(i) for i in wt.items]

        def enc_tuple(v: Any, out: bytearray) -> None:
            if len(v) != len(items):
                raise PostcardError(f"expected a {len(items)}-tuple, got {len(v)} items")
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

        def enc_unit_enum(v: Any, out: bytearray) -> None:
            encode_varint(v.value, out)

        return enc_unit_enum

    if isinstance(wt, WDataEnum):
        table: dict[type, tuple[int, Encoder | None]] = {}
        for var, payload in wt.variants:
            table[var] = (var.index, None if payload is None else _encoder(payload))
        enum_name = wt.cls.__name__

        def enc_data_enum(v: Any, out: bytearray) -> None:
            entry = table.get(type(v))
            if entry is None:
                raise PostcardError(f"{v!r} is not a {enum_name}")
            index, payload_enc = entry
            encode_varint(index, out)
            if payload_enc is not None:
                payload_enc(v.value, out)

        return enc_data_enum

    if isinstance(wt, WProxy):
        proxy = _encoder(wt.proxy)
        to_proxy = wt.to_proxy

        def enc_proxy(v: Any, out: bytearray) -> None:
            proxy(to_proxy(v), out)

        return enc_proxy

    raise TypeError(f"no postcard encoder for {wt!r}")


def _build_decoder(wt: WireType, borrow: bool) -> Decoder:
    if isinstance(wt, WInt):
        m = wt.marker
        bits = m.bits
        if bits == 8:
            signed = m.signed

            def dec_8(b: memoryview, p: int) -> tuple[int, int]:
                if p >= len(b):
                    raise PostcardError("unexpected end of input")
                v = b[p]
                if signed and v >= 0x80:
                    v -= 0x100
                return v, p + 1

            return dec_8
        if m.signed:

            def dec_signed(b: memoryview, p: int) -> tuple[int, int]:
                raw, p = decode_varint(b, p, bits)
                return _unzigzag(raw), p

            return dec_signed

        def dec_unsigned(b: memoryview, p: int) -> tuple[int, int]:
            return decode_varint(b, p, bits)

        return dec_unsigned

    if isinstance(wt, WFloat):
        size = 4 if wt.bits == 32 else 8
        unpackf = struct.Struct("<f" if wt.bits == 32 else "<d").unpack_from

        def dec_float(b: memoryview, p: int) -> tuple[float, int]:
            if p + size > len(b):
                raise PostcardError("unexpected end of input in float")
            return unpackf(b, p)[0], p + size

        return dec_float

    if isinstance(wt, WBool):

        def dec_bool(b: memoryview, p: int) -> tuple[bool, int]:
            if p >= len(b):
                raise PostcardError("unexpected end of input")
            v = b[p]
            if v > 1:
                raise PostcardError(f"invalid bool byte {v}")
            return v == 1, p + 1

        return dec_bool

    if isinstance(wt, WSmallBool):

        def dec_small_bool(b: memoryview, p: int) -> tuple[bool, int]:
            if p >= len(b):
                raise PostcardError("unexpected end of input")
            return b[p] != 0, p + 1

        return dec_small_bool

    if isinstance(wt, WStr):
        cap = wt.capacity

        def dec_str(b: memoryview, p: int) -> tuple[str, int]:
            n, p = decode_varint(b, p, 64)
            raw, p = _take(b, p, n)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PostcardError(f"invalid UTF-8 in string: {e}") from e
            if cap is not None:
                # A FixedString keeps the first `cap` bytes of a valid string, silently.
                return fixed_str_from_bytes(raw, cap), p
            return text, p

        return dec_str

    if isinstance(wt, WBytes):
        length = wt.length
        if length is not None:

            def dec_fixed_bytes(b: memoryview, p: int) -> tuple[bytes, int]:
                return _take(b, p, length)

            return dec_fixed_bytes

        if borrow:

            def dec_bytes_view(b: memoryview, p: int) -> tuple[memoryview, int]:
                n, p = decode_varint(b, p, 64)
                end = p + n
                if end > len(b):
                    raise PostcardError(
                        f"unexpected end of input: needed {n} bytes, {len(b) - p} left"
                    )
                return b[p:end], end

            return dec_bytes_view

        def dec_bytes(b: memoryview, p: int) -> tuple[bytes, int]:
            n, p = decode_varint(b, p, 64)
            return _take(b, p, n)

        return dec_bytes

    if isinstance(wt, WOption):
        inner = _decoder(wt.inner, borrow)

        def dec_option(b: memoryview, p: int) -> tuple[Any, int]:
            if p >= len(b):
                raise PostcardError("unexpected end of input in option")
            tag = b[p]
            if tag == 0:
                return None, p + 1
            if tag == 1:
                return inner(b, p + 1)
            raise PostcardError(f"invalid option tag {tag}")

        return dec_option

    if isinstance(wt, WSeq):
        item = _decoder(wt.item, borrow)
        cap = wt.capacity

        def dec_seq(b: memoryview, p: int) -> tuple[list[Any], int]:
            n, p = decode_varint(b, p, 64)
            if cap is not None and n > cap:
                raise PostcardError(f"FixedVec is full: {n} items exceed the capacity {cap}")
            if n > len(b) - p:
                # every item takes at least one byte: a larger count is a lie, not a reason to
                # allocate
                raise PostcardError(f"sequence claims {n} items but only {len(b) - p} bytes remain")
            out = []
            for _ in range(n):
                x, p = item(b, p)
                out.append(x)
            return out, p

        return dec_seq

    if isinstance(wt, WArray):
        item = _decoder(wt.item, borrow)
        length = wt.length

        def dec_array(b: memoryview, p: int) -> tuple[list[Any], int]:
            out = []
            for _ in range(length):
                x, p = item(b, p)
                out.append(x)
            return out, p

        return dec_array

    if isinstance(wt, WTuple):
        items = [_decoder(i, borrow) for i in wt.items]

        def dec_tuple(b: memoryview, p: int) -> tuple[tuple[Any, ...], int]:
            out = []
            for d in items:
                x, p = d(b, p)
                out.append(x)
            return tuple(out), p

        return dec_tuple

    if isinstance(wt, WStruct):
        fields = [(name, _decoder(f, borrow)) for name, f in wt.fields]
        cls = wt.cls

        def dec_struct(b: memoryview, p: int) -> tuple[Any, int]:
            values = {}
            for name, d in fields:
                values[name], p = d(b, p)
            try:
                return cls(**values), p
            except (TypeError, ValueError) as e:
                raise PostcardError(f"invalid {cls.__name__}: {e}") from e

        return dec_struct

    if isinstance(wt, WUnitEnum):
        members = list(wt.cls)
        enum_name = wt.cls.__name__

        def dec_unit_enum(b: memoryview, p: int) -> tuple[Any, int]:
            i, p = decode_varint(b, p, 32)
            if i >= len(members):
                raise PostcardError(f"invalid variant index {i} for {enum_name}")
            return members[i], p

        return dec_unit_enum

    if isinstance(wt, WDataEnum):
        table = [
            (var, None if payload is None else _decoder(payload, borrow))
            for var, payload in wt.variants
        ]
        enum_name = wt.cls.__name__

        def dec_data_enum(b: memoryview, p: int) -> tuple[Any, int]:
            i, p = decode_varint(b, p, 32)
            if i >= len(table):
                raise PostcardError(f"invalid variant index {i} for {enum_name}")
            var, payload_dec = table[i]
            if payload_dec is None:
                return var(), p
            x, p = payload_dec(b, p)
            return var(x), p

        return dec_data_enum

    if isinstance(wt, WProxy):
        # Custom types are small: they always own their bytes.
        proxy = _decoder(wt.proxy)
        from_proxy = wt.from_proxy
        name = wt.cls.__name__

        def dec_proxy(b: memoryview, p: int) -> tuple[Any, int]:
            x, p = proxy(b, p)
            try:
                return from_proxy(x), p
            except ValueError as e:
                raise PostcardError(f"invalid {name}: {e}") from e

        return dec_proxy

    raise TypeError(f"no postcard decoder for {wt!r}")


# --------------------------------------------------------------------------------------------
# Public API


def to_bytes(value: Any, tp: Any = None) -> bytes:
    """postcard encoding of `value` as type `tp` (default: `type(value)`)."""
    out = bytearray()
    _encoder(wire_type(type(value) if tp is None else tp))(value, out)
    return bytes(out)


def encode_into(value: Any, tp: Any, out: bytearray) -> None:
    _encoder(wire_type(tp))(value, out)


def prepare_decoder(tp: Any, *, borrow: bool = False) -> None:
    """Compile `tp`'s decoder now, e.g. on the event loop before worker threads decode."""
    _decoder(wire_type(tp), borrow)


def take_from_bytes(
    data: bytes | bytearray | memoryview, tp: type[T] | Any, *, borrow: bool = False
) -> tuple[T, int]:
    """Decode one value from the front of `data`; returns it and the number of bytes used.

    With `borrow=True` every `bytes` (`Vec<u8>`) field is a read-only `memoryview` into `data`
    instead of a copy: for payloads of many MiB that are already integrity-checked. The views
    keep `data` alive; `bytes(view)` makes an owned copy where one is needed.
    """
    buf = memoryview(data)
    if borrow:
        buf = buf.toreadonly()
    try:
        return _decoder(wire_type(tp), borrow)(buf, 0)
    except RecursionError as e:
        raise PostcardError("input nests too deeply") from e


def from_bytes(
    data: bytes | bytearray | memoryview, tp: type[T] | Any, *, borrow: bool = False
) -> T:
    """Decode a value that must use all of `data` (stricter than Rust's `from_bytes`, which ignores
    trailing bytes; use `take_from_bytes` for that behaviour). `borrow` as in `take_from_bytes`."""
    value, used = take_from_bytes(data, tp, borrow=borrow)
    if used != memoryview(data).nbytes:
        raise PostcardError(
            f"{memoryview(data).nbytes - used} trailing bytes after {getattr(tp, '__name__', tp)}"
        )
    return value
