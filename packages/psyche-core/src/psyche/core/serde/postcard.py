"""postcard 1.x: the byte format of every upstream wire message and signed payload.

Rules (serde data model → bytes): u8/i8 one raw byte; wider integers LEB128 varints (signed ones
zigzag first); f32/f64 little-endian; bool 0/1; Option 0 or 1+value; strings, byte strings and
sequences are varint-length-prefixed; fixed arrays, tuples and structs are their items back to
back; enums are the varint variant index followed by the payload. Upstream's `FixedString`
serializes as a string and `FixedVec` as a sequence of its used items.
"""

from __future__ import annotations

import struct
from typing import Any, TypeVar, overload

from psyche.core.fixed import fixed_str_from_bytes, fixed_str_serialize
from psyche.core.serde import schema as w
from psyche.core.serde.codec import BinaryCodec, Decoder, Encoder
from psyche.core.serde.schema import IntMarker, wire_type

T = TypeVar("T")


class PostcardError(ValueError):
    """Bytes that are not a valid postcard encoding of the expected type."""


def encode_varint(value: int, out: bytearray) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def decode_varint(buf: memoryview, pos: int, bits: int) -> tuple[int, int]:
    """A LEB128 varint of at most `bits` bits (non-canonical encodings accepted, as Rust's)."""
    max_bytes = (bits + 6) // 7
    result = 0
    shift = 0
    end = len(buf)
    for _ in range(max_bytes):
        if pos >= end:
            raise PostcardError("unexpected end of input in varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            if result >> bits:
                raise PostcardError(f"varint does not fit in {bits} bits")
            return result, pos
        shift += 7
    raise PostcardError(f"varint longer than {max_bytes} bytes for a {bits}-bit integer")


def varint_len(value: int) -> int:
    """How many bytes `encode_varint(value)` writes."""
    return max(1, (value.bit_length() + 6) // 7)


def _zigzag(value: int, bits: int) -> int:
    return ((value << 1) ^ (value >> (bits - 1))) & ((1 << bits) - 1)


def _unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


class Postcard(BinaryCodec):
    name = "postcard"
    error = PostcardError
    postcard_fields = True

    def int_codec(self, marker: IntMarker) -> tuple[Encoder, Decoder]:
        check, bits, signed = self.check_int, marker.bits, marker.signed
        if bits == 8:
            pack = struct.Struct("<b" if signed else "<B").pack

            def enc_8(v: Any, out: bytearray) -> None:
                check(v, marker)
                out += pack(v)

            def dec_8(b: memoryview, p: int) -> tuple[int, int]:
                if p >= len(b):
                    raise PostcardError("unexpected end of input")
                v = b[p]
                if signed and v >= 0x80:
                    v -= 0x100
                return v, p + 1

            return enc_8, dec_8
        if signed:

            def enc_signed(v: Any, out: bytearray) -> None:
                check(v, marker)
                encode_varint(_zigzag(v, bits), out)

            def dec_signed(b: memoryview, p: int) -> tuple[int, int]:
                raw, p = decode_varint(b, p, bits)
                return _unzigzag(raw), p

            return enc_signed, dec_signed

        def enc_unsigned(v: Any, out: bytearray) -> None:
            check(v, marker)
            encode_varint(v, out)

        def dec_unsigned(b: memoryview, p: int) -> tuple[int, int]:
            return decode_varint(b, p, bits)

        return enc_unsigned, dec_unsigned

    def encode_len(self, n: int, out: bytearray) -> None:
        encode_varint(n, out)

    def decode_len(self, b: memoryview, p: int) -> tuple[int, int]:
        return decode_varint(b, p, 64)

    def encode_tag(self, index: int, out: bytearray) -> None:
        encode_varint(index, out)

    def decode_tag(self, b: memoryview, p: int) -> tuple[int, int]:
        return decode_varint(b, p, 32)

    def fixed_str_codec(self, capacity: int) -> tuple[Encoder, Decoder]:
        take = self.take

        def enc_fixed_str(v: Any, out: bytearray) -> None:
            # A FixedString writes its bytes as lossy UTF-8 with NULs trimmed at both ends.
            raw = fixed_str_serialize(v, capacity).encode("utf-8")
            encode_varint(len(raw), out)
            out += raw

        def dec_fixed_str(b: memoryview, p: int) -> tuple[str, int]:
            n, p = decode_varint(b, p, 64)
            raw, p = take(b, p, n)
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PostcardError(f"invalid UTF-8 in string: {e}") from e
            # A FixedString keeps the first `capacity` bytes of a valid string, silently.
            return fixed_str_from_bytes(raw, capacity), p

        return enc_fixed_str, dec_fixed_str


POSTCARD = Postcard()


def to_bytes(value: Any, tp: Any = None) -> bytes:
    """postcard encoding of `value` as type `tp` (default: `type(value)`)."""
    return POSTCARD.to_bytes(value, tp)


def encode_into(value: Any, tp: Any, out: bytearray) -> None:
    POSTCARD.encode_into(value, tp, out)


def prepare_decoder(tp: Any, *, borrow: bool = False) -> None:
    """Compile `tp`'s decoder now, e.g. on the event loop before worker threads decode."""
    POSTCARD.decoder(wire_type(tp), borrow)


# A class gives its instances' type; any other type form (Annotated, unions, ...) gives Any.
@overload
def take_from_bytes(
    data: bytes | bytearray | memoryview, tp: type[T], *, borrow: bool = False
) -> tuple[T, int]: ...
@overload
def take_from_bytes(
    data: bytes | bytearray | memoryview, tp: Any, *, borrow: bool = False
) -> tuple[Any, int]: ...
def take_from_bytes(
    data: bytes | bytearray | memoryview, tp: Any, *, borrow: bool = False
) -> tuple[Any, int]:
    """Decode one value from the front of `data`; returns it and the number of bytes used.

    With `borrow=True` every `bytes` (`Vec<u8>`) field is a read-only `memoryview` into `data`
    instead of a copy: for payloads of many MiB that are already integrity-checked. The views
    keep `data` alive; `bytes(view)` makes an owned copy where one is needed.
    """
    return POSTCARD.take_from_bytes(data, tp, borrow=borrow)


@overload
def from_bytes(data: bytes | bytearray | memoryview, tp: type[T], *, borrow: bool = False) -> T: ...
@overload
def from_bytes(data: bytes | bytearray | memoryview, tp: Any, *, borrow: bool = False) -> Any: ...
def from_bytes(data: bytes | bytearray | memoryview, tp: Any, *, borrow: bool = False) -> Any:
    """Decode a value that must use all of `data` (stricter than Rust's `from_bytes`, which ignores
    trailing bytes; use `take_from_bytes` for that behaviour). `borrow` as in `take_from_bytes`."""
    return POSTCARD.from_bytes(data, tp, borrow=borrow)


def max_encoded_size(tp: Any) -> int | None:
    """The most bytes an honest encoder writes for a value of `tp`, or None when nothing bounds
    it (a `String`, `Vec` or `Vec<u8>` without a capacity).

    What a receiver may accept before decoding a message: every integer at its widest varint,
    every `FixedString`/`FixedVec` full, every option present, every enum at its largest
    variant. A custom type (`SerdeProxy`) whose proxy has unbounded parts states its own bound
    with a classmethod `max_postcard_size()` (a bloom filter: its keys and words are fixed)."""
    return _max_size(wire_type(tp), set())


def _max_size(wt: w.WireType, visiting: set[int]) -> int | None:
    if id(wt) in visiting:
        return None  # a type that contains itself has no bound
    visiting.add(id(wt))
    try:
        return _max_size_of(wt, visiting)
    finally:
        visiting.discard(id(wt))


def _max_size_of(wt: w.WireType, visiting: set[int]) -> int | None:
    def total(parts: list[w.WireType]) -> int | None:
        sizes = [_max_size(p, visiting) for p in parts]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)

    if isinstance(wt, w.WInt):
        return 1 if wt.marker.bits == 8 else varint_len((1 << wt.marker.bits) - 1)
    if isinstance(wt, w.WFloat):
        return wt.bits // 8
    if isinstance(wt, w.WBool | w.WSmallBool):
        return 1
    if isinstance(wt, w.WStr):
        return None if wt.capacity is None else varint_len(wt.capacity) + wt.capacity
    if isinstance(wt, w.WBytes):
        return wt.length
    if isinstance(wt, w.WOption):
        inner = _max_size(wt.inner, visiting)
        return None if inner is None else 1 + inner
    if isinstance(wt, w.WSeq):
        item = _max_size(wt.item, visiting)
        if wt.capacity is None or item is None:
            return None
        return varint_len(wt.capacity) + wt.capacity * item
    if isinstance(wt, w.WArray):
        item = _max_size(wt.item, visiting)
        return None if item is None else wt.length * item
    if isinstance(wt, w.WTuple):
        return total(list(wt.items))
    if isinstance(wt, w.WStruct):
        return total([f for _, f in wt.fields])
    if isinstance(wt, w.WUnitEnum):
        return varint_len(max(len(wt.cls) - 1, 0))
    if isinstance(wt, w.WDataEnum):
        payloads = [0 if p is None else _max_size(p, visiting) for _, p in wt.variants]
        if any(p is None for p in payloads):
            return None
        return varint_len(max(len(payloads) - 1, 0)) + max((p or 0 for p in payloads), default=0)
    if isinstance(wt, w.WProxy):
        own = getattr(wt.cls, "max_postcard_size", None)
        return int(own()) if own is not None else _max_size(wt.proxy, visiting)
    raise TypeError(f"no postcard size bound for {wt!r}")
