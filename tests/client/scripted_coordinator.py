"""A backend whose coordinator states the test sends (`ScriptedCoordinator`), for the client
tests of joining: what a client does when the run drops it, or its init fails, while it waits."""

from __future__ import annotations

import math

import trio

from psyche.coordinator import Coordinator
from psyche.coordinator.backend import HealthCheck, OpportunisticData
from psyche.coordinator.model import Checkpoint

WAIT_SECS = 60.0
"""Generous (a loaded machine): each wait ends as soon as its condition holds."""


class ScriptedCoordinator:
    """A backend (`Backend` and `Rejoin`) whose states the test sends; it counts `Join`s."""

    def __init__(self) -> None:
        self.states, self._receive = trio.open_memory_channel[Coordinator](math.inf)
        self.rejoins = 0

    async def wait_for_new_state(self) -> Coordinator:
        return await self._receive.receive()

    async def send_witness(self, opportunistic_data: OpportunisticData) -> None:
        pass

    async def send_health_check(self, health_checks: list[HealthCheck]) -> None:
        pass

    async def send_checkpoint(self, checkpoint: Checkpoint) -> None:
        pass

    async def rejoin(self) -> None:
        self.rejoins += 1
