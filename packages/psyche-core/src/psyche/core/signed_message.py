"""Upstream's `SignedMessage<T>`: postcard bytes of a message, its sender and an ed25519 signature.

The signature covers the postcard bytes of the message only (no domain prefix), as upstream.
Verification happens before the inner message is decoded, so a forged or garbled message costs
one signature check and nothing more.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar, overload

from psyche.core.identity import PublicKey, SecretKey, verify_signature
from psyche.core.serde import FixedBytes, PostcardError, from_bytes, struct, to_bytes

T = TypeVar("T")


class SignedMessageError(ValueError):
    """A signed message that is malformed, badly signed or does not decode as its type."""


@struct(frozen=True)
class SignedMessage:
    from_: Annotated[bytes, FixedBytes(32)]
    data: bytes
    signature: Annotated[bytes, FixedBytes(64)]

    @staticmethod
    def sign_and_encode(secret_key: SecretKey, message: Any, tp: Any = None) -> bytes:
        data = to_bytes(message, tp)
        signed = SignedMessage(
            from_=secret_key.public_key, data=data, signature=secret_key.sign(data)
        )
        return to_bytes(signed)

    # A class gives its instances' type; any other type form (Annotated, unions, ...) gives Any.
    @overload
    @staticmethod
    def verify_and_decode(
        raw: bytes | bytearray | memoryview, tp: type[T]
    ) -> tuple[PublicKey, T]: ...
    @overload
    @staticmethod
    def verify_and_decode(
        raw: bytes | bytearray | memoryview, tp: Any
    ) -> tuple[PublicKey, Any]: ...
    @staticmethod
    def verify_and_decode(raw: bytes | bytearray | memoryview, tp: Any) -> tuple[PublicKey, Any]:
        try:
            signed = from_bytes(raw, SignedMessage)
        except PostcardError as e:
            raise SignedMessageError(f"malformed signed message: {e}") from e
        if not verify_signature(signed.from_, signed.data, signed.signature):
            raise SignedMessageError("signature does not verify")
        try:
            return signed.from_, from_bytes(signed.data, tp)
        except PostcardError as e:
            raise SignedMessageError(f"signed payload does not decode: {e}") from e


def raw_p2p_verify(signer: bytes, data: bytes, signature: bytes) -> bool:
    """Upstream `raw_p2p_verify`: false for an invalid key or signature, never an error."""
    return verify_signature(signer, data, signature)
