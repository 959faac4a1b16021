"""Finding a peer's addresses from its 32-byte id (the coordinator only lists ids).

Sources, all feeding one `AddressBook`:
* the bootstrap list given at start-up (`EndpointAddr`s, e.g. from the run's config or CLI);
* `LocalDiscovery`: one file per endpoint in a shared directory, for several processes on one
  host (upstream's `LocalTestDiscovery`);
* blob tickets seen in verified gossip: every training result names its provider's addresses;
* signed address records exchanged with connected peers (`peer_exchange` protocol), so knowing
  one run member is enough to reach the rest. A record is a `SignedMessage` of the endpoint's
  own `EndpointAddr` signed by that endpoint, so a relaying peer cannot forge it.
See the package README for how this covers centralized and Solana runs and NAT.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

from psyche.core.atomic_file import write_atomically
from psyche.core.identity import SecretKey
from psyche.core.signed_message import SignedMessage, SignedMessageError
from psyche.network.identity import fmt_short
from psyche.network.ticket import EndpointAddr, TransportAddr

logger = logging.getLogger(__name__)

LOCAL_DISCOVERY_DIR_NAME = "psyche_local_discovery"


def default_local_discovery_dir() -> Path:
    return Path(tempfile.gettempdir()) / LOCAL_DISCOVERY_DIR_NAME


def sign_address_record(secret_key: SecretKey, addr: EndpointAddr) -> bytes:
    if addr.id != secret_key.public_key:
        raise ValueError("an address record is signed by the endpoint it describes")
    return SignedMessage.sign_and_encode(secret_key, addr, EndpointAddr)


def verify_address_record(raw: bytes) -> EndpointAddr:
    """The record's address; raises `SignedMessageError` unless its own endpoint signed it."""
    signer, addr = SignedMessage.verify_and_decode(raw, EndpointAddr)
    if signer != addr.id:
        raise SignedMessageError("address record signed by another endpoint")
    return addr


def record_signer(raw: bytes) -> bytes | None:
    """The endpoint a record claims signed it, read without verifying anything (postcard
    writes `SignedMessage.from_`, 32 fixed bytes, first): to drop a record of no interest
    before its signature is checked. None for a record too short to name one."""
    return bytes(raw[:32]) if len(raw) >= 32 else None


class AddressBook:
    """The latest known addresses of each endpoint, plus the signed record they came in.

    `on_changed(endpoint_id)` is called whenever an endpoint's addresses change (first learned,
    or different from before), so that a connection that failed for want of an address is
    tried again the moment one is known rather than at the next periodic top-up."""

    def __init__(self, on_changed: Callable[[bytes], None] | None = None) -> None:
        self._addrs: dict[bytes, EndpointAddr] = {}
        self._records: dict[bytes, bytes] = {}
        self._on_changed = on_changed

    def add(self, addr: EndpointAddr) -> None:
        """Merge addresses learned without a signature (bootstrap list, a ticket's provider)."""
        known = self._addrs.get(addr.id)
        if known is None:
            self._set(addr)
            return
        merged = list(dict.fromkeys([*addr.addrs, *known.addrs]))
        self._set(EndpointAddr(addr.id, merged))

    def add_record(self, raw: bytes) -> EndpointAddr | None:
        try:
            addr = verify_address_record(raw)
        except SignedMessageError as e:
            logger.debug("ignoring address record: %s", e)
            return None
        self._records[addr.id] = bytes(raw)
        self._set(addr)
        return addr

    def _set(self, addr: EndpointAddr) -> None:
        known = self._addrs.get(addr.id)
        self._addrs[addr.id] = addr
        changed = known is None or set(known.addrs) != set(addr.addrs)
        if changed and self._on_changed is not None:
            self._on_changed(addr.id)

    def get(self, endpoint_id: bytes) -> EndpointAddr | None:
        return self._addrs.get(endpoint_id)

    def records(self, ids: list[bytes] | None = None) -> list[bytes]:
        if ids is None:
            return list(self._records.values())
        return [self._records[i] for i in ids if i in self._records]

    def __contains__(self, endpoint_id: bytes) -> bool:
        return endpoint_id in self._addrs


class LocalDiscovery:
    """Endpoint files in a directory shared by processes on one host (upstream's test discovery).

    Each file is named by the hex endpoint id and holds JSON `{"record": <hex signed record>}`;
    every IP is rewritten to 127.0.0.1 as upstream does.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or default_local_discovery_dir()

    def publish(self, secret_key: SecretKey, addr: EndpointAddr) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        local = EndpointAddr(addr.id, [_to_loopback(a) for a in addr.addrs])
        record = sign_address_record(secret_key, local)
        write_atomically(self.directory / addr.id.hex(), json.dumps({"record": record.hex()}))

    def resolve(self, endpoint_id: bytes) -> bytes | None:
        """The signed record for `endpoint_id`, or None (logged) when there is no usable file."""
        path = self.directory / endpoint_id.hex()
        try:
            return bytes.fromhex(json.loads(path.read_text())["record"])
        except FileNotFoundError:
            logger.error("no local discovery file for %s", fmt_short(endpoint_id))
        except (ValueError, KeyError, TypeError, OSError) as e:
            logger.error("bad local discovery file %s: %s", path, e)
        return None


def _to_loopback(addr: TransportAddr) -> TransportAddr:
    match addr:
        case TransportAddr.Libp2p(text):
            parts = text.split("/")
            if len(parts) > 2 and parts[1] == "ip4":
                parts[2] = "127.0.0.1"
            loopback: TransportAddr = TransportAddr.Libp2p("/".join(parts))
            return loopback
        case TransportAddr.BlobTcp(text):
            _, _, port = text.rpartition(":")
            loopback = TransportAddr.BlobTcp(f"127.0.0.1:{port}")
            return loopback
    return addr
