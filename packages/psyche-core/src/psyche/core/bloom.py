"""Bloom filters that witnesses use to say which trainers and which results they saw.

`Bloom[U, K]` is upstream's `Bloom<U, K>`: U words of 64 bits and K hash keys. `WitnessBloom` is
`Bloom[16, 8]`. Upstream quirks kept, because every node must set the same bits:

* the hash is FNV-1a with the *key* as initial state (not the FNV offset basis);
* a position is the hash modulo the whole bit length `U * 64`; the "optimal" bit count that
  `Bloom.random` computes is only checked against that length, never used;
* bits are addressed Lsb0: bit p is `1 << (p % 64)` of word `p // 64`.

On the wire a bloom is upstream's custom serde form: `keys` as a length-prefixed `Vec<u64>`,
then bitvec's `BitArr` struct (order name, head index, bit count, words).
"""

from __future__ import annotations

import math
import secrets
import struct as _struct
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from psyche.core.constants import BITVEC_LSB0, BLOOM_MAX_PRINT_BITS, FNV_PRIME
from psyche.core.numeric import U64_MAX, saturating_cast_unsigned
from psyche.core.serde import U8, U64, Array, SerdeProxy, struct, to_bytes

_LANE_BITS = 128  # every key hashes in its own 128-bit lane of one big integer


def fnv1a_64(data: bytes, key: int) -> int:
    """FNV-1a over `data` starting from `key` (upstream `FnvHasher::with_key(key)`)."""
    h = key
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & U64_MAX
    return h


@struct(frozen=True)
class BitIdx:
    """bitvec's head-bit index: the register width in bits and the index of the first bit."""

    width: U8
    index: U8


@cache
def _bitarr_type(num_words: int) -> type:
    annotations = {
        "order": str,
        "head": BitIdx,
        "bits": U64,
        "data": Annotated[list[U64], Array(num_words)],
    }
    namespace = {"__annotations__": annotations, "__module__": __name__}
    return struct(frozen=True)(type(f"BitArr{num_words}", (), namespace))


@cache
def _bloom_serde_type(num_words: int) -> type:
    annotations = {"keys": list[U64], "bits": _bitarr_type(num_words)}
    namespace = {"__annotations__": annotations, "__module__": __name__}
    return struct(frozen=True)(type(f"BloomSerde{num_words}", (), namespace))


@dataclass(frozen=True)
class _Lanes:
    """Constants for hashing one item with all K keys at once, one key per 128-bit lane.

    A lane's value stays below 2^64 after masking, and times the 41-bit FNV prime below 2^105,
    so no carry ever crosses into the next lane: each lane computes exactly `fnv1a_64`.
    """

    byte_table: tuple[int, ...]  # byte b copied into every lane
    mask: int  # 2^64 - 1 in every lane
    unpack: Any  # struct unpacker of the lanes' low 8 bytes

    @classmethod
    def for_keys(cls, num_keys: int) -> _Lanes:
        ones = sum(1 << (_LANE_BITS * i) for i in range(num_keys))
        return cls(
            byte_table=tuple(b * ones for b in range(256)),
            mask=ones * U64_MAX,
            unpack=_struct.Struct("<" + "Q8x" * num_keys).unpack,
        )


