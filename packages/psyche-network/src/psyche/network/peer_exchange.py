"""Peer exchange: ask a connected run member for the signed address records it knows.

`/psyche/peer-exchange/0`: the requester writes `postcard(list of 32-byte ids)` (empty: all)
and half-closes; the responder answers `postcard(list of signed records)`. Records are
`SignedMessage<EndpointAddr>` signed by the endpoint they describe, so the responder cannot
forge them; the requester verifies each one before using it.
"""

from __future__ import annotations

import logging
from typing import Annotated

import trio
from libp2p.abc import IHost, INetStream

from psyche.core.serde import FixedBytes, from_bytes, to_bytes
from psyche.network import p2p_host
from psyche.network.discovery import AddressBook
from psyche.network.identity import fmt_short
from psyche.network.peer_manager import MODEL_REQUEST_TIMEOUT_SECS

logger = logging.getLogger(__name__)

PEER_EXCHANGE_PROTOCOL = "/psyche/peer-exchange/0"
MAX_REQUEST_BYTES = 64 * 1024
MAX_RESPONSE_BYTES = 512 * 1024
MAX_RECORDS = 1024

_Ids = list[Annotated[bytes, FixedBytes(32)]]


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


async def exchange_records(
    host: IHost, peer: bytes, wanted: list[bytes], address_book: AddressBook, timeout: float
) -> None:
    """Ask `peer` for the records of `wanted` (empty: all it knows) and keep the valid ones;
    failures are only logged (another peer may know)."""
    try:
        with trio.fail_after(timeout):
            raw = await p2p_host.request(
                host, peer, PEER_EXCHANGE_PROTOCOL, encode_request(wanted), MAX_RESPONSE_BYTES
            )
        for record in decode_response(raw):
            address_book.add_record(record)
    except Exception as e:
        logger.debug("peer exchange with %s failed: %s", fmt_short(peer), e)


async def serve(stream: INetStream, allowed: p2p_host.AllowFn, address_book: AddressBook) -> None:
    """Answer one inbound request from a run member with the records we hold."""

    async def handle() -> None:
        with trio.fail_after(MODEL_REQUEST_TIMEOUT_SECS):
            wanted = decode_request(await p2p_host.read_to_end(stream, MAX_REQUEST_BYTES))
            records = address_book.records(wanted or None)
            await stream.write(encode_response(records))
            await stream.close()

    await p2p_host.serve_member(stream, allowed, "peer-exchange request", handle)
