"""The client side of the centralized protocol: a `Backend` for the training client.

    async with CentralizedBackend.connect("127.0.0.1:20000", secret_key, run_id) as backend:
        state = await backend.wait_for_new_state()
        await backend.send_witness(OpportunisticData.WarmupStep(witness))

`connect` authenticates with the client's ed25519 key (`psyche.transport`), says it speaks the
port's extensions (`protocol`), sends `Join{run_id}` once per connection, and keeps receiving
in the background: the newest coordinator state, the peers' endpoint records and the run's
extras. Against an upstream (Rust) server, which drops a connection on a message it cannot
decode, it reconnects once without extensions and remembers that.

When the server goes away, `wait_for_new_state` raises `BackendDisconnected` (upstream's client
exits then). So it does, whatever `reconnect_timeout`, when the server refuses this client for
good (`Refused`, permanent): a private run that does not list its key, or a Join for a run id
the server does not serve ("the coordinator at HOST:PORT refused this client: unknown run id
'x': this server runs 'tiny'"); retrying could only wait forever. With `reconnect_timeout`, the backend instead keeps reconnecting for that long
(a restarted server resumes a saved run, see docs/centralized.md), joins again and carries on;
messages sent while it is disconnected are dropped with a warning, since the coordinator they
were meant for is gone. `rejoin` sends Join again when the run went on without this client.

Every wait says what it waits for: "connecting to the coordinator at HOST:PORT" before the first
attempt, "waiting for the coordinator at HOST:PORT (connection refused; retrying for N s)" at the
first failure and every `WAIT_REPORT_SECONDS` after, and one line, `BackendDisconnected` (a
`UserError`), when it gives up. Until this client is in the run's epoch, each new reason it is
not ("waiting for the run to start: 1 of 2 clients joined", "joining at the next epoch") is
logged once.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
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
from psyche.coordinator import Coordinator, RunState
from psyche.coordinator.backend import HealthCheck, OpportunisticData
from psyche.coordinator.model import Checkpoint, LLMTrainingDataLocation
from psyche.coordinator.server_core import VERIFIED_ROUNDS
from psyche.coordinator.verification import VerificationReport
from psyche.core.cli import UserError
from psyche.core.node_identity import NodeIdentity
from psyche.transport import (
    ConnectionClosed,
    LoginRefused,
    TcpClient,
    TcpProtocolError,
    parse_address,
)

log = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT = 30.0
# How long the server may take to answer the extension hello.
EXTENSION_REPLY_TIMEOUT = 10.0
# One connection attempt (TCP connect, handshake, hello) at most this long: a host that drops
# the SYN or a listener that never speaks must not outlive the connect timeout.
ATTEMPT_TIMEOUT = 10.0
# While connecting fails, say so again this often (and whenever the reason changes).
WAIT_REPORT_SECONDS = 10.0
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


class BackendDisconnected(ConnectionError, UserError):
    """The coordinator server closed the connection or could not be reached: the user's to fix
    (start the server, or point at the right address), so a command reports it in one line."""


class ExtensionsMismatch(UserError):
    """The server speaks another version of the port's extensions (its `RunExtras` does not
    decode here): retrying cannot help, so a command reports it in one line."""


def describe_connect_error(error: BaseException) -> str:
    """Why a connection attempt failed, in a few words: the OS's reason (`connection refused`,
    `no route to host`), a name that does not resolve, or what the peer did."""
    if isinstance(error, trio.TooSlowError):
        return "no answer"
    if isinstance(error, LoginRefused):
        return f"the server refused this client: {error.reason}"
    if isinstance(error, ConnectionClosed | trio.BrokenResourceError | trio.ClosedResourceError):
        return "the server closed the connection during the handshake"
    if isinstance(error, TcpProtocolError):
        return f"not a Psyche coordinator? {error}"
    for cause in _causes(error):
        if isinstance(cause, socket.gaierror):
            return f"cannot resolve the host name ({cause.strerror or cause})"
        if isinstance(cause, OSError) and cause.errno is not None and cause.errno > 0:
            return os.strerror(cause.errno).lower()
    return str(error) or type(error).__name__


def _causes(error: BaseException) -> list[BaseException]:
    """`error`, then what it was raised from and what its groups hold, breadth first."""
    found: list[BaseException] = []
    pending = [error]
    while pending and len(found) < 32:
        current = pending.pop(0)
        found.append(current)
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        if current.__cause__ is not None:
            pending.append(current.__cause__)
    return found


def join_wait_message(state: Coordinator, identity: NodeIdentity, joined: int | None) -> str | None:
    """Why a client that has joined a run is not training yet, for the person watching it; None
    when it is in the epoch (or the run is over). `joined`: how many clients the server has
    (None when the server does not say)."""
    if any(c.id == identity for c in state.epoch_state.clients):
        return None
    needed = state.config.init_min_clients
    match state.run_state:
        case RunState.Uninitialized:
            return "waiting for the run to be initialized"
        case RunState.WaitingForMembers:
            if joined is None:
                return f"waiting for the run to start: it starts once {needed} clients have joined"
            return f"waiting for the run to start: {joined} of {needed} clients joined"
        case RunState.Paused:
            return "the run is paused; waiting for it to resume"
        case RunState.Finished:
            return None
        case _:
            return (
                f"the run is in epoch {state.progress.epoch} without this client; it joins at "
                "the next epoch's warmup"
            )


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
        self.relays: list[str] = []
        """The relays the server hosts for the run (`ServerToClientMessage.Relays`)."""
        self.relays_changed = trio.Event()
        """Set (and replaced) when the server names other relays (a restarted server's relay
        has a new identity)."""
        self.connections = 0
        self._heard: dict[int, dict[NodeIdentity, VerificationReport]] = {}
        """The verification reports the server relayed, by round (the last `VERIFIED_ROUNDS`)."""
        self._join_wait: str | None = None
        self._before_join: Callable[[], Awaitable[None]] | None = None

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
        before_join: Callable[[], Awaitable[None]] | None = None,
    ) -> AsyncIterator[CentralizedBackend]:
        """Connect (retrying for up to `connect_timeout` seconds while the server is not up),
        join the run, and receive until the block exits. A malformed `server_addr` is a
        `UserError` at once; a server that stays unreachable, `BackendDisconnected`.

        `before_join` is awaited once, between the first connection and its Join (not counted
        in `connect_timeout`): a client that loads its heavy modules meanwhile learns at once
        whether the coordinator is there, yet joins only when it can train (the run's warmup
        starts as soon as enough clients have joined)."""
        try:
            parse_address(server_addr)
        except ValueError as e:
            raise UserError(f"bad coordinator address: {e}") from None
        backend = cls(
            server_addr,
            secret_key,
            run_id,
            reconnect_timeout=reconnect_timeout,
            extensions=extensions,
        )
        backend._before_join = before_join
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

    async def send_verification(self, report: VerificationReport) -> None:
        await self._send(ClientToServerMessage.Verification(report))

    async def send_checkpoint(self, checkpoint: Checkpoint) -> None:
        await self._send(ClientToServerMessage.Checkpoint(checkpoint))

    async def round_reports(self, step: int) -> dict[NodeIdentity, VerificationReport]:
        """`VerificationReports.round_reports`: what the server relayed for round `step`."""
        return dict(self._heard.get(step, {}))

    # -- Rejoin

    async def rejoin(self) -> None:
        """Join the run again after the coordinator went on without this client: a Join on the
        same connection (a Python server keeps a Join sent after the client left the epoch;
        upstream's takes it back on its next tick, and so only a restarted client returns)."""
        conn = self._conn
        if conn is None:
            return  # reconnecting: that joins again
        try:
            await self._join(conn)
        except _CONNECTION_ERRORS as e:
            log.warning("could not join again (%s); the receive loop sees the connection end", e)

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

    def run_identity(self) -> str | None:
        """Which instance of the run the server runs (`RunIdentity`; None against an upstream
        server)."""
        return (self.run_extras.run_identity or None) if self.run_extras else None

    @property
    def extensions_enabled(self) -> bool:
        return bool(self._extensions)

    @property
    def connected(self) -> bool:
        return self._conn is not None

    # -- connection management

    async def _establish(self, timeout: float) -> None:
        """Connect and join, retrying until `timeout` seconds have passed; say what it waits
        for at the first failure, every `WAIT_REPORT_SECONDS` and when the reason changes."""
        start = trio.current_time()
        deadline = start + timeout
        attempt = 0
        said: tuple[float, str] | None = None
        log.info("connecting to the coordinator at %s", self.server_addr)
        while True:
            try:
                remaining = max(deadline - trio.current_time(), 0.0)
                with trio.fail_after(max(min(ATTEMPT_TIMEOUT, remaining), 0.1)):
                    conn = await self._connect()
                try:
                    if self._before_join is not None:
                        await self._before_join()
                        self._before_join = None
                    with trio.fail_after(ATTEMPT_TIMEOUT):
                        await self._join(conn)
                except BaseException:
                    await conn.aclose()
                    raise
                self._conn = conn
                self.connections += 1
                return
            except _CONNECTION_ERRORS as e:
                reason = describe_connect_error(e)
                if isinstance(e, LoginRefused) and e.permanent:
                    # The same key will be refused again: say so now instead of retrying.
                    raise self._refused(e) from None
                now = trio.current_time()
                if now >= deadline:
                    raise BackendDisconnected(
                        f"cannot connect to the coordinator at {self.server_addr}: {reason} "
                        f"(tried for {now - start:.0f} s)"
                    ) from e
                if said is None or said[1] != reason or now - said[0] >= WAIT_REPORT_SECONDS:
                    log.info(
                        "waiting for the coordinator at %s (%s; retrying for %.0f s)",
                        self.server_addr,
                        reason,
                        deadline - now,
                    )
                    said = (now, reason)
                log.debug("connecting to %s failed: %r", self.server_addr, e)
            delay = _RETRY_DELAYS[min(attempt, len(_RETRY_DELAYS) - 1)]
            attempt += 1
            await trio.sleep(min(delay, max(deadline - trio.current_time(), 0)))

    async def _connect(self) -> TcpClient[ClientToServerMessage, ServerToClientMessage]:
        """An authenticated connection that has negotiated the extensions (not joined yet)."""
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
                    except LoginRefused:
                        raise
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
            except BaseException:
                await conn.aclose()
                raise
            return conn

    async def _join(self, conn: TcpClient[ClientToServerMessage, ServerToClientMessage]) -> None:
        await conn.send(ClientToServerMessage.Join(JoinRun(self.run_id)))
        if self._extensions and self._endpoint_record is not None:
            await conn.send(ClientToServerMessage.AnnounceEndpoint(self._endpoint_record))
        log.info("joined run %r at %s", self.run_id, self.server_addr)

    async def _hello(self, conn: TcpClient[ClientToServerMessage, ServerToClientMessage]) -> None:
        await conn.send(ClientToServerMessage.ExtensionHello(ExtensionHello()))
        with trio.fail_after(EXTENSION_REPLY_TIMEOUT):
            while True:
                try:
                    message = await conn.receive()
                except ValueError as e:  # a decoding error: the answer to the hello
                    raise ExtensionsMismatch(
                        f"the server at {self.server_addr} answered the extension hello with a "
                        f"message this client cannot read ({e}): it runs another version of "
                        "psyche; run the same version on the server and its clients"
                    ) from e
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
                if isinstance(e, LoginRefused) and e.permanent:
                    self._fail(self._refused(e), say=False)  # the caller's one line says it
                    return
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
                if self.run_extras is not None:
                    # beside the state: upstream's postcard bytes have no room for them
                    _extend_config(state, self.run_extras)
                self._latest = state
                self._received += 1
                self._say_join_wait()
                self._wake()
            case ServerToClientMessage.PeerEndpoints(records):
                self._peer_endpoints = list(records)
                self._say_join_wait()
            case ServerToClientMessage.RunExtras(extras):
                self.run_extras = extras
                if self._latest is not None:
                    _extend_config(self._latest, extras)  # a state heard before it
            case ServerToClientMessage.VerificationHeard(heard):
                step = int(heard.report.step)
                self._heard.setdefault(step, {}).setdefault(heard.sender, heard.report)
                for old in sorted(self._heard)[:-VERIFIED_ROUNDS]:
                    del self._heard[old]
            case ServerToClientMessage.Relays(addrs):
                if list(addrs) != self.relays:
                    self.relays = list(addrs)
                    self.relays_changed.set()
                    self.relays_changed = trio.Event()

    def _say_join_wait(self) -> None:
        """Log why this client is not training yet, once per reason."""
        if self._latest is None:
            return
        # An extension server sends every joined client the others' endpoint records.
        joined = 1 + len(self._peer_endpoints) if self._extensions else None
        message = join_wait_message(self._latest, self.identity, joined)
        if message is not None and message != self._join_wait:
            log.info("%s", message)
        self._join_wait = message

    def _refused(self, refusal: LoginRefused) -> BackendDisconnected:
        return BackendDisconnected(
            f"the coordinator at {self.server_addr} refused this client: {refusal.reason}"
        )

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _fail(self, failure: BackendDisconnected, *, say: bool = True) -> None:
        if say:
            log.error("%s", failure)
        self._failure = failure
        self._wake()

    async def _send(self, message: ClientToServerMessage) -> None:
        if self._failure is not None:
            raise self._failure
        conn = self._conn
        if conn is None:
            log.warning("not connected to the server: %s dropped", message.variant_name)
            return
        try:
            await conn.send(message)
        except _CONNECTION_ERRORS as e:
            if self.reconnect_timeout is None:
                raise BackendDisconnected(f"lost the coordinator server: {e}") from e
            log.warning("sending %s failed (%s); dropped", message.variant_name, e)

    async def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()


__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "BackendDisconnected",
    "CentralizedBackend",
    "describe_connect_error",
    "join_wait_message",
]


def _extend_config(state: Coordinator, extras: RunExtras) -> None:
    """Put the run's config extensions the server sends beside its state (`RunExtras`) in it."""
    if extras.verifiers_train:
        state.config.verifiers_train = True
    if extras.exact_verification_threads:
        state.config.exact_verification_threads = int(extras.exact_verification_threads)
