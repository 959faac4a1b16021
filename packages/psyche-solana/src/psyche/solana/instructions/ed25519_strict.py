"""ed25519-dalek's `VerifyingKey::verify_strict`: the check agave's `Ed25519SigVerify`
precompile runs on every signature it names (agave `precompiles/src/ed25519.rs`, `verify`,
unconditionally since the `ed25519_precompile_verify_strict` feature was activated everywhere).

Plain RFC 8032 verification (`psyche.core.identity.verify_signature`, OpenSSL's) accepts
signatures `verify_strict` refuses: with a key of small order (the identity's encoding, say) the
"signature" `R = identity, S = 0` verifies for every message, and one of any small-order `R`
passes the cofactorless equation for some messages. A member whose key is such a point could
sign whatever it likes (a draw of its choosing). dalek's rules, in its order, all
`InvalidSignature` to the precompile:

1. `S` is canonical (`S < L`; the signature's `check_scalar`);
2. `R` decompresses to a curve point;
3. neither `R` nor the key `A` is of small order (`[8]P` is the identity);
4. the cofactorless equation: `[S]B - [k]A`, compressed, equals the signature's `R` bytes
   (`k = SHA-512(R || A || M)` over the bytes as given), so a non-canonical `R` encoding fails.

Steps 1-3 and `R`'s canonical encoding are checked here on the decompressed points; step 4 is
OpenSSL's cofactorless check (`verify_signature`), which also refuses `S >= L`. One corner
differs and cannot be reached: a key encoded non-canonically (`y >= p`, not of small order):
dalek hashes the bytes as given, and a valid signature for it needs the discrete log of a point
with `y < 19`.
"""

from __future__ import annotations

from psyche.core.identity import PUBLIC_KEY_LEN, SIGNATURE_LEN, verify_signature

P = 2**255 - 19
L = 2**252 + 27742317777372353535851937790883648493
"""The order of the base point: a canonical signature scalar is below it."""
_D = -121665 * pow(121666, P - 2, P) % P
_SQRT_M1 = pow(2, (P - 1) // 4, P)

Point = tuple[int, int]
"""Affine (x, y) of the curve."""

IDENTITY: Point = (0, 1)


def _sqrt_ratio(u: int, v: int) -> int | None:
    """A root x of x² = u / v (v ≠ 0), or None: x = u·v³·(u·v⁷)^((p-5)/8), times √-1 if needed
    (RFC 8032 §5.1.3, one exponentiation)."""
    v3 = v * v * v % P
    x = u * v3 * pow(u * v3 * v3 * v % P, (P - 5) // 8, P) % P
    check = v * x * x % P
    if check == u % P:
        return x
    if check == -u % P:
        return x * _SQRT_M1 % P
    return None


def decompress(encoded: bytes) -> Point | None:
    """curve25519-dalek's `CompressedEdwardsY::decompress`: y is the low 255 bits, reduced mod p
    (a non-canonical y is accepted), x the root of x² = (y² - 1) / (d·y² + 1) whose parity is the
    sign bit (for x = 0 the sign bit is ignored). None when x² has no root."""
    y = (int.from_bytes(encoded, "little") & ((1 << 255) - 1)) % P
    x = _sqrt_ratio((y * y - 1) % P, (_D * y * y + 1) % P)  # d·y² + 1 ≠ 0: -1/d is no square
    if x is None:
        return None
    if x != 0 and x & 1 != encoded[31] >> 7:
        x = P - x
    return (x, y)


def compress(point: Point) -> bytes:
    """The canonical 32-byte encoding: y below p, the sign bit x's parity."""
    x, y = point
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


def _order_8_y() -> int:
    """The y of a point of order 8: its double has y = 0, so x² = -y², and on the curve that
    gives d·y⁴ + 2·y² - 1 = 0."""
    for sign in (1, -1):
        root = _sqrt_ratio((1 + _D) % P, 1)
        assert root is not None
        y2 = (-1 + sign * root) * pow(_D, P - 2, P) % P
        y = _sqrt_ratio(y2, 1)
        if y is not None:
            return y
    raise AssertionError("ed25519 has points of order 8")


_SMALL_ORDER_Y = frozenset({1, P - 1, 0, _order_8_y(), P - _order_8_y()})
"""The y of the 8 torsion points (both x of each y are torsion): the identity (y = 1), the point
of order 2 (y = -1), the two of order 4 (y = 0) and the four of order 8."""


def is_small_order(point: Point) -> bool:
    """Whether `[8]point` is the identity (dalek's `is_small_order`: one of the 8 torsion
    points)."""
    return point[1] in _SMALL_ORDER_Y


def is_ed25519_point(public_key: bytes) -> bool:
    """Whether 32 bytes decompress (ed25519-dalek's `VerifyingKey::from_bytes`, which the
    precompile fails with `InvalidPublicKey`). Small-order keys decompress: `verify_strict`
    refuses their signatures."""
    return len(public_key) == PUBLIC_KEY_LEN and decompress(public_key) is not None


def verify_strict(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Whether dalek's `verify_strict` accepts `signature` of `message` by `public_key` (the
    module's rules). False for any malformed input."""
    if len(public_key) != PUBLIC_KEY_LEN or len(signature) != SIGNATURE_LEN:
        return False
    if int.from_bytes(signature[32:], "little") >= L:
        return False
    r = decompress(signature[:32])
    a = decompress(public_key)
    if r is None or a is None or is_small_order(r) or is_small_order(a):
        return False
    if compress(r) != signature[:32]:
        return False
    return verify_signature(public_key, message, signature)


__all__ = [
    "IDENTITY",
    "L",
    "P",
    "compress",
    "decompress",
    "is_ed25519_point",
    "is_small_order",
    "verify_strict",
]
