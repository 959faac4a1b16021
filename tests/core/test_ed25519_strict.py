"""`verify_signature` is ed25519-dalek's `verify_strict` (what upstream's iroh `PublicKey::verify`
runs): on real vectors, every encoding that decompresses to a small-order point is refused as
the key and as `R` where OpenSSL's plain RFC 8032 check (`verify_rfc8032`) accepts forgeries
under them; CCTV vector 5 (small-order R), S + L refused; honest signatures accepted by both,
and on random honest keys and messages the two agree (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.ed25519_strict import (
    IDENTITY,
    SMALL_ORDER_ENCODINGS,
    L,
    P,
    compress,
    decompress,
    is_small_order,
    verify_rfc8032,
)
from psyche.core.identity import SecretKey, verify_signature

KEY = SecretKey.from_bytes(bytes(range(32)))
MESSAGE = b"psyche-verification-draw" + bytes(32)
MESSAGES = [b"draw %d" % i for i in range(64)]
IDENTITY_R_ZERO_S = compress(IDENTITY) + bytes(32)
"""A "signature" (R = identity, S = 0): it satisfies [S]B = R + [k]A whenever [k]A is the
identity: for every message under the identity key, for 1 in ord(A) messages under a key of
small order."""
# C2SP CCTV ed25519 vector 5 (as agave's `test_ed25519_malleability`): R = 0, of order 4
CCTV_KEY = bytes.fromhex("10eb7c3acfb2bed3e0d6ab89bf5a3d6afddd1176ce4812e38d9fd485058fdb1f")
CCTV_SIGNATURE = bytes.fromhex(
    "0000000000000000000000000000000000000000000000000000000000000000"
    "9472a69cd9a701a50d130ed52189e2455b23767db52cacb8716fb896ffeeac09"
)
CCTV_MESSAGE = b"ed25519vectors 3"


def _scalar_mul(k: int, point: tuple[int, int]) -> tuple[int, int]:
    """[k]point by double-and-add with the complete twisted Edwards addition, written out here
    to check the module's set independently of it."""
    d = -121665 * pow(121666, P - 2, P) % P

    def add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        (x1, y1), (x2, y2) = a, b
        t = d * x1 * x2 * y1 * y2 % P
        return (
            (x1 * y2 + y1 * x2) * pow(1 + t, P - 2, P) % P,
            (y1 * y2 + x1 * x2) * pow(1 - t, P - 2, P) % P,
        )

    out = IDENTITY
    while k:
        if k & 1:
            out = add(out, point)
        point = add(point, point)
        k >>= 1
    return out


def test_the_small_order_set_is_every_encoding_of_the_8_torsion_points() -> None:
    """The set's points are 8 distinct points that 8 multiplies to the identity: the whole
    torsion subgroup (Z/8). dalek's decompress reads y mod p from the low 255 bits and the
    sign bit, so every encoding of them is low bits y or y + p (below 2^255) with either sign
    bit; enumerated here, those that decompress to a torsion point are exactly the set (14: the
    8 canonical, the sign-bit variants of the two with x = 0, y + p for y in {0, 1} with either
    sign bit)."""
    points = set()
    for encoded in SMALL_ORDER_ENCODINGS:
        point = decompress(encoded)
        assert point is not None
        assert is_small_order(point)
        assert _scalar_mul(8, point) == IDENTITY, encoded.hex()
        points.add(point)
    assert len(points) == 8
    enumerated = set()
    for _, y in points:
        for low in (y, y + P):
            for sign in (0, 1 << 255):
                encoded = (low | sign).to_bytes(32, "little")
                if low < 1 << 255 and decompress(encoded) in points:
                    enumerated.add(encoded)
    assert enumerated == SMALL_ORDER_ENCODINGS
    assert len(SMALL_ORDER_ENCODINGS) == 14
    assert {compress(p) for p in points} <= SMALL_ORDER_ENCODINGS
    for y in (0, 1):
        for sign in (0, 1 << 255):
            assert (y + P | sign).to_bytes(32, "little") in SMALL_ORDER_ENCODINGS
    assert KEY.public_key not in SMALL_ORDER_ENCODINGS


def _near_miss(encoded: bytes, bit: int) -> bytes:
    return (int.from_bytes(encoded, "little") ^ (1 << bit)).to_bytes(32, "little")


