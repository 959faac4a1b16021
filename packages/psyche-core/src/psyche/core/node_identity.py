"""Who a participant is: the key that signs for it and the key its peer-to-peer node uses."""

from __future__ import annotations

from typing import Annotated

from psyche.core.serde import FixedBytes, struct


@struct(frozen=True, eq=False)
class NodeIdentity:
    """Two 32-byte public keys; two identities are the same node when their signers match.

    Equality and hashing ignore `p2p_identity` (as upstream), so a node that restarts with a new
    p2p key is still recognised by its signer.
    """

    signer: Annotated[bytes, FixedBytes(32)] = bytes(32)
    p2p_identity: Annotated[bytes, FixedBytes(32)] = bytes(32)

    @classmethod
    def from_single_key(cls, key: bytes) -> NodeIdentity:
        """Centralized runs have one key per client: it is both signer and p2p identity."""
        return cls(bytes(key), bytes(key))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NodeIdentity):
            return NotImplemented
        return self.signer == other.signer

    def __hash__(self) -> int:
        return hash(self.signer)

    def __str__(self) -> str:
        return self.signer[:4].hex()

    def __repr__(self) -> str:
        return f"NodeIdentity({self.signer[:4].hex()}/{self.p2p_identity[:4].hex()})"
