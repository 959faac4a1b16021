"""Per-peer connection facts: the path in use, its round-trip time and measured bandwidth.

Upstream reads QUIC's path RTT; py-libp2p reports ping RTT in whole milliseconds, so the network
times its own pings (every `RTT_PROBE_INTERVAL_SECS`) and feeds them in here. An entry outlives
its connection (path cleared, bandwidth kept) so a peer's record survives reconnects; a peer's
bandwidth is kept even if it never had a libp2p connection (blobs fetched on the side channel).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from psyche.network.identity import fmt_short
from psyche.network.stats import PeerBandwidth, SelectedPath

logger = logging.getLogger(__name__)

RTT_PROBE_INTERVAL_SECS = 5.0
LATENCY_CHANGE_THRESHOLD_SECS = 0.050


@dataclass(frozen=True)
class ConnectionData:
    endpoint_id: bytes
    bandwidth: PeerBandwidth
    selected_path: SelectedPath | None
    connected: bool

    def latency(self) -> float | None:
        return None if self.selected_path is None else self.selected_path.rtt


@dataclass(frozen=True)
class ConnectionChanged:
    endpoint_id: bytes
    path: SelectedPath | None


@dataclass(frozen=True)
class ConnectionLatencyChanged:
    endpoint_id: bytes
    latency_secs: float


MonitorEvent = ConnectionChanged | ConnectionLatencyChanged


class ConnectionMonitor:
    def __init__(self, on_event: Callable[[MonitorEvent], None] | None = None) -> None:
        self._connections: dict[bytes, ConnectionData] = {}
        self._addrs: dict[bytes, str] = {}
        self._on_event = on_event or (lambda _event: None)

    # fed by the network ------------------------------------------------------------------------

    def on_connected(self, peer: bytes, remote_addr: str) -> None:
        previous = self._connections.get(peer)
        bandwidth = previous.bandwidth if previous else PeerBandwidth.NotMeasured()
        self._addrs[peer] = remote_addr
        self._connections[peer] = ConnectionData(peer, bandwidth, None, True)
        logger.info("new connection remote=%s addr=%s", fmt_short(peer), remote_addr)

    def on_disconnected(self, peer: bytes) -> None:
        data = self._connections.get(peer)
        if data is not None:
            self._connections[peer] = replace(data, selected_path=None, connected=False)

    def on_rtt(self, peer: bytes, rtt_secs: float) -> None:
        data = self._connections.get(peer)
        if data is None or not data.connected:
            return
        path = SelectedPath(self._addrs.get(peer, "?"), rtt_secs)
        old = data.selected_path
        self._connections[peer] = replace(data, selected_path=path)
        if old is None or old.addr != path.addr:
            self._on_event(ConnectionChanged(peer, path))
        elif abs(old.rtt - path.rtt) > LATENCY_CHANGE_THRESHOLD_SECS:
            self._on_event(ConnectionLatencyChanged(peer, path.rtt))

    # queries -------------------------------------------------------------------------------------

    def update_peer_bandwidth(self, peer: bytes, bandwidth: PeerBandwidth) -> None:
        """Kept for every peer, whatever carried its blobs: a peer fetched from on the blob side
        channel alone has no libp2p connection (a not-connected entry is made for it), and its
        measurements, a failure's `Measured(0)` included, rank it as any other's
        (`PeerManager.get_next_peer`). Before, they were dropped: side-channel providers stayed
        unmeasured, ranked behind every libp2p-measured one, and one that failed never fell to
        the failed tier."""
        data = self._connections.get(peer)
        if data is None:
            data = ConnectionData(peer, bandwidth, None, False)
        self._connections[peer] = replace(data, bandwidth=bandwidth)

    def get_connection(self, peer: bytes) -> ConnectionData | None:
        return self._connections.get(peer)

    def get_all_connections(self) -> list[ConnectionData]:
        return list(self._connections.values())

    def connected_peers(self) -> list[bytes]:
        return [p for p, d in self._connections.items() if d.connected]

    def get_latency(self, peer: bytes) -> float | None:
        data = self._connections.get(peer)
        return None if data is None else data.latency()

    def get_bandwidth(self, peer: bytes) -> PeerBandwidth | None:
        data = self._connections.get(peer)
        return None if data is None else data.bandwidth

    def clear_all_bandwidth(self) -> None:
        for peer, data in self._connections.items():
            self._connections[peer] = replace(data, bandwidth=PeerBandwidth.NotMeasured())
