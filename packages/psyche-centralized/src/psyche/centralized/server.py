"""The centralized coordinator server: `ServerCore` behind real sockets (upstream `app.rs`).

    async with open_server(coordinator, ServerOptions(port=0)) as server:
        print(server.address)
        await trio.sleep_forever()

What runs while the block is open:

* the authenticated TCP server (`psyche.transport`) speaking `protocol`'s messages;
* a tick every 500 ms (the first at once; missed ticks are skipped, not replayed);
* when the run's data location is `Server(addr)`: the TCP data server on that address's port,
  told the clients of every broadcast state;
* with `save_state_dir`: the state is saved at every successful epoch end and when the block
  exits (see `save_state`);
* with `events_dir`: every distinct state is appended to `coordinator/state.bin` (`events`);
* unless `relay_port` is None: a circuit relay (`psyche.network.relay`) that only the run's
  members may use (connected to this server, and clients of the epoch or joining it:
  `may_use_relay`), announced to them (`Relays`) so that clients behind NAT reach each other
  through it.

When the run reaches `Finished` (with `exit_when_finished`, the default), the server waits until
every connected client has disconnected (the clients finish their last checkpoint and exit) or
`finished_grace` seconds have passed, then ends the block by itself: the block's body is
cancelled, the state saved and a summary logged, and `async with` returns normally. A server
started on a state that is already Finished ends at once. Upstream's server idles until killed.

A bad frame or a broken handshake closes that one connection (`psyche.transport`); a message
the coordinator rejects is logged and ignored. A port that cannot be listened on is a
`ServerStartError` naming which of the two ports it is.

Strangers get nothing (see `psyche.coordinator.server_core` and docs/centralized.md): a private run
(`authorized_keys`) refuses other keys right after their handshake; a Join for another run is
answered with a refusal that says so, and the connection closed; every message is screened
before it is decoded (`screen`): a frame longer than the largest message a client can
legitimately send (`protocol.CLIENT_FRAME_LIMIT`, about 22 KB) or than its own kind allows
closes the connection, and a non-member's Witness, HealthCheck or Checkpoint is dropped unread;
nothing a client sends makes the server send more than a bounded amount:
the peers' endpoint records go out at most once per tick, an extension hello is answered once
per connection, and a state broadcast follows only a message that changed the state.
"""

from __future__ import annotations

import errno
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from psyche.centralized.endpoints import EndpointRelay
from psyche.centralized.protocol import (
    CLIENT_FRAME_LIMIT,
    CLIENT_TO_SERVER_CODEC,
    EXTENSIONS_VERSION,
    MEMBER_VARIANTS,
    SERVER_TO_CLIENT_CODEC,
    ClientToServerMessage,
    JoinRun,
    RunExtras,
    ServerToClientMessage,
    VerificationHeard,
    screen_client_message,
)
from psyche.centralized.save_state import save_state
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.model import Checkpoint, HubRepo, LLMTrainingDataLocation
from psyche.coordinator.run_state import RunState
from psyche.coordinator.server_core import DEFAULT_BAN_EPOCHS, ServerCore, TickOutcome
from psyche.coordinator.verification import verification_problem
from psyche.core.cli import short_duration
from psyche.core.node_identity import NodeIdentity
from psyche.transport import (
    AllowDynamic,
    Disconnected,
    Message,
    TcpServer,
    encode_else,
    parse_address,
)

if TYPE_CHECKING:  # imported lazily: the data server needs numpy, the relay libp2p
    # trio-stubs (trio-typing's, a libp2p dependency) shadow trio's own types and predate
    # trio.TaskStatus: the type is trio_typing's there.
    from trio_typing import TaskStatus

    from psyche.centralized.events import EventsWriter
    from psyche.data_provider import DataProviderTcpServer, DataServerInfo
    from psyche.network import Relay

log = logging.getLogger(__name__)

TICK_INTERVAL = 0.5
# How long a finished run's server waits for its clients to leave before it exits anyway.
FINISHED_GRACE = 60.0
# Upstream's Coordinator variant index, then the coordinator's own bytes.
_COORDINATOR_TAG = bytes([ServerToClientMessage.Coordinator.index])


class ServerStartError(Exception):
    """The server cannot start the run as configured; the message says why."""


