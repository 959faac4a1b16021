"""Upstream's fixed-capacity `FixedString<L>` and `FixedVec<T, N>` as rules on plain `str`/`list`.

Upstream stores these inline (`[u8; L]` zero padded, `[T; N]` plus a length) so that the
coordinator has a fixed size on chain. Here a value is an ordinary `str` or `list`; these helpers
give the operations whose results depend on the capacity: truncation, the capacity errors, and
how NUL padding is read and written.

A `str` value `v` of a `FixedString<L>` stands for the bytes `v.encode()[:L]`, zero padded:

* on the wire and in TOML it is written as those bytes decoded lossily with NULs stripped from both
  ends (`fixed_str_serialize`);
* read back, a string keeps its first L bytes, silently (`fixed_str_deserialize`), which may cut a
  UTF-8 character: the cut character becomes U+FFFD, exactly as upstream then writes it out again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


class FixedStringError(ValueError):
    def __init__(self, length: int, capacity: int) -> None:
        super().__init__(f"string of length {length} doesn't fit in FixedString<{capacity}>")
        self.length = length
        self.capacity = capacity


class FixedVecError(ValueError):
    """Upstream's two error texts: "FixedVec is full" and "Index out of bounds"."""


# ---- FixedString -----------------------------------------------------------------------------


def fixed_str_from_bytes(raw: bytes, capacity: int) -> str:
    """The `str` for a FixedString holding `raw` (cut to `capacity` bytes); padding dropped."""
    return raw[:capacity].decode("utf-8", errors="replace").rstrip("\0")


def fixed_str_try_from(s: str, capacity: int) -> str:
    """`s` itself if its UTF-8 form fits, else `FixedStringError` (upstream `TryFrom<&str>`)."""
    length = len(s.encode("utf-8"))
    if length > capacity:
        raise FixedStringError(length, capacity)
    return s


def fixed_str_from_str_truncated(s: str, capacity: int) -> str:
    """The first `capacity` bytes of `s` (may cut a UTF-8 character, which reads back as U+FFFD)."""
    return fixed_str_from_bytes(s.encode("utf-8"), capacity)


def fixed_str_serialize(value: str, capacity: int) -> str:
    """What upstream writes for the value: lossy UTF-8 of all its bytes, NULs trimmed both ends."""
    return value.encode("utf-8")[:capacity].decode("utf-8", errors="replace").strip("\0")


def fixed_str_deserialize(text: str, capacity: int) -> str:
    """The value upstream reads from `text`: its first `capacity` bytes, silently truncated."""
    return fixed_str_from_bytes(text.encode("utf-8"), capacity)


def fixed_str_display(value: str, capacity: int) -> str:
    """Upstream's `String::from(&FixedString)`: the bytes up to the first NUL, lossy UTF-8."""
    raw = value.encode("utf-8")[:capacity]
    return raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")


def fixed_str_debug(value: str, capacity: int) -> str:
    """Upstream's Debug form, `"run" (3/32 bytes, 29 zeroes)` (it ends up in file names)."""
    raw = value.encode("utf-8")[:capacity]
    nul = raw.find(b"\0")
    used = nul if nul >= 0 else len(raw)
    content = fixed_str_display(value, capacity)
    return f'"{content}" ({used}/{capacity} bytes, {capacity - used} zeroes)'


def fixed_str_is_empty(value: str) -> bool:
    """Upstream checks only the first byte."""
    return value == "" or value.startswith("\0")


# ---- FixedVec --------------------------------------------------------------------------------


def fixed_vec_push(items: list[T], value: T, capacity: int) -> None:
    if len(items) >= capacity:
        raise FixedVecError("FixedVec is full")
    items.append(value)


def fixed_vec_insert(items: list[T], index: int, value: T, capacity: int) -> None:
    if len(items) >= capacity:
        raise FixedVecError("FixedVec is full")
    if not 0 <= index <= len(items):
        raise FixedVecError("Index out of bounds")
    items.insert(index, value)


def fixed_vec_extend(items: list[T], values: Iterable[T], capacity: int) -> None:
    """Push one by one: on overflow the items that fitted stay (as upstream)."""
    for value in values:
        fixed_vec_push(items, value, capacity)


def fixed_vec_try_from(values: Iterable[T], capacity: int) -> list[T]:
    items: list[T] = []
    fixed_vec_extend(items, values, capacity)
    return items


def fixed_vec_remove(items: list[T], index: int) -> T | None:
    """Remove and return `items[index]`; None (not an error) when the index is past the end."""
    if not 0 <= index < len(items):
        return None
    return items.pop(index)


def vec_to_array(values: list[T], length: int, default: Any) -> list[T]:
    """Upstream `serde_deserialize_vec_to_array`: the first `length` values, padded with `default`."""
    out = list(values[:length])
    out.extend([default] * (length - len(out)))
    return out
