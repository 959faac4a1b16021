"""The server's trackers (`--oltp-*`, `--metrics-jsonl`): what `psyche-server run` logs.

`ServerTracker` listens to the server (`CentralizedServer.listeners`, after the status page's
`StatusHistory`, whose round durations it logs: one measurement for both) and logs, whenever
the run state, the step or the membership changes: the run state, epoch, step, members,
healthy members, clients waiting to join, connected clients, and each round's duration once it
is known. Steps are the coordinator's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psyche.coordinator.run_state import ClientState
from psyche.metrics import names

if TYPE_CHECKING:
    from psyche.centralized.server import CentralizedServer
    from psyche.centralized.status_page import StatusHistory
    from psyche.metrics import MetricValue, Tracker

PENDING_CLIENTS = "coordinator/pending_clients"
CONNECTED_CLIENTS = "coordinator/connected_clients"


class ServerTracker:
    def __init__(self, tracker: Tracker, history: StatusHistory) -> None:
        self.tracker = tracker
        self.history = history
        self._last: tuple[Any, ...] | None = None
        self._logged_rounds = 0

    def state_changed(self, server: CentralizedServer) -> None:
        coordinator = server.coordinator
        clients = coordinator.epoch_state.clients
        healthy = sum(1 for c in clients if c.state is ClientState.Healthy)
        pending = len(server.core.pending_clients)
        connected = len(server.connected_clients())
        key = (
            coordinator.run_state,
            coordinator.progress.step,
            len(clients),
            healthy,
            pending,
            connected,
        )
        if key == self._last:
            return
        self._last = key
        metrics: dict[str, MetricValue] = {
            names.COORDINATOR_RUN_STATE: coordinator.run_state.name,
            names.COORDINATOR_EPOCH: coordinator.progress.epoch,
            names.COORDINATOR_STEP: coordinator.progress.step,
            names.COORDINATOR_NUM_CLIENTS: len(clients),
            names.COORDINATOR_HEALTHY_CLIENTS: healthy,
            PENDING_CLIENTS: pending,
            CONNECTED_CLIENTS: connected,
        }
        durations = self.history.round_durations
        if len(durations) and self.history.rounds_measured > self._logged_rounds:
            self._logged_rounds = self.history.rounds_measured
            metrics[names.ROUND_DURATION_SECONDS] = durations[-1][1]
        self.tracker.log(metrics, coordinator.progress.step)

    def witness(self, sender: Any, step: int, metadata: Any) -> None:
        pass