class Bloom(SerdeProxy):
    """A bloom filter of `num_words * 64` bits and `num_keys` keys.

    The size is part of the type, as in Rust: `Bloom[16, 8]` (cached), or a named subclass
    `class WitnessBloom(Bloom, num_words=16, num_keys=8)`.
    """

    num_words: ClassVar[int]
    num_keys: ClassVar[int]
    _lanes: ClassVar[_Lanes]
    __slots__ = ("_bits", "_keys", "_packed_keys")

    def __init_subclass__(
        cls, num_words: int | None = None, num_keys: int | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if num_words is None and num_keys is None:
            return  # a subclass of a sized bloom keeps its size
        if num_words is None or num_keys is None or num_words < 1 or num_keys < 0:
            raise ValueError(f"no Bloom[{num_words}, {num_keys}]: needs words >= 1, keys >= 0")
        cls.num_words = num_words
        cls.num_keys = num_keys
        cls._lanes = _Lanes.for_keys(num_keys)
        cls.serde_proxy_type = _bloom_serde_type(num_words)

    def __class_getitem__(cls, params: tuple[int, int]) -> type[Bloom]:
        num_words, num_keys = params
        return _bloom_class(num_words, num_keys)

    def __init__(self, keys: Sequence[int] | None = None, words: Sequence[int] | None = None):
        if not hasattr(type(self), "num_words"):
            raise TypeError("pick a size first: Bloom[num_words, num_keys](...)")
        keys = [0] * self.num_keys if keys is None else list(keys)
        words = [0] * self.num_words if words is None else list(words)
        if len(keys) != self.num_keys:
            raise ValueError(f"Expected {self.num_keys} keys, got {len(keys)}")
        if len(words) != self.num_words:
            raise ValueError(f"Expected {self.num_words} words, got {len(words)}")
        for value in (*keys, *words):
            if type(value) is not int or not 0 <= value <= U64_MAX:
                raise ValueError(f"bloom keys and words are u64 values, got {value!r}")
        self._keys = tuple(keys)
        self._packed_keys = sum(k << (_LANE_BITS * i) for i, k in enumerate(keys))
        # All U words as one integer: bit p of the filter is bit p of `_bits` (Lsb0 words).
        self._bits = sum(w << (64 * i) for i, w in enumerate(words))

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def max_bits(cls) -> int:
        return cls.num_words * 64

    @classmethod
    def new(cls, num_bits: int, keys: Sequence[int]) -> Bloom:
        """An empty filter with the given keys; `num_bits` is only checked (upstream quirk)."""
        if num_bits > cls.max_bits():
            raise ValueError(f"num_bits {num_bits} exceeds the filter's {cls.max_bits()} bits")
        return cls(keys)

    @classmethod
    def random(cls, num_items: int, false_rate: float) -> Bloom:
        """An empty filter with fresh random keys from the OS's CSPRNG."""
        m = cls.num_bits(float(num_items), false_rate)
        num_bits = max(1, min(saturating_cast_unsigned(m, 64), cls.max_bits()))
        return cls.new(num_bits, [secrets.randbits(64) for _ in range(cls.num_keys)])

    @staticmethod
    def num_bits(num_items: float, false_rate: float) -> float:
        """`ceil(n ln p / ln(1 / 2^ln 2))`, with IEEE results where Python would raise."""
        if false_rate == 0:
            log_p = -math.inf
        elif false_rate < 0:
            log_p = math.nan
        else:
            log_p = math.log(false_rate)  # NaN and inf pass through
        value = num_items * log_p / math.log(1.0 / 2.0 ** math.log(2.0))
        return value if math.isnan(value) or math.isinf(value) else float(math.ceil(value))

    @classmethod
    def from_words(cls, words: Sequence[int]) -> Bloom:
        """Inverse of `to_words`: K keys then U data words (the on-chain borsh layout)."""
        if len(words) != cls.num_keys + cls.num_words:
            raise ValueError(
                f"expected {cls.num_keys + cls.num_words} u64 values, got {len(words)}"
            )
        return cls(words[: cls.num_keys], words[cls.num_keys :])

    # ---- views -------------------------------------------------------------------------------

    @property
    def keys(self) -> tuple[int, ...]:
        return self._keys

    @property
    def words(self) -> list[int]:
        bits = self._bits
        return [(bits >> (64 * i)) & U64_MAX for i in range(self.num_words)]

    def to_words(self) -> list[int]:
        """K keys then U data words, each a u64 (borsh writes them little-endian in this order)."""
        return [*self._keys, *self.words]

    # ---- filter operations -------------------------------------------------------------------

    def positions(self, item: bytes) -> list[int]:
        """The bit set for each key, in key order."""
        lanes = self._lanes
        table, mask = lanes.byte_table, lanes.mask
        h = self._packed_keys
        for byte in item:
            h = ((h ^ table[byte]) * FNV_PRIME) & mask
        size = self.num_words * 64
        hashes = lanes.unpack(h.to_bytes(self.num_keys * _LANE_BITS // 8, "little"))
        return [x % size for x in hashes]

    def _mask(self, item: bytes) -> int:
        mask = 0
        for position in self.positions(item):
            mask |= 1 << position
        return mask

    def add(self, item: bytes) -> None:
        self._bits |= self._mask(item)

    def contains(self, item: bytes) -> bool:
        mask = self._mask(item)
        return self._bits & mask == mask

    def __contains__(self, item: bytes) -> bool:
        return self.contains(item)

    def clear(self) -> None:
        """Zero the bits; the keys stay."""
        self._bits = 0

    # ---- value semantics ---------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bloom):
            return NotImplemented
        return (
            (self.num_words, self.num_keys) == (other.num_words, other.num_keys)
            and self._keys == other._keys
            and self._bits == other._bits
        )

    # (defining __eq__ without __hash__ leaves instances unhashable: they are mutable)

    def copy(self) -> Bloom:
        return type(self)(self._keys, self.words)

    def __reduce__(self) -> Any:
        cls = type(self)
        if cls is _bloom_class(self.num_words, self.num_keys):
            return (_rebuild, (self.num_words, self.num_keys, self._keys, self.words))
        return (cls, (self._keys, self.words))  # a named subclass, importable by name

    def __repr__(self) -> str:
        # upstream's Debug form
        if self.max_bits() <= BLOOM_MAX_PRINT_BITS:
            shown = "".join(str((self._bits >> i) & 1) for i in range(self.max_bits()))
        else:
            shown = "".join(f"{w:016x}" for w in self.words)
        return f"Bloom {{ keys.len: {self.num_keys}, bits: {shown} }}"

    # ---- serde -------------------------------------------------------------------------------

    def to_serde_proxy(self) -> Any:
        bitarr = _bitarr_type(self.num_words)
        return _bloom_serde_type(self.num_words)(
            keys=list(self._keys),
            bits=bitarr(
                order=BITVEC_LSB0,
                head=BitIdx(width=64, index=0),
                bits=self.max_bits(),
                data=self.words,
            ),
        )

    @classmethod
    def max_postcard_size(cls) -> int:
        """The most postcard bytes a bloom of this size takes (every key and word at its
        widest): what a receiver may accept for one before decoding it
        (`psyche.core.serde.max_encoded_size`)."""
        return len(to_bytes(cls([U64_MAX] * cls.num_keys, [U64_MAX] * cls.num_words)))

    @classmethod
    def from_serde_proxy(cls, proxy: Any) -> Bloom:
        # The checks of bitvec's BitArray and of upstream's Bloom deserializers, in their order.
        bits = proxy.bits
        if bits.order != BITVEC_LSB0:
            raise ValueError(
                f'invalid value: string "{bits.order}", expected the string "{BITVEC_LSB0}"'
            )
        if bits.head.width != 64:
            raise ValueError(
                f"invalid type: integer `{bits.head.width}`, expected a valid `BitIdx<u64>`"
            )
        if bits.head.index >= 64:
            raise ValueError(
                f"invalid value: integer `{bits.head.index}`, expected a valid `BitIdx<u64>`"
            )
        if bits.head.index != 0:
            raise ValueError(
                f"invalid value: integer `{bits.head.index}`, expected `BitArray` must have a "
                "head-bit of `0`"
            )
        if bits.bits != cls.max_bits():
            raise ValueError(
                f"invalid length {bits.bits}, expected a `BitArray<[u64; {cls.num_words}], "
                f"{BITVEC_LSB0}>`"
            )
        if len(proxy.keys) != cls.num_keys:
            raise ValueError(f"Expected {cls.num_keys} keys, got {len(proxy.keys)}")
        return cls(proxy.keys, bits.data)


@cache
def _bloom_class(num_words: int, num_keys: int) -> type[Bloom]:
    name = f"Bloom[{num_words}, {num_keys}]"

    def body(namespace: dict[str, Any]) -> None:
        namespace.update(__slots__=(), __module__=__name__, __qualname__=name)

    return types.new_class(name, (Bloom,), {"num_words": num_words, "num_keys": num_keys}, body)


def _rebuild(num_words: int, num_keys: int, keys: Iterable[int], words: Iterable[int]) -> Bloom:
    return _bloom_class(num_words, num_keys)(list(keys), list(words))


if TYPE_CHECKING:
    # A type checker cannot subscript a class with sizes (values): it sees a plain Bloom.
    WitnessBloom = Bloom
else:
    WitnessBloom = Bloom[16, 8]
