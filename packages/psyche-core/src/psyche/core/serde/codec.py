"""A compiler from `WireType` trees to binary encoders and decoders, shared by every byte format.

postcard (the wire format) and borsh (Anchor instruction data) agree on most of serde's data model
— fields back to back, `Option` as a 0/1 byte, little-endian floats, fixed arrays without a length
— and differ in a few places: how integers, lengths and enum tags are written, and how upstream's
fixed-capacity types are laid out. `BinaryCodec` implements everything they share; a format is a
subclass that overrides the hooks where it differs.

Each type is compiled once into closures (`encoder(wt)`, `decoder(wt)`) and cached per codec.
Compilation publishes only finished closures, so decoding may run in worker threads while another
thread compiles. Decoders never trust the input: every length is checked against the bytes that
remain and every capacity against its bound; failures raise the codec's `error` type.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from psyche.core.serde import schema
from psyche.core.serde.schema import IntMarker, wire_type

Encoder = Callable[[Any, bytearray], None]
Decoder = Callable[[memoryview, int], tuple[Any, int]]
_F = TypeVar("_F", Encoder, Decoder)
_K = TypeVar("_K", int, tuple[int, bool])


def _decode_items(item: Decoder, n: int, b: memoryview, p: int) -> tuple[list[Any], int]:
    """`n` items back to back from `b[p:]` (a sequence's or an array's), and where they end."""
    out = []
    for _ in range(n):
        x, p = item(b, p)
        out.append(x)
    return out, p


class BinaryCodec:
    """Compiles encoders and decoders for one byte format; subclasses override the hooks."""

    name = "binary"
    error: type[ValueError] = ValueError
    postcard_fields = False
    """Whether struct fields declared postcard-only (`schema.WStruct.postcard_fields`) are written."""

    def __init__(self) -> None:
        self._encoders: dict[int, Encoder] = {}
        self._decoders: dict[tuple[int, bool], Decoder] = {}
        self._building_encoders: dict[int, Encoder] = {}
        self._building_decoders: dict[tuple[int, bool], Decoder] = {}
        self._lock = threading.RLock()

    def _struct_fields(self, wt: schema.WStruct) -> list[tuple[str, schema.WireType]]:
        return [*wt.fields, *wt.postcard_fields] if self.postcard_fields else wt.fields

    # ---- public API ---------------------------------------------------------------------------

    def to_bytes(self, value: Any, tp: Any = None) -> bytes:
        out = bytearray()
        self.encoder(wire_type(type(value) if tp is None else tp))(value, out)
        return bytes(out)

    def encode_into(self, value: Any, tp: Any, out: bytearray) -> None:
        self.encoder(wire_type(tp))(value, out)

    def take_from_bytes(
        self, data: bytes | bytearray | memoryview, tp: Any, *, borrow: bool = False
    ) -> tuple[Any, int]:
        buf = memoryview(data)
        if borrow:
            buf = buf.toreadonly()
        try:
            return self.decoder(wire_type(tp), borrow)(buf, 0)
        except RecursionError as e:
            raise self.error("input nests too deeply") from e

    def from_bytes(
        self, data: bytes | bytearray | memoryview, tp: Any, *, borrow: bool = False
    ) -> Any:
        value, used = self.take_from_bytes(data, tp, borrow=borrow)
        size = memoryview(data).nbytes
        if used != size:
            raise self.error(f"{size - used} trailing bytes after {getattr(tp, '__name__', tp)}")
        return value

    # ---- compilation --------------------------------------------------------------------------

    def encoder(self, wt: schema.WireType) -> Encoder:
        key = id(wt)
        enc = self._encoders.get(key)
        if enc is None:
            enc = self._compile(
                self._encoders, self._building_encoders, key, self.build_encoder, wt
            )
        return enc

    def decoder(self, wt: schema.WireType, borrow: bool = False) -> Decoder:
        """`borrow=True`: `bytes` fields are read-only views into the input instead of copies."""
        key = (id(wt), borrow)
        dec = self._decoders.get(key)
        if dec is None:
            dec = self._compile(
                self._decoders,
                self._building_decoders,
                key,
                lambda wt: self.build_decoder(wt, borrow),
                wt,
            )
        return dec

    def _compile(
        self,
        done: dict[_K, _F],
        building: dict[_K, _F],
        key: _K,
        build: Callable[[schema.WireType], _F],
        wt: schema.WireType,
    ) -> _F:
        """`build(wt)`, published in `done` under `key` once finished (a thread that finds it
        there uses it without the lock). While it builds, `building` holds a placeholder that
        forwards to the finished closure, which ends recursion in self-referencing types; the
        lock (re-entrant) keeps the placeholder to the building thread."""
        with self._lock:
            fn = done.get(key) or building.get(key)
            if fn is not None:
                return fn
            holder: list[_F] = []
            building[key] = cast(_F, lambda *args: holder[0](*args))
            try:
                fn = build(wt)
            finally:
                del building[key]
            holder.append(fn)
            done[key] = fn
            return fn

    # ---- hooks: what formats write differently ------------------------------------------------

    def int_codec(self, marker: IntMarker) -> tuple[Encoder, Decoder]:
        raise NotImplementedError

    def encode_len(self, n: int, out: bytearray) -> None:
        """The length prefix of a string, byte string or sequence."""
        raise NotImplementedError

    def decode_len(self, b: memoryview, p: int) -> tuple[int, int]:
        raise NotImplementedError

    def encode_tag(self, index: int, out: bytearray) -> None:
        """An enum's variant index."""
        raise NotImplementedError

    def decode_tag(self, b: memoryview, p: int) -> tuple[int, int]:
        raise NotImplementedError

    def fixed_str_codec(self, capacity: int) -> tuple[Encoder, Decoder]:
        """Upstream's `FixedString<L>`."""
        raise NotImplementedError

    def fixed_vec_codec(self, wt: schema.WSeq, borrow: bool) -> tuple[Encoder, Decoder] | None:
        """Upstream's `FixedVec<T, N>`; None lays it out as a sequence with a capacity check."""
        return None

    def proxy_codec(self, wt: schema.WProxy, borrow: bool) -> tuple[Encoder, Decoder] | None:
        """A format-specific layout for a custom type; None uses its serde proxy."""
        return None

    # ---- shared building blocks ---------------------------------------------------------------

    def check_int(self, value: Any, marker: IntMarker) -> None:
        if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.error(f"expected {marker.rust_name}, got {type(value).__name__}")
        if not marker.min <= value <= marker.max:
            raise self.error(f"{value} out of range for {marker.rust_name}")

    def take(self, b: memoryview, p: int, n: int) -> tuple[bytes, int]:
        end = p + n
        if n < 0 or end > len(b):
            raise self.error(f"unexpected end of input: needed {n} bytes, {len(b) - p} left")
        return bytes(b[p:end]), end

    def take_view(self, b: memoryview, p: int, n: int) -> tuple[memoryview, int]:
        end = p + n
        if n < 0 or end > len(b):
            raise self.error(f"unexpected end of input: needed {n} bytes, {len(b) - p} left")
        return b[p:end], end

    def build_encoder(self, wt: schema.WireType) -> Encoder:
        err = self.error
        if isinstance(wt, schema.WInt):
            return self.int_codec(wt.marker)[0]

        if isinstance(wt, schema.WFloat):
            packf = struct.Struct("<f" if wt.bits == 32 else "<d").pack
            bits = wt.bits

            def enc_float(v: Any, out: bytearray) -> None:
                try:
                    out += packf(v)
                except (struct.error, OverflowError, TypeError) as e:
                    raise err(f"cannot encode {v!r} as f{bits}: {e}") from e

            return enc_float

        if isinstance(wt, schema.WBool | schema.WSmallBool):

            def enc_bool(v: Any, out: bytearray) -> None:
                out.append(1 if v else 0)

            return enc_bool

        if isinstance(wt, schema.WStr):
            if wt.capacity is not None:
                return self.fixed_str_codec(wt.capacity)[0]
            encode_len = self.encode_len

            def enc_str(v: Any, out: bytearray) -> None:
                raw = v.encode("utf-8")
                encode_len(len(raw), out)
                out += raw

            return enc_str

        if isinstance(wt, schema.WBytes):
            length = wt.length
            if length is not None:

                def enc_fixed_bytes(v: Any, out: bytearray) -> None:
                    if len(v) != length:
                        raise err(f"expected {length} bytes, got {len(v)}")
                    out += v

                return enc_fixed_bytes
            encode_len = self.encode_len

            def enc_bytes(v: Any, out: bytearray) -> None:
                encode_len(len(v), out)
                out += v

            return enc_bytes

        if isinstance(wt, schema.WOption):
            inner = self.encoder(wt.inner)

            def enc_option(v: Any, out: bytearray) -> None:
                if v is None:
                    out.append(0)
                else:
                    out.append(1)
                    inner(v, out)

            return enc_option

        if isinstance(wt, schema.WSeq):
            if wt.capacity is not None:
                custom = self.fixed_vec_codec(wt, False)
                if custom is not None:
                    return custom[0]
            item = self.encoder(wt.item)
            cap = wt.capacity
            encode_len = self.encode_len

            def enc_seq(v: Any, out: bytearray) -> None:
                if cap is not None and len(v) > cap:
                    raise err(f"FixedVec is full: {len(v)} items exceed the capacity {cap}")
                encode_len(len(v), out)
                for x in v:
                    item(x, out)

            return enc_seq

        if isinstance(wt, schema.WArray):
            item = self.encoder(wt.item)
            length = wt.length

            def enc_array(v: Any, out: bytearray) -> None:
                if len(v) != length:
                    raise err(f"expected {length} items, got {len(v)}")
                for x in v:
                    item(x, out)

            return enc_array

        if isinstance(wt, schema.WTuple):
            items = [self.encoder(i) for i in wt.items]

            def enc_tuple(v: Any, out: bytearray) -> None:
                if len(v) != len(items):
                    raise err(f"expected a {len(items)}-tuple, got {len(v)} items")
                for e, x in zip(items, v):
                    e(x, out)

            return enc_tuple

        if isinstance(wt, schema.WStruct):
            fields = [(name, self.encoder(f)) for name, f in self._struct_fields(wt)]

            def enc_struct(v: Any, out: bytearray) -> None:
                for name, e in fields:
                    e(getattr(v, name), out)

            return enc_struct

        if isinstance(wt, schema.WUnitEnum):
            enum_cls = wt.cls
            encode_tag = self.encode_tag

            def enc_unit_enum(v: Any, out: bytearray) -> None:
                if not isinstance(v, enum_cls):
                    raise err(f"{v!r} is not a {enum_cls.__name__}")
                encode_tag(v.value, out)

            return enc_unit_enum

        if isinstance(wt, schema.WDataEnum):
            table = {
                var: (var.index, None if payload is None else self.encoder(payload))
                for var, payload in wt.variants
            }
            enum_name = wt.cls.__name__
            encode_tag = self.encode_tag

            def enc_data_enum(v: Any, out: bytearray) -> None:
                entry = table.get(type(v))
                if entry is None:
                    raise err(f"{v!r} is not a {enum_name}")
                index, payload_enc = entry
                encode_tag(index, out)
                if payload_enc is not None:
                    payload_enc(v.value, out)

            return enc_data_enum

        if isinstance(wt, schema.WProxy):
            custom = self.proxy_codec(wt, False)
            if custom is not None:
                return custom[0]
            proxy = self.encoder(wt.proxy)
            to_proxy = wt.to_proxy

            def enc_proxy(v: Any, out: bytearray) -> None:
                proxy(to_proxy(v), out)

            return enc_proxy

        raise TypeError(f"no {self.name} encoder for {wt!r}")

    def build_decoder(self, wt: schema.WireType, borrow: bool) -> Decoder:
        err = self.error
        if isinstance(wt, schema.WInt):
            return self.int_codec(wt.marker)[1]

        if isinstance(wt, schema.WFloat):
            s = struct.Struct("<f" if wt.bits == 32 else "<d")
            size, unpackf = s.size, s.unpack_from

            def dec_float(b: memoryview, p: int) -> tuple[float, int]:
                if p + size > len(b):
                    raise err("unexpected end of input in float")
                return unpackf(b, p)[0], p + size

            return dec_float

        if isinstance(wt, schema.WBool):

            def dec_bool(b: memoryview, p: int) -> tuple[bool, int]:
                if p >= len(b):
                    raise err("unexpected end of input")
                v = b[p]
                if v > 1:
                    raise err(f"invalid bool byte {v}")
                return v == 1, p + 1

            return dec_bool

        if isinstance(wt, schema.WSmallBool):
            # Upstream's SmallBoolean is a u8: any non-zero value reads as true.
            def dec_small_bool(b: memoryview, p: int) -> tuple[bool, int]:
                if p >= len(b):
                    raise err("unexpected end of input")
                return b[p] != 0, p + 1

            return dec_small_bool

        if isinstance(wt, schema.WStr):
            if wt.capacity is not None:
                return self.fixed_str_codec(wt.capacity)[1]
            decode_len, take = self.decode_len, self.take

            def dec_str(b: memoryview, p: int) -> tuple[str, int]:
                n, p = decode_len(b, p)
                raw, p = take(b, p, n)
                try:
                    return raw.decode("utf-8"), p
                except UnicodeDecodeError as e:
                    raise err(f"invalid UTF-8 in string: {e}") from e

            return dec_str

        if isinstance(wt, schema.WBytes):
            take_bytes: Callable[[memoryview, int, int], tuple[Any, int]] = (
                self.take_view if borrow else self.take
            )
            fixed_length = wt.length
            if fixed_length is not None:

                def dec_fixed_bytes(b: memoryview, p: int) -> tuple[Any, int]:
                    return take_bytes(b, p, fixed_length)

                return dec_fixed_bytes
            decode_len = self.decode_len

            def dec_bytes(b: memoryview, p: int) -> tuple[Any, int]:
                n, p = decode_len(b, p)
                return take_bytes(b, p, n)

            return dec_bytes

        if isinstance(wt, schema.WOption):
            inner = self.decoder(wt.inner, borrow)

            def dec_option(b: memoryview, p: int) -> tuple[Any, int]:
                if p >= len(b):
                    raise err("unexpected end of input in option")
                tag = b[p]
                if tag == 0:
                    return None, p + 1
                if tag == 1:
                    return inner(b, p + 1)
                raise err(f"invalid option tag {tag}")

            return dec_option

        if isinstance(wt, schema.WSeq):
            if wt.capacity is not None:
                custom = self.fixed_vec_codec(wt, borrow)
                if custom is not None:
                    return custom[1]
            item = self.decoder(wt.item, borrow)
            cap = wt.capacity
            decode_len = self.decode_len

            def dec_seq(b: memoryview, p: int) -> tuple[list[Any], int]:
                n, p = decode_len(b, p)
                if cap is not None and n > cap:
                    raise err(f"FixedVec is full: {n} items exceed the capacity {cap}")
                if n > len(b) - p:
                    # Every item takes at least one byte: a larger count is a lie, not a reason
                    # to allocate.
                    raise err(f"sequence claims {n} items but only {len(b) - p} bytes remain")
                return _decode_items(item, n, b, p)

            return dec_seq

        if isinstance(wt, schema.WArray):
            item = self.decoder(wt.item, borrow)
            length = wt.length

            def dec_array(b: memoryview, p: int) -> tuple[list[Any], int]:
                return _decode_items(item, length, b, p)

            return dec_array

        if isinstance(wt, schema.WTuple):
            items = [self.decoder(i, borrow) for i in wt.items]

            def dec_tuple(b: memoryview, p: int) -> tuple[tuple[Any, ...], int]:
                out = []
                for d in items:
                    x, p = d(b, p)
                    out.append(x)
                return tuple(out), p

            return dec_tuple

        if isinstance(wt, schema.WStruct):
            fields = [(name, self.decoder(f, borrow)) for name, f in self._struct_fields(wt)]
            cls = wt.cls

            def dec_struct(b: memoryview, p: int) -> tuple[Any, int]:
                values = {}
                for name, d in fields:
                    values[name], p = d(b, p)
                try:
                    return cls(**values), p
                except (TypeError, ValueError) as e:
                    raise err(f"invalid {cls.__name__}: {e}") from e

            return dec_struct

        if isinstance(wt, schema.WUnitEnum):
            members = list(wt.cls)
            enum_name = wt.cls.__name__
            decode_tag = self.decode_tag

            def dec_unit_enum(b: memoryview, p: int) -> tuple[Any, int]:
                i, p = decode_tag(b, p)
                if i >= len(members):
                    raise err(f"invalid variant index {i} for {enum_name}")
                return members[i], p

            return dec_unit_enum

        if isinstance(wt, schema.WDataEnum):
            # A variant class takes its payload (`_NewtypeVariant`) or nothing (`_UnitVariant`).
            table: list[tuple[Callable[..., Any], Decoder | None]] = [
                (var, None if payload is None else self.decoder(payload, borrow))
                for var, payload in wt.variants
            ]
            enum_name = wt.cls.__name__
            decode_tag = self.decode_tag

            def dec_data_enum(b: memoryview, p: int) -> tuple[Any, int]:
                i, p = decode_tag(b, p)
                if i >= len(table):
                    raise err(f"invalid variant index {i} for {enum_name}")
                var, payload_dec = table[i]
                if payload_dec is None:
                    return var(), p
                x, p = payload_dec(b, p)
                return var(x), p

            return dec_data_enum

        if isinstance(wt, schema.WProxy):
            custom = self.proxy_codec(wt, borrow)
            if custom is not None:
                return custom[1]
            # Custom types are small: they always own their bytes.
            proxy = self.decoder(wt.proxy)
            from_proxy = wt.from_proxy
            name = wt.cls.__name__

            def dec_proxy(b: memoryview, p: int) -> tuple[Any, int]:
                x, p = proxy(b, p)
                try:
                    return from_proxy(x), p
                except ValueError as e:
                    raise err(f"invalid {name}: {e}") from e

            return dec_proxy

        raise TypeError(f"no {self.name} decoder for {wt!r}")
