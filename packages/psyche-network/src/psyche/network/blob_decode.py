"""Decoding a downloaded blob without copying its byte fields.

A blob can be tens of MiB, nearly all of it inside `bytes` (`Vec<u8>`) fields: tensor data, a
serialized parameter, or the whole payload when the blob type is `bytes`. serde's decoder copies
each such field into a new `bytes` object; `from_blob` makes each a read-only `memoryview` into
the blob instead. The blob is the one the downloader verified against the ticket's hash and
stored; nothing writes to it afterwards, and a view keeps it alive after the store drops it.
Everything else is decoded by serde's own decoder, so values and errors are exactly
`from_bytes`'s.

Consumers get bytes-like views: `len`, slicing, `==` with bytes, hashing, `np.frombuffer`,
`torch.frombuffer`, `hashlib` and `str(view, "utf-8")` all work; `bytes(view)` makes an owned
copy where one is needed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from psyche.core.serde import PostcardError, decode_varint, wire_type

# The borrowing mode belongs in the serde layer (e.g. `from_bytes(..., borrow=True)`); until it
# has one, subtrees without `Vec<u8>` fields reuse serde's compiled decoders directly.
from psyche.core.serde.postcard import _decoder as _serde_decoder
from psyche.core.serde.schema import (
    WArray,
    WBytes,
    WDataEnum,
    WireType,
    WOption,
    WSeq,
    WStruct,
    WTuple,
)

Decoder = Callable[[memoryview, int], tuple[Any, int]]

_decoders: dict[int, Decoder] = {}
_building: dict[int, Decoder] = {}
_lock = threading.RLock()


def prepare(tp: Any) -> None:
    """Compile `tp`'s decoder now (on the event loop), so that decoding in worker threads
    only ever reads finished decoders."""
    _decoder(wire_type(tp))


def from_blob(blob: bytes | bytearray | memoryview, tp: Any) -> Any:
    """`from_bytes(blob, tp)`, with every `bytes` field a read-only view into `blob`."""
    view = memoryview(blob).toreadonly()
    try:
        value, used = _decoder(wire_type(tp))(view, 0)
    except RecursionError as e:
        raise PostcardError("input nests too deeply") from e
    if used != len(view):
        raise PostcardError(
            f"{len(view) - used} trailing bytes after {getattr(tp, '__name__', tp)}"
        )
    return value


def _decoder(wt: WireType) -> Decoder:
    dec = _decoders.get(id(wt))
    if dec is not None:
        return dec
    with _lock:  # only finished decoders are ever visible to other threads
        dec = _decoders.get(id(wt)) or _building.get(id(wt))
        if dec is not None:
            return dec
        holder: list[Decoder] = []
        _building[id(wt)] = lambda b, p: holder[0](b, p)  # recursive types end here
        try:
            dec = _build(wt) if _borrows(wt, set()) else _serde_decoder(wt)
        finally:
            del _building[id(wt)]
        holder.append(dec)
        _decoders[id(wt)] = dec
        return dec


def _borrows(wt: WireType, seen: set[int]) -> bool:
    """Whether a `Vec<u8>` is reachable in `wt` other than through a proxy (proxies convert
    what they decode, so they get owned values)."""
    if id(wt) in seen:
        return False
    seen.add(id(wt))
    if isinstance(wt, WBytes):
        return wt.length is None
    if isinstance(wt, WOption | WSeq | WArray):
        inner = wt.inner if isinstance(wt, WOption) else wt.item
        return _borrows(inner, seen)
    if isinstance(wt, WTuple):
        return any(_borrows(item, seen) for item in wt.items)
    if isinstance(wt, WStruct):
        return any(_borrows(field, seen) for _, field in wt.fields)
    if isinstance(wt, WDataEnum):
        return any(p is not None and _borrows(p, seen) for _, p in wt.variants)
    return False


def _build(wt: WireType) -> Decoder:
    if isinstance(wt, WBytes):

        def dec_bytes(b: memoryview, p: int) -> tuple[memoryview, int]:
            n, p = decode_varint(b, p, 64)
            end = p + n
            if end > len(b):
                raise PostcardError(f"unexpected end of input: needed {n} bytes, {len(b) - p} left")
            return b[p:end], end

        return dec_bytes

    if isinstance(wt, WOption):
        inner = _decoder(wt.inner)

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
        item = _decoder(wt.item)
        cap = wt.capacity

        def dec_seq(b: memoryview, p: int) -> tuple[list[Any], int]:
            n, p = decode_varint(b, p, 64)
            if cap is not None and n > cap:
                raise PostcardError(f"FixedVec is full: {n} items exceed the capacity {cap}")
            if n > len(b) - p:
                raise PostcardError(f"sequence claims {n} items but only {len(b) - p} bytes remain")
            out = []
            for _ in range(n):
                x, p = item(b, p)
                out.append(x)
            return out, p

        return dec_seq

    if isinstance(wt, WArray | WTuple):
        items = (
            [_decoder(wt.item)] * wt.length
            if isinstance(wt, WArray)
            else [_decoder(i) for i in wt.items]
        )
        as_tuple = isinstance(wt, WTuple)

        def dec_fixed(b: memoryview, p: int) -> tuple[Any, int]:
            out = []
            for d in items:
                x, p = d(b, p)
                out.append(x)
            return (tuple(out) if as_tuple else out), p

        return dec_fixed

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
                raise PostcardError(f"invalid {cls.__name__}: {e}") from e

        return dec_struct

    if isinstance(wt, WDataEnum):
        table = [
            (var, None if payload is None else _decoder(payload)) for var, payload in wt.variants
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

    raise TypeError(f"no borrowing decoder for {wt!r}")  # _borrows() admits nothing else
