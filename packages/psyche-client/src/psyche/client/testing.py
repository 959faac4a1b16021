"""A coordinator server and its backends inside one trio loop, for tests and research.

`InProcessServer` applies the centralized server's rules (upstream `centralized/server/src/
app.rs`) to a `Coordinator` on the real clock: a 500 ms tick, the pending set filled by joins
with the right run id, withdraw on disconnect, exited clients kicked from the pending set, and
the broadcast rules (every tick; on a state change caused by a witness; when a health check
drops someone; always after a checkpoint). Each `InProcessBackend` is one client's
`psyche.coordinator.backend.Backend` (and `EndpointDiscovery`): it receives every state the
server broadcasts, in order.

    server = InProcessServer(Coordinator.from_state_toml("state.toml"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        async with server.connect(identity, "my-run") as backend:
            await Client(backend, network, config).run()
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from psyche.coordinator.backend import HealthCheck, OpportunisticData
from psyche.coordinator.coordinator import ClientState, Coordinator, RunState, TickResult
from psyche.coordinator.errors import CoordinatorError, CoordinatorPanic
from psyche.coordinator.model import Checkpoint
from psyche.core.node_identity import NodeIdentity

logger = logging.getLogger(__name__)

TICK_INTERVAL_SECS = 0.5


class BackendDisconnected(ConnectionError):
    """The server went away (or this backend was disconnected)."""


class InProcessServer:
    def __init__(
        self,
        coordinator: Coordinator,
        *,
        tick_interval: float = TICK_INTERVAL_SECS,
        withdraw_on_disconnect: bool = True,
        init_warmup_time: int | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.tick_interval = tick_interval
        self.withdraw_on_disconnect = withdraw_on_disconnect
        self.clock = clock
        self.rng = rng or random.Random()
        self.pending: dict[bytes, NodeIdentity] = {}
        self.backends: dict[bytes, InProcessBackend] = {}
        self.records: dict[bytes, bytes] = {}
        self.epoch_ends: list[bool] = []
        self.states_broadcast = 0
        self._original_warmup_time = coordinator.config.warmup_time
        if init_warmup_time is not None:
            coordinator.config.warmup_time = init_warmup_time

    def now(self) -> int:
        return int(self.clock())

    # ---- the loop ------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                self.tick()
                await trio.sleep(self.tick_interval)
        finally:
            for backend in list(self.backends.values()):
                backend._close()

    def tick(self) -> None:
        coordinator = self.coordinator
        for client in coordinator.epoch_state.exited_clients:
            if client.state is not ClientState.Healthy:
                self.pending.pop(client.id.signer, None)
        try:
            result = coordinator.tick(
                list(self.pending.values()), self.now(), self.rng.getrandbits(64)
            )
        except CoordinatorError as e:
            if str(e) != "Halted":
                logger.warning("tick: %s", e)
        except CoordinatorPanic as e:
            logger.error("tick panicked (upstream would crash): %s", e)
        else:
            if isinstance(result, TickResult.EpochEnd):
                self.epoch_ends.append(bool(result.value))
                if not result.value:
                    logger.warning("Epoch abandoned")
        self._post_state_change(broadcast=True)

    def _post_state_change(self, *, broadcast: bool) -> None:
        if self.coordinator.active():
            self.coordinator.config.warmup_time = self._original_warmup_time
        if broadcast:
            self.states_broadcast += 1
            for backend in self.backends.values():
                backend._deliver(self.coordinator.copy())

    # ---- messages ------------------------------------------------------------------------------

    def join(self, identity: NodeIdentity, run_id: str) -> None:
        if run_id == self.coordinator.run_id:
            self.pending[identity.signer] = identity
        else:
            logger.warning("%s tried to join unknown run %r", identity, run_id)

    def disconnect(self, identity: NodeIdentity) -> None:
        self.pending.pop(identity.signer, None)
        self.backends.pop(identity.signer, None)
        self.records.pop(identity.signer, None)
        if not self.withdraw_on_disconnect:
            return
        for index, client in enumerate(self.coordinator.epoch_state.clients):
            if client.id == identity:
                try:
                    self.coordinator.withdraw(index)
                except CoordinatorError as e:
                    logger.warning("withdraw of %s: %s", identity, e)
                break

    def witness(self, identity: NodeIdentity, data: OpportunisticData) -> None:
        before = self.coordinator.run_state
        try:
            match data:
                case OpportunisticData.WitnessStep((witness, _metadata)):
                    self.coordinator.witness(identity, witness, self.now())
                case OpportunisticData.WarmupStep(witness):
                    self.coordinator.warmup_witness(
                        identity, witness, self.now(), self.rng.getrandbits(64)
                    )
        except (CoordinatorError, CoordinatorPanic) as e:
            logger.warning("witness from %s rejected: %s", identity, e)
        self._post_state_change(broadcast=self.coordinator.run_state is not before)

    def health_check(self, identity: NodeIdentity, checks: list[HealthCheck]) -> None:
        dropped = 0
        try:
            dropped = self.coordinator.health_check(identity, checks)
        except (CoordinatorError, CoordinatorPanic) as e:
            logger.warning("health check from %s rejected: %s", identity, e)
        self._post_state_change(broadcast=dropped > 0)

    def checkpoint(self, identity: NodeIdentity, checkpoint: Checkpoint) -> None:
        clients = self.coordinator.epoch_state.clients
        index = next((i for i, c in enumerate(clients) if c.id == identity), None)
        if index is None:
            logger.warning("checkpoint from %s, which is not a client of the run", identity)
        else:
            try:
                self.coordinator.checkpoint(identity, index, checkpoint)
            except CoordinatorError as e:
                logger.warning("checkpoint from %s rejected: %s", identity, e)
        self._post_state_change(broadcast=True)

    # ---- backends --------------------------------------------------------------------------

    @asynccontextmanager
    async def connect(self, identity: NodeIdentity, run_id: str) -> AsyncIterator[InProcessBackend]:
        """A backend for `identity`, joined to `run_id`; leaving the block disconnects it."""
        backend = InProcessBackend(self, identity)
        self.backends[identity.signer] = backend
        self.join(identity, run_id)
        try:
            yield backend
        finally:
            if self.backends.get(identity.signer) is backend:
                self.disconnect(identity)
            backend._close()

    def clients_in_state(self, state: ClientState) -> list[NodeIdentity]:
        return [c.id for c in self.coordinator.epoch_state.clients if c.state is state]

    @property
    def run_state(self) -> RunState:
        return self.coordinator.run_state


class InProcessBackend:
    """One client's view of an `InProcessServer` (upstream's centralized client backend)."""

    def __init__(self, server: InProcessServer, identity: NodeIdentity) -> None:
        self.server = server
        self.identity = identity
        self._send, self._receive = trio.open_memory_channel[Coordinator](math.inf)
        self.connected = True

    def _deliver(self, state: Coordinator) -> None:
        if self.connected:
            self._send.send_nowait(state)

    def _close(self) -> None:
        self.connected = False
        self._send.close()

    def _check(self) -> None:
        if not self.connected:
            raise BackendDisconnected("disconnected from the in-process server")

    async def wait_for_new_state(self) -> Coordinator:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise BackendDisconnected("the in-process server closed the connection") from None

    async def send_witness(self, opportunistic_data: OpportunisticData) -> None:
        self._check()
        self.server.witness(self.identity, opportunistic_data)

    async def send_health_check(self, health_checks: list[HealthCheck]) -> None:
        self._check()
        self.server.health_check(self.identity, health_checks)

    async def send_checkpoint(self, checkpoint: Checkpoint) -> None:
        self._check()
        self.server.checkpoint(self.identity, checkpoint)

    async def publish_endpoint(self, record: bytes) -> None:
        self._check()
        self.server.records[self.identity.signer] = bytes(record)

    def peer_endpoints(self) -> list[bytes]:
        return [r for k, r in self.server.records.items() if k != self.identity.signer]

    def disconnect(self) -> None:
        """Drop the connection as a crashed client would (the server withdraws it)."""
        if self.connected:
            self.server.disconnect(self.identity)
            self._close()
