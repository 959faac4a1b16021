"""Bandwidth accounting and the stats the client and its TUI show (upstream state.rs, util.rs)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from psyche.core.serde import DataEnum, variant

BANDWIDTH_AVERAGE_PERIOD_SECS = 15.0
BANDWIDTH_GRAPH_SIZE = 60
STATS_INTERVAL_SECS = 1.0
"""Upstream refreshes stats every second; the 60-sample history is then a 60 s chart."""


class PeerBandwidth(DataEnum):
    NotMeasured = variant()
    Measured = variant(float)
    """Bytes per second from actual downloads."""


@dataclass
class _PeerWindow:
    """One peer's progress events of the window (oldest first) and their byte total, kept in
    step so a query costs O(1) instead of a re-sum of the window."""

    events: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0


class BandwidthTracker:
    """Bytes received per peer over a sliding window; `clock` is injected so tests control time.

    A peer's bandwidth is upstream's definition: the bytes of the events in its window divided by
    the seconds since the oldest of them (0 when none have passed); the window drops events older
    than `average_period_secs` when an event is added. The byte total is kept as events enter and
    leave (integers, so it equals the window's sum exactly): `add_event` is amortised O(1) and
    `get_peer_bandwidth` O(1), where re-summing made every progress update cost the whole window
    (quadratic in a long fetch)."""

    def __init__(
        self,
        average_period_secs: float = BANDWIDTH_AVERAGE_PERIOD_SECS,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.average_period_secs = average_period_secs
        self._clock = clock
        self._peers: dict[bytes, _PeerWindow] = {}

    def add_event(self, peer: bytes, num_bytes: int) -> None:
        now = self._clock()
        window = self._peers.get(peer)
        if window is None:
            window = self._peers[peer] = _PeerWindow()
        events = window.events
        events.append((now, num_bytes))
        window.total += num_bytes
        while events and now - events[0][0] > self.average_period_secs:
            window.total -= events.popleft()[1]

    def clear(self) -> None:
        self._peers.clear()

    def get_total_bandwidth(self) -> float:
        now = self._clock()
        return sum(_bandwidth(window, now) for window in self._peers.values())

    def get_peer_bandwidth(self, peer: bytes) -> PeerBandwidth:
        window = self._peers.get(peer)
        measured: PeerBandwidth
        if window is None or not window.events:
            measured = PeerBandwidth.NotMeasured()
        else:
            measured = PeerBandwidth.Measured(_bandwidth(window, self._clock()))
        return measured


def _bandwidth(window: _PeerWindow, now: float) -> float:
    if not window.events:
        return 0.0
    seconds = now - window.events[0][0]
    return window.total / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class SelectedPath:
    addr: str
    rtt: float
    """Seconds."""


@dataclass(frozen=True)
class P2PEndpointInfo:
    id: bytes
    selected_path: SelectedPath | None
    bandwidth: float
    latency: float
    """Seconds; `float('inf')` stands for upstream's `f64::MAX` (unknown)."""


@dataclass
class DownloadProgress:
    downloaded: int
    total: int


@dataclass
class NetworkStats:
    """Upstream `State`: what the TUI renders (peers, downloads, 60 s bandwidth chart)."""

    endpoint_id: bytes | None = None
    connection_info: list[P2PEndpointInfo] = field(default_factory=list)
    bandwidth_history: deque[float] = field(
        default_factory=lambda: deque(maxlen=BANDWIDTH_GRAPH_SIZE)
    )
    download_progresses: dict[bytes, DownloadProgress] = field(default_factory=dict)
    reachability: str = "reachability unknown"
    """This node's reachability, its relays and hole punches in one line
    (`ReachabilityStatus.summary`)."""
    peer_paths: dict[bytes, str] = field(default_factory=dict)
    """`direct` or `relayed` for every connected peer."""


def fmt_bytes(num_bytes: float) -> str:
    """Upstream `fmt_bytes`: B below 1 KiB, then KB..PB in 1024 steps with two decimals."""
    units = ("KB", "MB", "GB", "TB", "PB")
    if num_bytes < 1024:
        return f"{_rust_float(num_bytes)} B"
    value = float(num_bytes)
    for i, unit in enumerate(units):
        value /= 1024.0
        if value < 1024.0 or i == len(units) - 1:
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


def _rust_float(x: float) -> str:
    # Rust's `{}` for f64 prints integral values without a fraction ("512"), others shortest.
    return str(int(x)) if float(x).is_integer() else repr(float(x))
