"""A Solana public key inside a wire declaration.

On the wire a `Pubkey` is 32 raw bytes, exactly like `[u8; 32]`; the extra marker only tells the
IDL writer to call it `publicKey`. Values are `bytes`; builders accept solders' `Pubkey` too.
"""

from __future__ import annotations

from typing import Annotated, Any

from psyche.core.serde.schema import FixedBytes


class PubkeyMarker:
    """Marks a 32-byte field as a Solana public key (for the IDL only)."""

    def __repr__(self) -> str:
        return "PubkeyMarker()"


PUBKEY_MARKER = PubkeyMarker()

Pubkey = Annotated[bytes, FixedBytes(32), PUBKEY_MARKER]

SYSTEM_PROGRAM_ID = bytes(32)  # "11111111111111111111111111111111"


def pubkey_bytes(key: Any) -> bytes:
    """32 raw bytes from a solders `Pubkey`, raw bytes or a base58 string."""
    if isinstance(key, bytes | bytearray):
        raw = bytes(key)
    elif isinstance(key, str):
        from solders.pubkey import Pubkey as SoldersPubkey

        raw = bytes(SoldersPubkey.from_string(key))
    else:
        raw = bytes(key)
    if len(raw) != 32:
        raise ValueError(f"a public key is 32 bytes, got {len(raw)}")
    return raw


def to_solders(key: Any) -> Any:
    """A solders `Pubkey` from raw bytes, a base58 string or a solders `Pubkey`."""
    from solders.pubkey import Pubkey as SoldersPubkey

    if isinstance(key, SoldersPubkey):
        return key
    return SoldersPubkey.from_bytes(pubkey_bytes(key))


def b58(key: Any) -> str:
    """The base58 spelling of a key."""
    return str(to_solders(key))
