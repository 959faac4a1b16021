"""The client side of the centralized protocol: a `Backend` for the training client.

    async with CentralizedBackend.connect("127.0.0.1:20000", secret_key, run_id) as backend:
        state = await backend.wait_for_new_state()
        await backend.send_witness(OpportunisticData.WarmupStep(witness))

`connect` authenticates with the client's ed25519 key (`psyche.network.tcp`), says it speaks the
port's extensions (`protocol`), sends `Join{run_id}` once per connection, and keeps receiving
in the background: the newest coordinator state, the peers' endpoint records and the run's
extras. Against an upstream (Rust) server, which drops a connection on a message it cannot
decode, it reconnects once without extensions and remembers that.

When the server goes away, `wait_for_new_state` raises `BackendDisconnected` (upstream's client
exits then). With `reconnect_timeout`, the backend instead keeps reconnecting for that long
(a restarted server resumes a saved run, see docs/centralized.md), joins again and carries on;
messages sent while it is disconnected are dropped with a warning, since the coordinator they
were meant for is gone.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from psyche.centralized.protocol import (
    CLIENT_TO_SERVER_CODEC,
    SERVER_TO_CLIENT_CODEC,
    ClientToServerMessage,
    ExtensionHello,
    JoinRun,
    RunExtras,
    ServerToClientMessage,
)
from psyche.coordinator.backend import HealthCheck, OpportunisticData
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.model import Checkpoint, LLMTrainingDataLocation
from psyche.core.node_identity import NodeIdentity
from psyche.network.tcp import ConnectionClosed, TcpClient, TcpProtocolError

log = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT = 30.0
# How long the server may take to answer the extension hello.
EXTENSION_REPLY_TIMEOUT = 10.0
_RETRY_DELAYS = (0.1, 0.2, 0.5, 1.0)

# Errors that mean "this connection is unusable" (a decoding error is a ValueError).
_CONNECTION_ERRORS = (
    OSError,
    ConnectionClosed,
    TcpProtocolError,
    ValueError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.TooSlowError,
)


class BackendDisconnected(ConnectionError):
    """The coordinator server closed the connection or could not be reached."""


class CentralizedBackend:
    """`psyche.coordinator.backend.Backend` and `EndpointDiscovery` over TCP; use `connect`."""

    def __init__(
        self,
        server_addr: str,
        secret_key: Any,
        run_id: str,
        *,
        reconnect_timeout: float | None = None,
        extensions: bool = True,
    ) -> None:
        self.server_addr = server_addr
        self.run_id = run_id
        self.identity = NodeIdentity.from_single_key(bytes(secret_key.public_key))
        self.reconnect_timeout = reconnect_timeout
        self._secret_key = secret_key
        # None: not known yet; False: the server is upstream's and does not speak them.
        self._extensions: bool | None = None if extensions else False
        self._conn: TcpClient[ClientToServerMessage, ServerToClientMessage] | None = None
        self._latest: Coordinator | None = None
        self._received = 0
        self._returned = 0
        self._changed = trio.Event()
        self._failure: BackendDisconnected | None = None
        self._endpoint_record: bytes | None = None
        self._peer_endpoints: list[bytes] = []
        self.run_extras: RunExtras | None = None
        self.connections = 0

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        server_addr: str,
        secret_key: Any,
        run_id: str,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        reconnect_timeout: float | None = None,
        extensions: bool = True,
    ) -> AsyncIterator[CentralizedBackend]:
        """Connect (retrying for up to `connect_timeout` seconds while the server is not up),
        join the run, and receive until the block exits."""
        backend = cls(
            server_addr,
            secret_key,
            run_id,
            reconnect_timeout=reconnect_timeout,
            extensions=extensions,
        )
        await backend._establish(connect_timeout)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(backend._receive_loop)
                try:
                    yield backend
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            await backend._close_connection()

    # -- Backend

    async def wait_for_new_state(self) -> Coordinator:
        """The newest state received since the last call (waits for one); cancel safe."""
        while True:
            if self._received > self._returned and self._latest is not None:
                self._returned = self._received
                return self._latest
            if self._failure is not None:
                raise self._failure
            await self._changed.wait()

    async def send_witness(self, opportunistic_data: OpportunisticData) -> None:
        await self._send(ClientToServerMessage.Witness(opportunistic_data))

    async def send_health_check(self, health_checks: list[HealthCheck]) -> None:
        await self._send(ClientToServerMessage.HealthCheck(list(health_checks)))

    async def send_checkpoint(self, checkpoint: Checkpoint) -> None:
        await self._send(ClientToServerMessage.Checkpoint(checkpoint))

    # -- EndpointDiscovery

    async def publish_endpoint(self, record: bytes) -> None:
        """Announce this client's signed address record (again after every reconnect)."""
        self._endpoint_record = bytes(record)
        if self._extensions:
            await self._send(ClientToServerMessage.AnnounceEndpoint(self._endpoint_record))

    def peer_endpoints(self) -> list[bytes]:
        return list(self._peer_endpoints)

    # -- extras

    @property
    def backup_data_locations(self) -> list[LLMTrainingDataLocation]:
        """The run's backup data locations (empty against an upstream server)."""
        return list(self.run_extras.backup_data_locations) if self.run_extras else []

    @property
    def extensions_enabled(self) -> bool:
        return bool(self._extensions)

    @property
    def connected(self) -> bool:
        return self._conn is not None

    # -- connection management

    async def _establish(self, timeout: float) -> None:
        deadline = trio.current_time() + timeout
        attempt = 0
        while True:
            try:
                self._conn = await self._connect_and_join()
                self.connections += 1
                return
            except _CONNECTION_ERRORS as e:
                if trio.current_time() >= deadline:
                    raise BackendDisconnected(
                        f"cannot connect to the coordinator server at {self.server_addr}: {e}"
                    ) from e
                log.debug("connecting to %s failed (%s); retrying", self.server_addr, e)
            delay = _RETRY_DELAYS[min(attempt, len(_RETRY_DELAYS) - 1)]
            attempt += 1
            await trio.sleep(min(delay, max(deadline - trio.current_time(), 0)))

    async def _connect_and_join(
        self,
    ) -> TcpClient[ClientToServerMessage, ServerToClientMessage]:
        while True:
            conn = await TcpClient.connect(
                self.server_addr,
                self._secret_key,
                to_server=CLIENT_TO_SERVER_CODEC,
                to_client=SERVER_TO_CLIENT_CODEC,
            )
            try:
                if self._extensions is not False:
                    try:
                        await self._hello(conn)
                    except (ConnectionClosed, trio.BrokenResourceError) as e:
                        if self._extensions is None:
                            log.info(
                                "the server at %s closed the connection on the extension hello "
                                "(an upstream server); reconnecting without extensions",
                                self.server_addr,
                            )
                            self._extensions = False
                            await conn.aclose()
                            continue
                        raise ConnectionClosed(str(e)) from e
                await conn.send(ClientToServerMessage.Join(JoinRun(self.run_id)))
                if self._extensions and self._endpoint_record is not None:
                    await conn.send(ClientToServerMessage.AnnounceEndpoint(self._endpoint_record))
            except BaseException:
                await conn.aclose()
                raise
            log.info("joined run %r at %s", self.run_id, self.server_addr)
            return conn

    async def _hello(self, conn: TcpClient[ClientToServerMessage, ServerToClientMessage]) -> None:
        await conn.send(ClientToServerMessage.ExtensionHello(ExtensionHello()))
        with trio.fail_after(EXTENSION_REPLY_TIMEOUT):
            while True:
                message = await conn.receive()
                self._handle(message)
                if isinstance(message, ServerToClientMessage.RunExtras):
                    self._extensions = True
                    return

    async def _receive_loop(self) -> None:
        while True:
            conn = self._conn
            assert conn is not None
            try:
                message = await conn.receive()
            except _CONNECTION_ERRORS as e:
                self._conn = None
                await conn.aclose()
                if self.reconnect_timeout is None:
                    self._fail(BackendDisconnected(f"lost the coordinator server: {e}"))
                    return
                log.warning(
                    "lost the coordinator server (%s); reconnecting for up to %.0f s",
                    e,
                    self.reconnect_timeout,
                )
                try:
                    await self._establish(self.reconnect_timeout)
                except BackendDisconnected as failure:
                    self._fail(failure)
                    return
                continue
            self._handle(message)

    def _handle(self, message: ServerToClientMessage) -> None:
        match message:
            case ServerToClientMessage.Coordinator(state):
                self._latest = state
                self._received += 1
                self._wake()
            case ServerToClientMessage.PeerEndpoints(records):
                self._peer_endpoints = list(records)
            case ServerToClientMessage.RunExtras(extras):
                self.run_extras = extras

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _fail(self, failure: BackendDisconnected) -> None:
        log.error("%s", failure)
        self._failure = failure
        self._wake()

    async def _send(self, message: ClientToServerMessage) -> None:
        if self._failure is not None:
            raise self._failure
        conn = self._conn
        if conn is None:
            log.warning("not connected to the server: %s dropped", message.variant_name)  # type: ignore[attr-defined]
            return
        try:
            await conn.send(message)
        except _CONNECTION_ERRORS as e:
            if self.reconnect_timeout is None:
                raise BackendDisconnected(f"lost the coordinator server: {e}") from e
            log.warning("sending %s failed (%s); dropped", message.variant_name, e)  # type: ignore[attr-defined]

    async def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()


__all__ = ["DEFAULT_CONNECT_TIMEOUT", "BackendDisconnected", "CentralizedBackend"]
