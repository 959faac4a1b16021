"""The node's ed25519 identity: one 32-byte secret is both its Psyche key and its libp2p peer id.

Upstream's `--identity-secret-key-path` file holds exactly 32 raw bytes (`openssl rand 32`); the
same bytes seed the ed25519 key whose 32-byte public key is the `NodeIdentity.p2p_identity` the
coordinator knows and, wrapped in libp2p's identity multihash, the libp2p `PeerID`.
The key (and signature checks) are `psyche.core.identity`'s; this module only converts between
it and libp2p's key pairs and peer ids, and formats ids for logs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psyche.core.identity import PUBLIC_KEY_LEN, PublicKey

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair
    from libp2p.peer.id import ID

    from psyche.core.identity import SecretKey

__all__ = [
    "IdentityError",
    "fmt_short",
    "libp2p_key_pair",
    "peer_id_bytes",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
]

# A libp2p peer id for an ed25519 key is the identity multihash (0x00, length 0x24) of the
# protobuf `PublicKey{Type: Ed25519 (1), Data: 32 bytes}` (0x08 0x01 0x12 0x20 ‖ key).
_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])


class IdentityError(ValueError):
    """A key encoding that cannot be a Psyche identity."""


def fmt_short(key_or_hash: bytes) -> str:
    """First 5 bytes in hex, as upstream's `fmt_short` for ids and hashes."""
    return bytes(key_or_hash[:5]).hex()


# ----------------------------------------------------------------------------------------------
# libp2p conversions (libp2p is imported lazily: it costs about a second)


def libp2p_key_pair(secret: SecretKey) -> KeyPair:
    from libp2p.crypto.ed25519 import create_new_key_pair

    key_pair = create_new_key_pair(secret.to_bytes())
    if key_pair.public_key.to_bytes() != secret.public_key:
        raise IdentityError("libp2p derived a different public key from the same seed")
    return key_pair


def peer_id_bytes(public_key: PublicKey) -> bytes:
    if len(public_key) != PUBLIC_KEY_LEN:
        raise IdentityError(f"a public key is {PUBLIC_KEY_LEN} bytes, got {len(public_key)}")
    return _PEER_ID_PREFIX + bytes(public_key)


def peer_id_from_public_key(public_key: PublicKey) -> ID:
    from libp2p.peer.id import ID

    return ID(peer_id_bytes(public_key))


def public_key_from_peer_id(peer_id: ID | bytes) -> PublicKey:
    """The 32-byte key inside an ed25519 peer id; other key types are not Psyche identities."""
    raw = peer_id if isinstance(peer_id, bytes) else peer_id.to_bytes()
    if len(raw) != len(_PEER_ID_PREFIX) + PUBLIC_KEY_LEN or not raw.startswith(_PEER_ID_PREFIX):
        raise IdentityError("peer id is not an inlined ed25519 key")
    return raw[len(_PEER_ID_PREFIX) :]
