"""Rust numeric semantics that leak into results.

Upstream is Rust; wherever its integer or float behaviour differs from Python's and that difference
changes what a node computes (batch sizes, quorums, shuffles), the port goes through one of these
helpers instead of an ad-hoc expression, so every such place is easy to find and to audit.
"""

from __future__ import annotations

import math
import struct

U8_MAX = 0xFF
U16_MAX = 0xFFFF
U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
I64_MAX = 0x7FFF_FFFF_FFFF_FFFF
I64_MIN = -0x8000_0000_0000_0000

_UNSIGNED_MAX = {8: U8_MAX, 16: U16_MAX, 32: U32_MAX, 64: U64_MAX}


def wrapping_u64(value: int) -> int:
    """`u64` arithmetic result modulo 2^64 (Rust `wrapping_*`)."""
    return value & U64_MAX


def round_half_away_from_zero(value: float) -> float:
    """Rust `f64::round`: ties go away from zero (Python's `round` goes to even)."""
    if math.isnan(value) or math.isinf(value):
        return value
    magnitude = math.floor(abs(value) + 0.5)
    return float(math.copysign(magnitude, value))


def saturating_cast_unsigned(value: float, bits: int) -> int:
    """Rust `f as uN`: truncates toward zero, NaN becomes 0, clamps to the type's range."""
    if math.isnan(value):
        return 0
    if value <= 0:
        return 0
    top = _UNSIGNED_MAX[bits]
    if value >= top:
        return top
    return int(value)


def truncating_cast_unsigned(value: int, bits: int) -> int:
    """Rust `i as uN` between integer types: keeps the low `bits` bits."""
    return value & _UNSIGNED_MAX[bits]


F32_MAX = 3.4028234663852886e38
# Halfway between f32::MAX and 2^128: from here up, rounding to nearest (ties to even) overflows.
_F32_OVERFLOW = 2.0**128 - 2.0**103


def to_f32(value: float) -> float:
    """The nearest `f32` to `value`, as a Python float (raises OverflowError beyond f32 range)."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", value))[0])
    except OverflowError:
        # `struct` refuses anything above f32::MAX, even values that round down to it.
        if abs(value) < _F32_OVERFLOW:
            return math.copysign(F32_MAX, value)
        raise


def f32_shortest_repr(value: float) -> str:
    """Shortest decimal text that reads back as the same `f32` (how Rust prints an `f32`)."""
    if math.isnan(value) or math.isinf(value):
        return repr(value)
    single = to_f32(value)
    for digits in range(1, 18):
        text = f"{single:.{digits}g}"
        try:
            if to_f32(float(text)) == single:
                return text
        except OverflowError:  # a short rounding of f32::MAX may leave the f32 range
            continue
    return repr(single)


def f64_div(numerator: float, denominator: float) -> float:
    """IEEE-754 division as Rust does it: x/0.0 is ±inf and 0.0/0.0 is NaN (Python raises)."""
    if denominator == 0.0:
        if numerator == 0.0 or math.isnan(numerator):
            return math.nan
        negative = (numerator < 0) != (math.copysign(1.0, denominator) < 0)
        return -math.inf if negative else math.inf
    return numerator / denominator


def wrapping_u32(value: int) -> int:
    """`u32` arithmetic result modulo 2^32 (Rust release builds wrap on overflow)."""
    return value & U32_MAX
