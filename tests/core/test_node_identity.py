from __future__ import annotations

import os

import pytest

from psyche.core.identity import SecretKey, verify_signature
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import from_bytes, from_obj, to_bytes, to_obj

TEST_PUBLIC_KEYS = {
    1: "4cb5abf6ad79fbf5abbccafcc269d85cd2651ed4b885b5869f241aedf0a5ba29",
    2: "7422b9887598068e32c4448a949adb290d0f4e35b9e01b0ee5f1a1e600fe2674",
    3: "f381626e41e7027ea431bfe3009e94bdd25a746beec468948d6c3c7c5dc9a54b",
}


def test_equality_and_hash_use_signer_only() -> None:
    a = NodeIdentity(bytes([1] * 32), bytes([2] * 32))
    b = NodeIdentity(bytes([1] * 32), bytes([3] * 32))
    c = NodeIdentity(bytes([4] * 32), bytes([2] * 32))
    assert a == b
    assert hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2


def test_default_and_single_key() -> None:
    assert NodeIdentity() == NodeIdentity(bytes(32), bytes(32))
    key = bytes(range(32))
    ident = NodeIdentity.from_single_key(key)
    assert ident.signer == ident.p2p_identity == key


def test_display_and_debug() -> None:
    ident = NodeIdentity(
        bytes.fromhex("deadbeef") + bytes(28), bytes.fromhex("01020304") + bytes(28)
    )
    assert str(ident) == "deadbeef"
    assert repr(ident) == "NodeIdentity(deadbeef/01020304)"


def test_wire_forms() -> None:
    ident = NodeIdentity(bytes([1] * 32), bytes([2] * 32))
    encoded = to_bytes(ident)
    assert encoded == bytes([1] * 32) + bytes([2] * 32)
    decoded = from_bytes(encoded, NodeIdentity)
    assert decoded.signer == ident.signer
    assert decoded.p2p_identity == ident.p2p_identity
    obj = to_obj(ident)
    assert obj == {"signer": [1] * 32, "p2p_identity": [2] * 32}
    assert from_obj(obj, NodeIdentity).p2p_identity == ident.p2p_identity


@pytest.mark.parametrize("n", [1, 2, 3])
def test_local_testnet_keys(n: int) -> None:
    key = SecretKey.from_hex(format(n, "064x"))
    assert key.public_key.hex() == TEST_PUBLIC_KEYS[n]
    assert key.to_bytes() == n.to_bytes(32, "big")


def test_sign_and_verify() -> None:
    key = SecretKey.generate()
    signature = key.sign(b"challenge")
    assert len(signature) == 64
    assert verify_signature(key.public_key, b"challenge", signature)
    assert not verify_signature(key.public_key, b"other", signature)
    assert not verify_signature(SecretKey.generate().public_key, b"challenge", signature)
    bad = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify_signature(key.public_key, b"challenge", bad)


@pytest.mark.parametrize(
    ("public_key", "signature"),
    [
        (b"short", bytes(64)),
        (bytes(32), bytes(63)),
        (bytes(32), bytes(64)),
        (b"\xff" * 32, b"\xff" * 64),
        (None, bytes(64)),
        ("not bytes", bytes(64)),
    ],
)
def test_verify_never_raises(public_key: object, signature: bytes) -> None:
    assert verify_signature(public_key, b"message", signature) is False  # type: ignore[arg-type]


def test_key_file_round_trip(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "key")
    key = SecretKey.generate()
    key.write_file(path)
    with open(path, "rb") as f:
        assert f.read() == key.to_bytes()
    assert os.stat(path).st_mode & 0o077 == 0
    assert SecretKey.read_file(path).public_key == key.public_key
    assert list(os.listdir(tmp_path)) == ["key"]


def test_bad_key_inputs(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "key")
    with open(path, "wb") as f:
        f.write(bytes(33))
    with pytest.raises(ValueError, match="exactly 32 raw bytes, found 33"):
        SecretKey.read_file(path)
    with pytest.raises(ValueError, match="32 bytes"):
        SecretKey.from_bytes(bytes(31))
    with pytest.raises(ValueError, match="hexadecimal"):
        SecretKey.from_hex("zz")
