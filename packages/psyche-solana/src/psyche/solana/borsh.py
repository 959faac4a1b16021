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
from typing import Any, TypeVar, overload

from psyche.core.bloom import Bloom
from psyche.core.fixed import fixed_str_from_bytes
from psyche.core.serde import schema
from psyche.core.serde.codec import BinaryCodec, Decoder, Encoder
from psyche.core.serde.schema import IntMarker

T = TypeVar("T")

_U32 = _struct.Struct("<I")
_U64 = _struct.Struct("<Q")


class BorshError(ValueError):
    """Bytes that are not a valid borsh encoding of the expected type (or an unencodable value)."""


def fixed_str_bytes(value: str, capacity: int) -> bytes:
    """The L bytes of a `FixedString<L>`: UTF-8 cut to L bytes, NUL padded."""
    raw = value.encode("utf-8")[:capacity]
    return raw + bytes(capacity - len(raw))


def fixed_str_decode(raw: bytes, capacity: int) -> str:
    """A `FixedString<L>`'s text: the bytes before the first NUL, as lossy UTF-8."""
    return fixed_str_from_bytes(raw.split(b"\0", 1)[0], capacity)


# --------------------------------------------------------------------------------------------
# Static sizes (needed to zero-fill the unused slots of a FixedVec)


def static_size(wt: schema.WireType) -> int | None:
    """The borsh size of every value of `wt`, or None when it varies."""
    if isinstance(wt, schema.WInt):
        return wt.marker.bits // 8
    if isinstance(wt, schema.WFloat):
        return wt.bits // 8
    if isinstance(wt, schema.WBool | schema.WSmallBool | schema.WUnitEnum):
        return 1
    if isinstance(wt, schema.WStr):
        return wt.capacity
    if isinstance(wt, schema.WBytes):
        return wt.length
    if isinstance(wt, schema.WArray):
        item = static_size(wt.item)
        return None if item is None else item * wt.length
    if isinstance(wt, schema.WSeq):
        if wt.capacity is None:
            return None
        item = static_size(wt.item)
        return None if item is None else item * wt.capacity + 8
    if isinstance(wt, schema.WTuple | schema.WStruct):
        parts = wt.items if isinstance(wt, schema.WTuple) else [f for _, f in wt.fields]
        total = 0
        for part in parts:
            size = static_size(part)
            if size is None:
                return None
            total += size
        return total
    if isinstance(wt, schema.WProxy) and issubclass(wt.cls, Bloom):
        return 8 * (wt.cls.num_keys + wt.cls.num_words)
    return None


# --------------------------------------------------------------------------------------------
# The codec: what borsh writes differently from postcard