@settings(max_examples=150, deadline=None)
@given(
    encoded=st.one_of(
        st.binary(min_size=32, max_size=32),
        st.sampled_from(sorted(SMALL_ORDER_ENCODINGS)),
        st.builds(
            _near_miss,
            st.sampled_from(sorted(SMALL_ORDER_ENCODINGS)),
            st.integers(min_value=0, max_value=255),
        ),
    )
)
def test_an_encoding_is_in_the_set_iff_it_decompresses_to_a_torsion_point(encoded: bytes) -> None:
    """Random bytes, the set's members and one-bit near misses of them (the sign bit of an
    x = 0 point, y ± 2^k, ...)."""
    point = decompress(encoded)
    torsion = point is not None and _scalar_mul(8, point) == IDENTITY
    assert (encoded in SMALL_ORDER_ENCODINGS) == torsion


def test_every_small_order_key_and_r_is_refused_where_openssl_accepts_forgeries() -> None:
    """Under each of the 14 small-order key encodings (sign-bit and y + p variants included),
    (R = identity, S = 0) passes OpenSSL's check for some of 64 messages (all of them under the
    identity's encodings, y = 1 and y = 1 + p): a real forgery under every one, and
    `verify_signature` refuses all. As R under an honest key (S = 0 or the honest signature's S)
    each is refused; CCTV vector 5 is a small-order R OpenSSL accepts. Fails on the old
    `verify_signature` (OpenSSL alone)."""
    for key in sorted(SMALL_ORDER_ENCODINGS):
        assert any(verify_rfc8032(key, m, IDENTITY_R_ZERO_S) for m in MESSAGES), key.hex()
        assert not any(verify_signature(key, m, IDENTITY_R_ZERO_S) for m in MESSAGES), key.hex()
        assert not verify_signature(KEY.public_key, MESSAGE, key + bytes(32))
        assert not verify_signature(KEY.public_key, MESSAGE, key + KEY.sign(MESSAGE)[32:])
    for sign in (0, 1 << 255):
        identity_plus_p = (1 + P | sign).to_bytes(32, "little")
        assert all(verify_rfc8032(identity_plus_p, m, IDENTITY_R_ZERO_S) for m in MESSAGES)
        assert not any(verify_signature(identity_plus_p, m, IDENTITY_R_ZERO_S) for m in MESSAGES)

    assert verify_rfc8032(CCTV_KEY, CCTV_MESSAGE, CCTV_SIGNATURE)
    assert CCTV_KEY not in SMALL_ORDER_ENCODINGS
    assert CCTV_SIGNATURE[:32] in SMALL_ORDER_ENCODINGS
    assert not verify_signature(CCTV_KEY, CCTV_MESSAGE, CCTV_SIGNATURE)


def test_s_plus_l_is_refused_and_honest_signatures_are_accepted() -> None:
    signature = KEY.sign(MESSAGE)
    s = int.from_bytes(signature[32:], "little")
    high_s = signature[:32] + (s + L).to_bytes(32, "little")
    assert not verify_rfc8032(KEY.public_key, MESSAGE, high_s)
    assert not verify_signature(KEY.public_key, MESSAGE, high_s)
    for i in range(8):
        key = SecretKey.from_bytes(bytes([i + 1]) * 32)
        signed = key.sign(MESSAGE)
        assert verify_signature(key.public_key, MESSAGE, signed)
        assert verify_rfc8032(key.public_key, MESSAGE, signed)
        assert not verify_signature(key.public_key, MESSAGE + b"x", signed)


@settings(max_examples=60, deadline=None)
@given(
    secret=st.binary(min_size=32, max_size=32),
    message=st.binary(max_size=200),
    flip=st.integers(min_value=-1, max_value=64 * 8 - 1),
)
def test_strict_and_openssl_agree_on_honest_keys(secret: bytes, message: bytes, flip: int) -> None:
    """For an honest key (never small order: it is [a]B with B of prime order), a valid
    signature passes both and a signature with one bit flipped (flip >= 0) is judged alike."""
    key = SecretKey.from_bytes(secret)
    signature = bytearray(key.sign(message))
    if flip >= 0:
        signature[flip // 8] ^= 1 << (flip % 8)
    ours = verify_signature(key.public_key, message, bytes(signature))
    assert ours == verify_rfc8032(key.public_key, message, bytes(signature))
    assert ours == (flip < 0)
