"""Peer exchange: ask a connected run member for the signed address records it knows.

`/psyche/peer-exchange/0`: the requester writes `postcard(list of 32-byte ids)` (empty: all)
and half-closes; the responder answers `postcard(list of signed records)`. Records are
`SignedMessage<EndpointAddr>` signed by the endpoint they describe, so the responder cannot
forge them; the requester verifies each one before using it.
"""

from __future__ import annotations

from psyche.core.serde import FixedBytes, from_bytes, to_bytes

PEER_EXCHANGE_PROTOCOL = "/psyche/peer-exchange/0"
MAX_REQUEST_BYTES = 64 * 1024
MAX_RESPONSE_BYTES = 512 * 1024
MAX_RECORDS = 1024

_Ids = list[FixedBytes[32]]


def encode_request(ids: list[bytes]) -> bytes:
    return to_bytes(ids[:MAX_RECORDS], _Ids)


def decode_request(data: bytes) -> list[bytes]:
    return from_bytes(data, _Ids)


def encode_response(records: list[bytes]) -> bytes:
    out: list[bytes] = []
    size = 0
    for record in records[:MAX_RECORDS]:
        size += len(record) + 4
        if size > MAX_RESPONSE_BYTES - 16:
            break
        out.append(record)
    return to_bytes(out, list[bytes])


def decode_response(data: bytes) -> list[bytes]:
    return from_bytes(data, list[bytes])