class Borsh(BinaryCodec):
    name = "borsh"
    error = BorshError

    def int_codec(self, marker: IntMarker) -> tuple[Encoder, Decoder]:
        code = {8: "b", 16: "h", 32: "i", 64: "q"}[marker.bits]
        s = _struct.Struct("<" + (code if marker.signed else code.upper()))
        pack, unpack, size, check = s.pack, s.unpack_from, s.size, self.check_int

        def enc_int(v: Any, out: bytearray) -> None:
            check(v, marker)
            out += pack(v)

        def dec_int(b: memoryview, p: int) -> tuple[int, int]:
            if p + size > len(b):
                raise BorshError(f"unexpected end of input in {marker.rust_name}")
            return unpack(b, p)[0], p + size

        return enc_int, dec_int

    def encode_len(self, n: int, out: bytearray) -> None:
        out += _U32.pack(n)

    def decode_len(self, b: memoryview, p: int) -> tuple[int, int]:
        if p + 4 > len(b):
            raise BorshError("unexpected end of input in length")
        return _U32.unpack_from(b, p)[0], p + 4

    def encode_tag(self, index: int, out: bytearray) -> None:
        out.append(index)

    def decode_tag(self, b: memoryview, p: int) -> tuple[int, int]:
        if p >= len(b):
            raise BorshError("unexpected end of input in enum tag")
        return b[p], p + 1

    def fixed_str_codec(self, capacity: int) -> tuple[Encoder, Decoder]:
        take = self.take

        def enc_fixed_str(v: Any, out: bytearray) -> None:
            out += fixed_str_bytes(v, capacity)

        def dec_fixed_str(b: memoryview, p: int) -> tuple[str, int]:
            raw, p = take(b, p, capacity)
            return fixed_str_decode(raw, capacity), p

        return enc_fixed_str, dec_fixed_str

    def fixed_vec_codec(self, wt: schema.WSeq, borrow: bool) -> tuple[Encoder, Decoder]:
        # `FixedVec<T, N>` is `{data: [T; N], len: u64}`: every slot, unused ones zeroed.
        cap = wt.capacity
        assert cap is not None
        size = static_size(wt.item)
        if size is None:
            raise TypeError(f"FixedVec items of {wt.item!r} have no fixed borsh size")
        item_enc, item_dec = self.encoder(wt.item), self.decoder(wt.item, borrow)

        def enc_fixed_vec(v: Any, out: bytearray) -> None:
            if len(v) > cap:
                raise BorshError(f"{len(v)} items exceed the FixedVec capacity {cap}")
            for x in v:
                item_enc(x, out)
            out += bytes(size * (cap - len(v)))
            out += _U64.pack(len(v))

        def dec_fixed_vec(b: memoryview, p: int) -> tuple[list[Any], int]:
            slots = []
            for _ in range(cap):
                x, p = item_dec(b, p)
                slots.append(x)
            if p + 8 > len(b):
                raise BorshError("unexpected end of input in FixedVec length")
            (n,) = _U64.unpack_from(b, p)
            if n > cap:
                raise BorshError(f"FixedVec length {n} exceeds its capacity {cap}")
            return slots[:n], p + 8

        return enc_fixed_vec, dec_fixed_vec

    def proxy_codec(self, wt: schema.WProxy, borrow: bool) -> tuple[Encoder, Decoder] | None:
        if not issubclass(wt.cls, Bloom):
            return None
        # Bloom's hand-written borsh: the K keys, then the U words, all u64.
        cls = wt.cls
        words_struct = _struct.Struct(f"<{cls.num_keys + cls.num_words}Q")

        def enc_bloom(v: Any, out: bytearray) -> None:
            out += words_struct.pack(*v.keys, *v.words)

        def dec_bloom(b: memoryview, p: int) -> tuple[Any, int]:
            if p + words_struct.size > len(b):
                raise BorshError("unexpected end of input in bloom")
            values = words_struct.unpack_from(b, p)
            return cls(values[: cls.num_keys], values[cls.num_keys :]), p + words_struct.size

        return enc_bloom, dec_bloom


BORSH = Borsh()


# --------------------------------------------------------------------------------------------
# Public API


def to_borsh(value: Any, tp: Any = None) -> bytes:
    """The borsh encoding of `value` as type `tp` (default: `type(value)`)."""
    return BORSH.to_bytes(value, tp)


# A class gives its instances' type; any other type form (Annotated, unions, ...) gives Any.
@overload
def take_borsh(data: bytes | bytearray | memoryview, tp: type[T]) -> tuple[T, int]: ...
@overload
def take_borsh(data: bytes | bytearray | memoryview, tp: Any) -> tuple[Any, int]: ...
def take_borsh(data: bytes | bytearray | memoryview, tp: Any) -> tuple[Any, int]:
    """Decode one value from the front of `data`; returns it and the number of bytes used."""
    return BORSH.take_from_bytes(data, tp)


@overload
def from_borsh(data: bytes | bytearray | memoryview, tp: type[T]) -> T: ...
@overload
def from_borsh(data: bytes | bytearray | memoryview, tp: Any) -> Any: ...
def from_borsh(data: bytes | bytearray | memoryview, tp: Any) -> Any:
    """Decode a value that must use all of `data` (Anchor's instruction decoder allows trailing
    bytes; use `take_borsh` for that)."""
    return BORSH.from_bytes(data, tp)
