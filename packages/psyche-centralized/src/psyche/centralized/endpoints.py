"""How the server tells clients of a run how to reach each other (a port extension).

Each client announces its self-signed address record (`psyche.network.discovery`); the server
keeps the newest valid one per connected client and sends every extension-aware client that has
joined the run the records of the run's other joined clients. A record must be signed by the
connection's own key (the client's p2p identity in a centralized run), so no client can announce
an address for another. A refused record is logged through a `DropLog` (any logged-in key can
send them).
"""

from __future__ import annotations

import logging

from psyche.centralized.protocol import MAX_ENDPOINT_RECORD_LEN
from psyche.core.drop_log import DropLog

log = logging.getLogger(__name__)


def record_signer(record: bytes) -> bytes | None:
    """The endpoint a valid self-signed address record describes, else None."""
    from psyche.core.signed_message import SignedMessageError
    from psyche.network import verify_address_record

    try:
        return bytes(verify_address_record(record).id)
    except (SignedMessageError, ValueError) as e:
        log.debug("invalid endpoint record: %s", e)
        return None


class EndpointRelay:
    def __init__(self) -> None:
        self._records: dict[bytes, bytes] = {}
        self._aware: set[bytes] = set()
        self._joined: dict[bytes, None] = {}
        self.refused = DropLog(log, "endpoint records refused")

    def mark_aware(self, client: bytes) -> None:
        self._aware.add(client)

    def join(self, client: bytes) -> None:
        self._joined[client] = None

    def is_joined(self, client: bytes) -> bool:
        return client in self._joined

    def announce(self, client: bytes, record: bytes) -> bool:
        """Store `client`'s record; False (and logged) when it is refused or unchanged."""
        if len(record) > MAX_ENDPOINT_RECORD_LEN:
            self.refused.note(
                "too long", f"endpoint record of {len(record)} bytes from {client.hex()} refused"
            )
            return False
        if record_signer(record) != client:
            self.refused.note(
                "not its own", f"endpoint record from {client.hex()} is not signed by it; refused"
            )
            return False
        if self._records.get(client) == record:
            return False
        self._records[client] = bytes(record)
        return client in self._joined

    def forget(self, client: bytes) -> bool:
        """Drop a disconnected client; True when others must be told."""
        self._aware.discard(client)
        had_record = self._records.pop(client, None) is not None
        was_joined = client in self._joined
        self._joined.pop(client, None)
        return had_record and was_joined

    def records_for(self, client: bytes) -> list[bytes]:
        return [r for c, r in self._records.items() if c != client and c in self._joined]

    def aware_joined(self) -> list[bytes]:
        return [c for c in self._joined if c in self._aware]


__all__ = ["EndpointRelay", "record_signer"]
