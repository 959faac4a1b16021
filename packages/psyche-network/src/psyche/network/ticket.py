"""Addresses and blob tickets: what a peer needs to fetch a blob from its provider.

Upstream's `BlobTicket` is iroh's `(EndpointAddr, BlobFormat, Hash)`. Here the address lists the
provider's libp2p multiaddrs and its blob side-channel sockets, and the ticket also carries the
blob's size so a downloader can refuse an oversized transfer before reading a byte.
"""

from __future__ import annotations

from typing import Annotated

import blake3

from psyche.core.serde import U64, DataEnum, FixedBytes, RustEnum, struct, variant
from psyche.network.identity import fmt_short

HASH_LENGTH = 32
# Below this, BLAKE3's thread pool costs more CPU than it saves wall time: a 98.6 KB DisTrO
# payload took 0.11 ms of CPU with it against 0.019 ms on one thread (loaded 2-core machine,
# 2026-11-28; 8.5 % of a 16-node swarm process's samples). The digest is the same either way.
THREADED_HASH_MIN_BYTES = 1 << 20


def blob_hash(data: bytes | bytearray | memoryview) -> bytes:
    """Content address of a blob: BLAKE3 of its bytes, as iroh-blobs (the same digest whatever
    the thread count; threads only for blobs of a MiB or more)."""
    threads = blake3.blake3.AUTO if len(data) >= THREADED_HASH_MIN_BYTES else 1
    return blake3.blake3(data, max_threads=threads).digest()


class TransportAddr(DataEnum):
    """One way to reach an endpoint (upstream: relay URL or direct socket address)."""

    Libp2p = variant(str)
    """A libp2p multiaddr without the `/p2p/<id>` suffix, e.g. `/ip4/1.2.3.4/tcp/4001`."""
    BlobTcp = variant(str)
    """`host:port` of the endpoint's authenticated blob side channel."""


@struct(frozen=True)
class EndpointAddr:
    id: Annotated[bytes, FixedBytes(32)]
    addrs: list[TransportAddr]

    def libp2p_addrs(self) -> list[str]:
        return [a.value for a in self.addrs if isinstance(a, TransportAddr.Libp2p)]

    def blob_addrs(self) -> list[str]:
        return [a.value for a in self.addrs if isinstance(a, TransportAddr.BlobTcp)]

    def __str__(self) -> str:
        return f"{fmt_short(self.id)}@[{', '.join(str(a.value) for a in self.addrs)}]"


class BlobFormat(RustEnum):
    Raw = 0
    HashSeq = 1


@struct(frozen=True)
class BlobTicket:
    addr: EndpointAddr
    format: BlobFormat
    hash: Annotated[bytes, FixedBytes(32)]
    size: U64

    @property
    def provider(self) -> bytes:
        return self.addr.id

    def __str__(self) -> str:
        return f"blob {fmt_short(self.hash)} ({self.size} B) from {fmt_short(self.addr.id)}"


def parse_host_port(addr: str) -> tuple[str, int]:
    """Split `host:port` (IPv4 or a name; IPv6 as `[::1]:port`)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected host:port, got {addr!r}")
    number = int(port)
    if not 0 < number < 65536:
        raise ValueError(f"port out of range in {addr!r}")
    return host.strip("[]"), number
