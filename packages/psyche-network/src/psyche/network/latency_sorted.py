"""Providers to try for a blob, lowest latency first (upstream `LatencySorted`)."""

from __future__ import annotations

from collections.abc import Iterable

from psyche.network.connection_monitor import ConnectionMonitor


class LatencySorted:
    def __init__(self, nodes: Iterable[bytes], monitor: ConnectionMonitor) -> None:
        self.nodes = list(dict.fromkeys(bytes(n) for n in nodes))
        self._monitor = monitor

    def find_providers(self) -> list[bytes]:
        """Stable sort by latency, unknown last: ties keep insertion order (ticket provider first)."""

        def key(node: bytes) -> float:
            latency = self._monitor.get_latency(node)
            return float("inf") if latency is None else latency

        return sorted(self.nodes, key=key)