@dataclass(frozen=True)
class ServerOptions:
    # The address the coordinator listens on (upstream: every interface), and its data server
    # unless `data_server_host` is given.
    host: str = "0.0.0.0"
    # 0: a free port chosen by the OS (upstream's default).
    port: int = 0
    # The public keys that may join (a private run); None: anyone with the run id (upstream).
    authorized_keys: frozenset[bytes] | None = None
    # Epochs a member dropped for not delivering sits out (0: upstream's rules).
    ban_epochs: int = DEFAULT_BAN_EPOCHS
    # The data server's dataset (`data.toml`), required when the data location is Server.
    data_config: DataServerInfo | None = None
    save_state_dir: Path | None = None
    # Which instance of the run this is (`RunExtras.run_identity`): the saved one when the
    # server resumes from its saved state, else None for a new one.
    run_identity: str | None = None
    events_dir: Path | None = None
    init_warmup_time: int | None = None
    withdraw_on_disconnect: bool = True
    tick_interval: float = TICK_INTERVAL
    data_server_host: str | None = None
    # The largest frame a client may send: its largest legitimate message (upstream: 8 MiB).
    max_receive_frame: int = CLIENT_FRAME_LIMIT
    # Whole unix seconds and round seeds; replaceable for tests.
    clock: Callable[[], int] = field(default=lambda: int(time.time()))
    random_u64: Callable[[], int] = field(default=lambda: secrets.randbits(64))
    # Fetch a Hub checkpoint that is not a local directory before starting (upstream does).
    download_checkpoint: bool = True
    # End the server's block once the run is Finished and its clients have left.
    exit_when_finished: bool = True
    finished_grace: float = FINISHED_GRACE
    # The circuit relay the server hosts for the run's members (psyche.network.relay; clients
    # behind NAT reach each other through it): its port (0: a free one), None: no relay.
    relay_port: int | None = 0
    # The address members dial for the relay (default: the bind address, or the address of
    # the default route when bound to every interface).
    relay_announce_host: str | None = None


# --------------------------------------------------------------------------------------------
# Start-up checks for a run whose data this server hosts


def _llm(coordinator: Coordinator) -> Any:
    return coordinator.model.value


def data_server_port(coordinator: Coordinator) -> int | None:
    """The port of the data server this run needs, or None when its data is elsewhere."""
    match _llm(coordinator).data_location:
        case LLMTrainingDataLocation.Server(address):
            try:
                return parse_address(address)[1]
            except ValueError as e:
                raise ServerStartError(
                    f"Failed to parse training data server URL {address!r}: {e}"
                ) from None
    return None


def check_checkpoint_for_hosting(coordinator: Coordinator, *, download: bool) -> None:
    """Upstream's checks of the checkpoint of a run whose data the server hosts.

    Divergence: a P2P checkpoint is accepted when the state has finished an epoch (a resumed
    run: its clients hold the model); upstream refuses every P2P checkpoint, which made its own
    saved states impossible to restart.
    """
    match _llm(coordinator).checkpoint:
        case Checkpoint.Ephemeral():
            raise ServerStartError("Can't start up a run with an Ephemeral checkpoint.")
        case Checkpoint.P2P(_) | Checkpoint.P2PGcs(_):
            if coordinator.progress.epoch == 0:
                raise ServerStartError("Can't start up a run with a P2P checkpoint.")
            log.info(
                "resuming after epoch %d: returning clients share the model peer to peer",
                coordinator.progress.epoch,
            )
        case Checkpoint.Hub(repo):
            if download:
                ensure_hub_repo(repo)
        case Checkpoint.Gcs(repo):
            log.warning(
                "the checkpoint gs://%s is not pre-fetched by this server; clients download it",
                repo.bucket,
            )
        case Checkpoint.Dummy(_):
            pass


def ensure_hub_repo(repo: HubRepo) -> None:
    """A local directory is used as is; anything else is fetched from the Hugging Face Hub."""
    if repo.revision is None and Path(repo.repo_id).is_dir():
        return
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo.repo_id, revision=repo.revision)
    except Exception as e:
        raise ServerStartError(
            f"cannot fetch the model repo {repo.repo_id!r} (revision {repo.revision}) from the "
            f"Hugging Face Hub: {e}"
        ) from e
    log.info("model repo %s is at %s", repo.repo_id, path)


# --------------------------------------------------------------------------------------------
# The server


