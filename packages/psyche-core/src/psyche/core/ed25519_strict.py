"""Ed25519 verification as ed25519-dalek's `VerifyingKey::verify_strict` (what upstream runs:
iroh's `PublicKey::verify` and agave's `Ed25519SigVerify` precompile both call it), behind
`psyche.core.identity.verify_signature`.

Plain RFC 8032 verification (OpenSSL's, `verify_rfc8032`) accepts signatures `verify_strict`
refuses: under a key of small order (the identity's encoding, say) the "signature"
`R = identity, S = 0` verifies for every message, and one with a small-order `R` passes the
cofactorless equation for some messages. dalek's rules, in its order:

1. `S` is canonical (`S < L`);
2. `R` decompresses to a curve point;
3. neither `R` nor the key `A` is of small order (`[8]P` is the identity);
4. the cofactorless equation: `[S]B - [k]A`, compressed, equals the signature's `R` bytes
   (`k = SHA-512(R || A || M)` over the bytes as given).

OpenSSL checks 1 and 4 (it refuses `S >= L` and compares the canonical encoding of the point it
computes with `R`'s bytes, so an `R` that does not decompress, or is encoded non-canonically,
fails: 2 is implied). What remains is 3, and it depends only on the 32 bytes: dalek's
`decompress` reads `y` from the low 255 bits reduced mod p and the sign of `x` from the top
bit (ignored when `x = 0`), so the encodings that decompress to a small-order point are exactly
`SMALL_ORDER_ENCODINGS`, computed once at import from the curve (`_small_order_encodings`).
`verify_strict` is a set lookup of `A`'s and `R`'s bytes, then OpenSSL.

Two corners differ and cannot be reached, each needing the discrete log of a point with
`y < 19` (no honest or hostile signer has one): a key encoded non-canonically (`y >= p`) that is
not of small order, if OpenSSL refuses to decode it where dalek decodes it; and, against
ed25519-dalek 1.x (agave's pin), which compares `R` as points rather than bytes, a
non-canonical `R` encoding of such a point (2.x, iroh's, compares bytes as OpenSSL does).

The curve arithmetic here (`decompress`, `compress`, `is_small_order`) is the plain affine
kind, used to derive the set and to check a key decompresses (the Solana precompile's
`InvalidPublicKey`); nothing on a hot path runs it.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

PUBLIC_KEY_LEN = 32
SIGNATURE_LEN = 64

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


def _encoded_y(encoded: bytes) -> int:
    """The y an encoding names: its low 255 bits, reduced mod p."""
    return (int.from_bytes(encoded, "little") & ((1 << 255) - 1)) % P


def decompress(encoded: bytes) -> Point | None:
    """curve25519-dalek's `CompressedEdwardsY::decompress`: y is the low 255 bits, reduced mod p
    (a non-canonical y is accepted), x the root of x² = (y² - 1) / (d·y² + 1) whose parity is the
    sign bit (for x = 0 the sign bit is ignored). None when x² has no root."""
    y = _encoded_y(encoded)
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


def _add(a: Point, b: Point) -> Point:
    """Twisted Edwards addition (a = -1); complete, so it also doubles."""
    (x1, y1), (x2, y2) = a, b
    t = _D * x1 * x2 * y1 * y2 % P
    x = (x1 * y2 + y1 * x2) * pow(1 + t, P - 2, P) % P
    y = (y1 * y2 + x1 * x2) * pow(1 - t, P - 2, P) % P
    return (x, y)


def _order_8_ys() -> list[int]:
    """The y of the points of order 8: their double has y = 0 (order 4), so x² = -y², which on
    the curve (-x² + y² = 1 + d·x²·y²) gives d·y⁴ + 2·y² - 1 = 0: y² = (-1 ± √(1 + d)) / d,
    the y the roots of whichever y² is a square."""
    root = _sqrt_ratio((1 + _D) % P, 1)
    assert root is not None
    ys = []
    for r in (root, P - root):
        y = _sqrt_ratio((r - 1) * pow(_D, P - 2, P) % P, 1)
        if y is not None:
            ys += [y, P - y]
    return ys


def _small_order_encodings() -> frozenset[bytes]:
    """Every 32-byte string dalek's `decompress` maps to a point of order dividing 8.

    The 8 such points have y in {1 (the identity), -1 (order 2), 0 (order 4, two x), the four
    roots of order 8} (`_order_8_ys`), and each is checked here to be a curve point that 8
    multiplies to the identity. `decompress` depends on the bytes only through y mod p and the
    sign bit, so an encoding maps to one of these exactly when its low 255 bits are such a y or
    y + p (below 2^255 only for y < 19: y in {0, 1}), with either sign bit (with x ≠ 0 the two
    signs give x and -x, both torsion; with x = 0 it is ignored): 5 y, 14 encodings."""
    ys = [1, P - 1, 0, *_order_8_ys()]
    out = set()
    for y in ys:
        for low in (y, y + P):
            if low >= 1 << 255:
                continue
            for sign in (0, 1):
                encoded = (low | (sign << 255)).to_bytes(32, "little")
                point = decompress(encoded)
                assert point is not None
                assert point[1] == y
                eight = point
                for _ in range(3):
                    eight = _add(eight, eight)
                assert eight == IDENTITY, encoded.hex()
                out.add(encoded)
    assert len(out) == 14
    return frozenset(out)


SMALL_ORDER_ENCODINGS = _small_order_encodings()
"""The 14 encodings that decompress to a point of small order: the 8 canonical ones, the
identity's and the order-2 point's with the sign bit set (x = 0), and y + p for y in {0, 1}
with either sign bit."""
_SMALL_ORDER_YS = frozenset(_encoded_y(e) for e in SMALL_ORDER_ENCODINGS)


def is_small_order(point: Point) -> bool:
    """Whether `[8]point` is the identity (dalek's `is_small_order`: one of the 8 torsion
    points; both x of each such y are torsion)."""
    return point[1] in _SMALL_ORDER_YS


def is_ed25519_point(public_key: bytes) -> bool:
    """Whether 32 bytes decompress (ed25519-dalek's `VerifyingKey::from_bytes`). Small-order
    keys decompress: `verify_strict` refuses their signatures."""
    return len(public_key) == PUBLIC_KEY_LEN and decompress(public_key) is not None


def verify_rfc8032(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """OpenSSL's cofactorless RFC 8032 check alone (dalek's rules 1, 2 and 4, not 3). False for
    any malformed input. Only `verify_strict` should call it; it is public for tests and the
    benchmark, which show what it accepts and what it costs."""
    try:
        if len(public_key) != PUBLIC_KEY_LEN or len(signature) != SIGNATURE_LEN:
            return False
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(
            bytes(signature), bytes(message)
        )
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def verify_strict(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Whether dalek's `verify_strict` accepts `signature` of `message` by `public_key`: neither
    the key nor `R` (the signature's first 32 bytes) decompresses to a small-order point, and
    OpenSSL's check passes. False for any malformed input."""
    try:
        if len(public_key) != PUBLIC_KEY_LEN or len(signature) != SIGNATURE_LEN:
            return False
        if (
            bytes(public_key) in SMALL_ORDER_ENCODINGS
            or bytes(signature[:32]) in SMALL_ORDER_ENCODINGS
        ):
            return False
    except TypeError:
        return False
    return verify_rfc8032(public_key, message, signature)


__all__ = [
    "IDENTITY",
    "SMALL_ORDER_ENCODINGS",
    "L",
    "P",
    "compress",
    "decompress",
    "is_ed25519_point",
    "is_small_order",
    "verify_rfc8032",
    "verify_strict",
]
