"""A trainer's signed claim about its result: the hash of the payload and the signature over it.

Witnesses put `data_hash` into their broadcast bloom; `Coordinator.select_consensus_commitment_by_
witnesses` picks among competing commitments by those blooms.
"""

from __future__ import annotations

from typing import ClassVar

from psyche.core.serde import SerdeProxy

COMMITMENT_LENGTH = 96


class Commitment(SerdeProxy):
    """`{data_hash: [u8; 32], signature: [u8; 64]}`, serialized as one 96-byte byte string
    (postcard: varint 96, then the bytes)."""

    serde_proxy_type: ClassVar[type] = bytes
    __slots__ = ("data_hash", "signature")

    data_hash: bytes
    signature: bytes

    def __init__(self, data_hash: bytes, signature: bytes) -> None:
        if len(data_hash) != 32 or len(signature) != 64:
            raise ValueError("Invalid length for Commitment")
        object.__setattr__(self, "data_hash", bytes(data_hash))
        object.__setattr__(self, "signature", bytes(signature))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Commitment is immutable")

    def to_serde_proxy(self) -> bytes:
        return self.data_hash + self.signature

    @classmethod
    def from_serde_proxy(cls, proxy: bytes) -> Commitment:
        if len(proxy) != COMMITMENT_LENGTH:
            raise ValueError("Invalid length for Commitment")
        return cls(proxy[:32], proxy[32:])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Commitment):
            return NotImplemented
        return (self.data_hash, self.signature) == (other.data_hash, other.signature)

    def __hash__(self) -> int:
        return hash((self.data_hash, self.signature))

    def __reduce__(self) -> tuple[type[Commitment], tuple[bytes, bytes]]:
        return (type(self), (self.data_hash, self.signature))

    def __repr__(self) -> str:
        return f"Commitment(data_hash={self.data_hash.hex()})"