class CentralizedServer:
    """A running server; made by `open_server`."""

    def __init__(self, core: ServerCore, options: ServerOptions) -> None:
        self.core = core
        self.options = options
        self.run_identity = options.run_identity or secrets.token_hex(16)
        self.relay = EndpointRelay()
        self.p2p_relay: Relay | None = None
        self.tcp: TcpServer[ClientToServerMessage, ServerToClientMessage] | None = None
        self.data_server: DataProviderTcpServer | None = None
        self.events: EventsWriter | None = None
        self.saved: list[Path] = []
        self.ticks = 0
        self._last_run_state = core.coordinator.run_state
        # (old, new, epoch, step) of the latest run-state changes, for dashboards and tests.
        self.transitions: deque[tuple[RunState, RunState, int, int]] = deque(maxlen=1000)
        # Set when the run reaches Finished (at once for a state that was finished already).
        self.finished = trio.Event()
        if core.coordinator.run_state is RunState.Finished:
            self.finished.set()
        self._disconnected = trio.Event()
        self._started = time.monotonic()
        # Endpoint records changed since the last tick, and who was answered an extension hello.
        self._endpoints_dirty = False
        self._greeted: set[bytes] = set()
        # Who watches the run (the status page, trackers): `state_changed(server)` after every
        # change and `witness(sender, step, metadata)` for the statistics of each witness the
        # coordinator accepted, reported for the current step `step` (nothing else a member
        # sends reaches them). Called on the server's loop; they must return at once.
        self.listeners: list[Any] = []

    @property
    def coordinator(self) -> Coordinator:
        return self.core.coordinator

    @property
    def address(self) -> tuple[str, int]:
        assert self.tcp is not None
        return self.tcp.local_addr

    @property
    def port(self) -> int:
        return self.address[1]

    def connected_clients(self) -> list[bytes]:
        return self.tcp.connected_clients() if self.tcp is not None else []

    # -- the loops

    async def tick_loop(self) -> None:
        interval = self.options.tick_interval
        deadline = trio.current_time()
        while True:
            await trio.sleep_until(deadline)
            self.tick()
            now = trio.current_time()
            deadline += interval
            if deadline <= now:  # missed ticks are skipped
                deadline += ((now - deadline) // interval + 1) * interval

    async def end_when_finished(self, scope: trio.CancelScope) -> None:
        """Cancel `scope` (the server's block) once the run is Finished and every connected
        client has left, or `finished_grace` seconds after Finished."""
        await self.finished.wait()
        grace = self.options.finished_grace
        if self.connected_clients():
            log.info(
                "the run is finished; waiting up to %.0f s for %d connected clients to leave",
                grace,
                len(self.connected_clients()),
            )
        with trio.move_on_after(grace):
            while self.connected_clients():
                await self._disconnected.wait()
        if self.connected_clients():
            log.info(
                "%d clients still connected %.0f s after the run finished; stopping anyway",
                len(self.connected_clients()),
                grace,
            )
        scope.cancel()

    def summary(self, saved: Path | None) -> str:
        """One line about the finished run."""
        coordinator = self.coordinator
        progress = coordinator.progress
        tokens = progress.epoch_start_data_index * coordinator.get_sequence_length()
        epochs = f"{progress.epoch} epoch" + ("" if progress.epoch == 1 else "s")
        parts = [epochs, f"{tokens:,} tokens"]
        if self.core.last_reported_loss is not None:
            parts.append(f"last loss reported {self.core.last_reported_loss:.4f}")
        parts.append(f"{short_duration(time.monotonic() - self._started)} served")
        text = (
            f"run {coordinator.run_id!r} finished at step {progress.step} of "
            f"{coordinator.config.total_steps} ({', '.join(parts)})"
        )
        if saved is not None:
            text += f"; state saved to {saved}"
        return text

    async def message_loop(self) -> None:
        assert self.tcp is not None
        async for event in self.tcp:
            match event:
                case Message(client, message):
                    self.on_message(client, message)
                case Disconnected(client):
                    self.on_disconnect(client)

    # -- events

    def screen(self, client: bytes, payload: memoryview) -> bool:
        """The transport's `Screen`, before a message is decoded: a message longer than its
        kind can legitimately be, or of no known kind, closes the connection (raises); a
        Witness, HealthCheck, Checkpoint or Verification from a key the run does not hear (no client of the
        current epoch) is dropped unread and counted. True: decode it."""
        variant = screen_client_message(payload)
        if variant.index in MEMBER_VARIANTS:
            sender = NodeIdentity.from_single_key(client)
            if not self.core.hears(sender):
                self.core.ignore_non_member(sender, variant.variant_name)
                return False
        return True

    def tick(self) -> TickOutcome:
        self.ticks += 1
        if self._endpoints_dirty:
            self._endpoints_dirty = False
            self.send_peer_endpoints()
        outcome = self.core.on_tick(self.options.clock(), self.options.random_u64())
        if outcome.epoch_end:
            progress = self.coordinator.progress
            log.info("epoch %d finished at step %d", progress.epoch - 1, progress.step - 1)
            if self.options.save_state_dir is not None:
                self.save()
        self.post_state_change(broadcast=True)
        return outcome

    def on_message(self, client: bytes, message: ClientToServerMessage) -> None:
        sender = NodeIdentity.from_single_key(client)
        core = self.core
        # Only a member's message can change the run's state: the others cost no more than the
        # handler's check (no state encoding for the events file, no broadcast).
        member = core.client_index(sender) is not None
        broadcast = False
        match message:
            case ClientToServerMessage.Join(JoinRun(run_id)):
                core.on_join(sender, run_id)
                unknown = core.unknown_run(run_id)
                if unknown is not None and self.tcp is not None:
                    # It would wait forever for a run that is not here: say so, and close.
                    self.tcp.refuse(client, unknown, permanent=True)
                    return
                if sender in core.pending_clients and not self.relay.is_joined(client):
                    self.relay.join(client)
                    self._endpoints_dirty = True
            case ClientToServerMessage.Witness(data):
                broadcast = core.on_witness(
                    sender, data, self.options.clock(), self.options.random_u64()
                )
                if core.accepted_witness is not None:  # only what the coordinator accepted
                    _, step, metadata = core.accepted_witness
                    for listener in self.listeners:
                        listener.witness(sender, step, metadata)
            case ClientToServerMessage.HealthCheck(checks):
                broadcast = core.on_health_check(sender, checks)
            case ClientToServerMessage.Checkpoint(checkpoint):
                broadcast = core.on_checkpoint(sender, checkpoint)
            case ClientToServerMessage.Verification(report):
                broadcast = core.on_verification(sender, report)
                if core.accepted_verification is not None:
                    heard = VerificationHeard(*core.accepted_verification)
                    for aware in self.relay.aware_joined():
                        self._send(aware, ServerToClientMessage.VerificationHeard(heard))
            case ClientToServerMessage.ExtensionHello(hello):
                if client in self._greeted:
                    return  # answered once per connection: a repeated hello gets nothing
                self._greeted.add(client)
                if hello.version != EXTENSIONS_VERSION and self.tcp is not None:
                    # its RunExtras would not decode there (nor ours here): say so, and close
                    self.tcp.refuse(
                        client,
                        f"this server speaks version {EXTENSIONS_VERSION} of the port's "
                        f"extensions and the client version {hello.version}: run the same "
                        "psyche version on the server and its clients",
                        permanent=True,
                    )
                    return
                log.debug("client %s speaks extensions (version %d)", sender, hello.version)
                self.relay.mark_aware(client)
                if self.p2p_relay is not None:
                    self._send(client, ServerToClientMessage.Relays(self.p2p_relay.multiaddrs()))
                self._send(client, ServerToClientMessage.RunExtras(self.run_extras()))
                if self.relay.is_joined(client):
                    self._send(
                        client, ServerToClientMessage.PeerEndpoints(self.relay.records_for(client))
                    )
                return
            case ClientToServerMessage.AnnounceEndpoint(record):
                self.relay.mark_aware(client)
                if self.relay.announce(client, record):
                    self._endpoints_dirty = True  # sent with the next tick, at most once a tick
                return
        if member:
            self.post_state_change(broadcast)

    def on_disconnect(self, client: bytes) -> None:
        if self.tcp is not None and client in self.tcp.connected_clients():
            # The client is connected again: this is its old connection's event, delivered
            # after the new connection's first messages (the transport sends it from a task of
            # its own). Acting on it would undo the new connection's Join: the client would sit
            # connected and never pending for the rest of the run (seen under load).
            log.debug("client %s: a disconnect that its new connection overtook", client.hex())
            return
        self.core.on_disconnect(NodeIdentity.from_single_key(client))
        self._greeted.discard(client)
        if self.relay.forget(client):
            self._endpoints_dirty = True
        self.post_state_change(broadcast=False)
        self._disconnected.set()
        self._disconnected = trio.Event()

    def toggle_pause(self) -> None:
        self.core.toggle_pause(self.options.clock())

    # -- outputs

    def is_connected(self, key: bytes) -> bool:
        """Whether `key` has an authenticated connection to this server."""
        return self.tcp is not None and key in self.tcp.connected_clients()

    def may_use_relay(self, key: bytes) -> bool:
        """Who the server's relay serves: a key connected to this server that is a client of
        the run's epoch or has joined it (pending). A key that merely logged in is refused, and
        one that leaves loses its relay connections (the relay asks again every second)."""
        if not self.is_connected(key):
            return False
        identity = NodeIdentity.from_single_key(key)
        return identity in self.core.pending_clients or self.core.client_index(identity) is not None

    def run_extras(self) -> RunExtras:
        return RunExtras(
            backup_data_locations=list(_llm(self.coordinator).backup_data_locations),
            run_identity=self.run_identity,
            verifiers_train=self.coordinator.config.verifiers_train,
            exact_verification_threads=self.coordinator.config.exact_verification_threads,
        )

    def _send(self, client: bytes, message: ServerToClientMessage) -> None:
        if self.tcp is not None:
            self.tcp.send_to(client, message)

    def send_peer_endpoints(self) -> None:
        for client in self.relay.aware_joined():
            self._send(client, ServerToClientMessage.PeerEndpoints(self.relay.records_for(client)))

    def post_state_change(self, broadcast: bool) -> None:
        self.core.after_change()
        coordinator = self.coordinator
        if coordinator.run_state is not self._last_run_state:
            # Entering RoundWitness is routine (the step's RoundTrain line stands for it).
            level = (
                logging.DEBUG if coordinator.run_state is RunState.RoundWitness else logging.INFO
            )
            log.log(
                level,
                "run state: %s -> %s (epoch %d, step %d, %d clients)",
                self._last_run_state.name,
                coordinator.run_state.name,
                coordinator.progress.epoch,
                coordinator.progress.step,
                len(coordinator.epoch_state.clients),
            )
            self.transitions.append(
                (
                    self._last_run_state,
                    coordinator.run_state,
                    coordinator.progress.epoch,
                    coordinator.progress.step,
                )
            )
            self._last_run_state = coordinator.run_state
            if coordinator.run_state is RunState.Finished:
                self.finished.set()
        encoded: bytes | None = None
        if broadcast:
            encoded = coordinator.to_bytes()
            payload = encode_else(_COORDINATOR_TAG + encoded)
            if self.tcp is not None:
                for client in self.tcp.connected_clients():
                    self.tcp.send_encoded(client, payload)
            if self.data_server is not None:
                self.data_server.update_from_coordinator(coordinator)
        if self.events is not None:
            self.events.record(encoded if encoded is not None else coordinator.to_bytes())
        for listener in self.listeners:
            listener.state_changed(self)

    def save(self) -> Path | None:
        directory = self.options.save_state_dir
        if directory is None:
            return None
        try:
            path = save_state(directory, self.core.snapshot(), self.run_identity)
        except (OSError, ValueError) as e:
            log.error("Error saving state to %s: %s", directory, e)
            return None
        log.info("Saved state to %s", path)
        self.saved.append(path)
        return path


@asynccontextmanager
async def open_server(
    coordinator: Coordinator, options: ServerOptions | None = None
) -> AsyncIterator[CentralizedServer]:
    """Start a server for `coordinator` (a loaded state file); it runs until the block exits,
    then saves its state when `options.save_state_dir` is set."""
    options = options or ServerOptions()
    core = ServerCore.start(
        coordinator,
        now=options.clock(),
        init_warmup_time=options.init_warmup_time,
        withdraw_on_disconnect=options.withdraw_on_disconnect,
        authorized=options.authorized_keys,
        ban_epochs=options.ban_epochs,
    )
    unrunnable = verification_problem(core.coordinator.config)
    if unrunnable is not None:
        raise ServerStartError(f"{unrunnable[0]}: {unrunnable[1]}")
    server = CentralizedServer(core, options)
    data_port = data_server_port(core.coordinator)
    provider: Any = None
    if data_port is not None:
        check_checkpoint_for_hosting(core.coordinator, download=options.download_checkpoint)
        if options.data_config is None:
            raise ServerStartError(
                "Coordinator state requires we host training data, but no --data-config passed."
            )
        try:
            provider = options.data_config.open_provider()
        except Exception as e:
            raise ServerStartError(
                f"cannot open the training data in {options.data_config.dir}: {e}"
            ) from e

    async with AsyncExitStack() as stack:
        if provider is not None:
            from psyche.data_provider import DataProviderTcpServer

            assert data_port is not None  # a provider is opened only for a data port
            stack.callback(provider.close)
            address = _llm(core.coordinator).data_location.value
            with _naming_the_port(
                f"the data server's port {data_port} (data_location {address} in the state file)"
                + _on(options.data_server_host or options.host)
            ):
                data_server = await stack.enter_async_context(
                    DataProviderTcpServer.start(
                        provider,
                        host=options.data_server_host or options.host,
                        port=data_port,
                    )
                )
            server.data_server = data_server
            data_server.update_from_coordinator(core.coordinator)
            log.info("training data server listening on %s:%d", *data_server.local_addr)
        if options.events_dir is not None:
            from psyche.centralized.events import EventsWriter

            server.events = EventsWriter(options.events_dir)
            stack.callback(server.events.close)
        with _naming_the_port(
            f"the coordinator port {options.port} (--server-port)" + _on(options.host)
        ):
            server.tcp = await stack.enter_async_context(
                TcpServer.start(
                    to_server=CLIENT_TO_SERVER_CODEC,
                    to_client=SERVER_TO_CLIENT_CODEC,
                    host=options.host,
                    port=options.port,
                    max_receive_frame=options.max_receive_frame,
                    screen=server.screen,
                    # a private run refuses other keys right after their handshake
                    allowlist=(
                        None
                        if options.authorized_keys is None
                        else AllowDynamic(options.authorized_keys)
                    ),
                )
            )
        if options.relay_port is not None:
            from psyche.core.identity import SecretKey
            from psyche.network import RelayOptions, open_relay

            with _naming_the_port(f"the relay port {options.relay_port} (--relay-port)"):
                server.p2p_relay = await stack.enter_async_context(
                    open_relay(
                        SecretKey.generate(),
                        server.may_use_relay,
                        RelayOptions(
                            bind_host=options.host,
                            port=options.relay_port,
                            announce_host=options.relay_announce_host,
                        ),
                    )
                )
        nursery = await stack.enter_async_context(trio.open_nursery())
        nursery.start_soon(server.message_loop)
        nursery.start_soon(server.tick_loop)
        for drop_log in (*core.drop_logs, server.relay.refused):
            nursery.start_soon(drop_log.run)
        if options.exit_when_finished:
            nursery.start_soon(server.end_when_finished, nursery.cancel_scope)
        log.info(
            "serving run %r on port %d (%s); %s",
            core.run_id,
            server.port,
            "all interfaces" if options.host in ("0.0.0.0", "::", "") else options.host,
            who_may_join(options.authorized_keys),
        )
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()
            saved = server.save()
            if server.finished.is_set():
                log.info("%s", server.summary(saved))


def _on(host: str) -> str:
    """Where a port is listened on, for error messages (nothing for every interface)."""
    return "" if host in ("0.0.0.0", "::", "") else f" on {host} (--bind-address)"


def who_may_join(authorized_keys: frozenset[bytes] | None) -> str:
    """The start-up line's word on who may join."""
    if authorized_keys is None:
        return "open run: anyone may join"
    count = len(authorized_keys)
    return f"private run: {count} authorized key{'' if count == 1 else 's'}"


@contextmanager
def _naming_the_port(what: str) -> Iterator[None]:
    """An OSError while listening becomes a `ServerStartError` that says which port."""
    try:
        yield
    except BaseException as e:
        cause = e
        while isinstance(cause, BaseExceptionGroup) and len(cause.exceptions) == 1:
            cause = cause.exceptions[0]
        if not isinstance(cause, OSError):
            raise
        if cause.errno == errno.EADDRINUSE:
            problem = "is already in use (another server, or another program, listens there)"
        else:
            problem = f"cannot be listened on: {cause.strerror or cause}"
        raise ServerStartError(f"{what} {problem}") from None


async def serve_coordinator(
    coordinator: Coordinator,
    options: ServerOptions | None = None,
    *,
    task_status: TaskStatus[CentralizedServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `coordinator` until cancelled (`nursery.start(serve_coordinator, ...)` returns the
    running server). The whole `psyche-server run`, from its options, is
    `psyche.centralized.run.run_server`."""
    async with open_server(coordinator, options) as server:
        task_status.started(server)
        await trio.sleep_forever()


__all__ = [
    "TICK_INTERVAL",
    "CentralizedServer",
    "ServerOptions",
    "ServerStartError",
    "check_checkpoint_for_hosting",
    "data_server_port",
    "ensure_hub_repo",
    "open_server",
    "serve_coordinator",
    "who_may_join",
]
