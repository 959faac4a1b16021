"""Running the training client from its options, whatever the backend (what upstream's client
binaries share: shared/client/src/cli.rs and the `app.rs` of each binary).

A client command parses its options (`psyche.client.setup.options`), sets up logging
(`setup_logging`), builds its backend's connector and calls `run_client`:

    options = TrainOptions.from_args(args).check()
    setup_logging(options)
    connect = partial(CentralizedBackend.connect, addr, key, options.run_id)
    return run_client(options, identity, key, connect, network_config(options, key))

Start-up order: the client reaches its coordinator first, so that within a second it says what
it is waiting for, while torch and transformers load in a worker thread (seconds); it joins the
run once they are loaded (so it is ready when the warmup starts), then starts the network and
the training client. Nothing here imports torch until the client runs.

What the client reports goes to its observers (`psyche.client.observe.telemetry`): the trackers the
options ask for (built before anything else, so a misconfigured one is a one-line error, and
finished within their timeout when the client ends), the `--events-dir` files and the
`--logs tui` dashboard. `--eval-tasks` datasets are read once the coordinator is reached.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from psyche.client.background import in_abandoned_thread
from psyche.client.checkpoints.gcs import storage_client
from psyche.client.checkpoints.store import (
    CheckpointConfig,
    check_hub_repo_writable,
    remove_stale_staging,
)
from psyche.client.checkpoints.upload import GcsUpload, HubUpload, UploadTarget
from psyche.client.observe.evals import EvalSettings
from psyche.client.observe.event_files import EventFiles
from psyche.client.observe.logs import setup_logging as setup_client_logging
from psyche.client.observe.telemetry import Observers, TrackerObserver, client_tracker
from psyche.client.observe.tui import Dashboard, DashboardState
from psyche.client.round.broadcast import open_network
from psyche.client.setup.cpu_threads import set_cpu_threads
from psyche.client.setup.options import OptionError, TrainOptions
from psyche.client.setup.workers import WorkerGroup
from psyche.core.cli import (
    apply_log_directives,
    interrupt_exit_code,
    interrupt_on_signal,
    interrupted_by,
    log_directives_from_environment,
    single_cause,
    user_error_message,
)

if TYPE_CHECKING:
    # The client, its set-up and the model loaders import torch and libp2p: they are imported
    # where they are used, in a worker thread or once the coordinator is reached (module doc).
    from psyche.client.client import Client
    from psyche.client.setup.init import RunInitConfig
    from psyche.core.identity import SecretKey
    from psyche.core.node_identity import NodeIdentity
    from psyche.network import EndpointAddr, NetworkConfig, NetworkConnection

log = logging.getLogger("psyche.client.run")

BeforeJoin = Callable[[], Awaitable[None]]


class ConnectBackend(Protocol):
    """Opens the backend (a `psyche.coordinator.backend.Backend`) for the block, and awaits
    `before_join` (the heavy modules are loaded) before it joins the run."""

    def __call__(self, *, before_join: BeforeJoin) -> AbstractAsyncContextManager[Any]: ...


TrainOnBackend = Callable[[Any, "Client", "NetworkConnection"], Awaitable[None]]
"""Runs the client on the backend until it is done (default: `client.run()`)."""


def setup_logging(options: TrainOptions) -> None:
    """Logging as `--logs`, `--write-log` and `PSYCHE_LOG`/`RUST_LOG` say, plus the notes
    about options that are accepted but ignored."""
    mode = options.logs
    if mode == "tui-and-console":
        mode = "tui"
    setup_client_logging("console" if mode == "none" else mode, write_log=options.write_log)
    if mode == "none":
        logging.getLogger().setLevel(logging.CRITICAL + 10)
    else:
        apply_log_directives(log_directives_from_environment())
    if options.metrics_local_port is not None:
        log.warning(
            "--metrics-local-port %s: local metrics are not built; ignored",
            options.metrics_local_port,
        )


def network_config(
    options: TrainOptions, key: SecretKey, bootstrap_peers: Sequence[EndpointAddr] = ()
) -> NetworkConfig:
    """The peer-to-peer network's configuration from the options."""
    from psyche.network import NetworkConfig, default_local_discovery_dir

    return NetworkConfig(
        run_id=options.run_id,
        secret_key=key,
        interface=options.bind_p2p_interface,
        port=options.bind_p2p_port or 0,
        bootstrap_peers=tuple(bootstrap_peers),
        relays=options.relay_addrs(),
        local_discovery_dir=(
            default_local_discovery_dir() if options.iroh_discovery == "local" else None
        ),
    )


def run_init_config(options: TrainOptions, identity: NodeIdentity, key: SecretKey) -> RunInitConfig:
    """The client's `RunInitConfig` from the options (checks a hub repo is writable and
    removes checkpoint staging directories a killed client left behind)."""
    from psyche.client.setup.init import RunInitConfig  # torch: called in a worker thread

    checkpoint = None
    if options.checkpoint_dir is not None:
        token = os.environ.get("HF_TOKEN")
        upload: UploadTarget | None = None
        if options.hub_repo is not None:
            assert token is not None  # checked with the options
            check_hub_repo_writable(options.hub_repo, token)
            upload = HubUpload(options.hub_repo, token)
        elif options.gcs_bucket is not None:
            storage_client()  # fails early without google-cloud-storage
            upload = GcsUpload(options.gcs_bucket, options.gcs_prefix)
        checkpoint = CheckpointConfig(Path(options.checkpoint_dir), upload, options.keep_policy)
        remove_stale_staging(checkpoint.checkpoint_dir)
    return RunInitConfig(
        identity=identity,
        secret_key=key,
        run_id=options.run_id,
        device=options.device,
        trainer=options.trainer,
        max_concurrent_parameter_requests=options.max_concurrent_parameter_requests,
        write_gradients_dir=options.write_gradients_dir,
        checkpoint=checkpoint,
    )


class Preload:
    """Torch, transformers and libp2p imported (and `--device` checked) in a worker thread,
    so the model loads quickly once the run's warmup starts (importing them takes seconds) and
    the trio loop keeps talking to the coordinator meanwhile. `wait()` returns once they are
    loaded; an unusable device is an `OptionError` (exit 2). With several ranks (`workers`)
    it also starts them and joins their process group. Torch's CPU threads are set here, with
    the device (`psyche.client.setup.cpu_threads`), before any model is built."""

    def __init__(
        self, device: str, workers: WorkerGroup | None = None, cpu_threads: int | None = None
    ) -> None:
        self.device = device
        self.workers = workers
        self.cpu_threads = cpu_threads
        self._done = trio.Event()

    async def run(self) -> None:
        await in_abandoned_thread(self._load)
        self._done.set()

    def _load(self) -> None:
        from psyche.client.setup.model_loading import check_device, preload_modeling
        from psyche.modeling.causal_lm import ModelLoadError

        log.debug("loading torch and transformers")
        preload_modeling()
        from psyche.modeling.parallel import ParallelismError
        from psyche.network import NetworkConnection  # noqa: F401  (loads libp2p here)

        try:
            if self.workers is not None:
                self.workers.start()
            else:
                set_cpu_threads(self.cpu_threads, check_device(self.device))
        except (ModelLoadError, ParallelismError) as e:
            raise OptionError(str(e)) from None

    async def wait(self) -> None:
        if not self._done.is_set():
            log.info("loading torch and transformers before joining (a few seconds)")
        await self._done.wait()


async def _watch_workers(preload: Preload, workers: WorkerGroup) -> None:
    """Once the ranks have started, a rank that exits stops the client (`WorkerDied`)."""
    await preload._done.wait()
    await workers.watch()


async def _run_on_client(backend: Any, client: Client, network: NetworkConnection) -> None:
    await client.run()


def run_client(
    options: TrainOptions,
    identity: NodeIdentity,
    key: SecretKey,
    connect: ConnectBackend,
    network: NetworkConfig,
    train: TrainOnBackend = _run_on_client,
    *,
    service: str = "psyche-client",
    observers: Sequence[Any] = (),
) -> int:
    """Train on the run until it ends: open the backend (`connect`) while `Preload` loads the
    heavy modules, build the client's `RunInitConfig` once they are loaded, open the network
    and `train` the `Client` on the backend.

    The exit code: 0; 130 (143 after SIGTERM) when interrupted; a failure with an `exit_code`
    attribute (another client version) is logged in one line and ends with that code; anything
    else is raised for the command to report (`psyche.core.cli`: one line for a user error, the
    traceback for a bug).

    `service` names the client in OpenTelemetry exports; `observers` hear about the run
    besides the ones the options ask for (`psyche.client.observe.telemetry.RunObserver`)."""
    watchers, closers = run_observers(options, identity, service)
    watchers.observers.extend(observers)
    dashboard = open_dashboard(options, identity)
    if dashboard is not None:
        watchers.add(dashboard.observer)

    layout = options.ranks
    workers = WorkerGroup(layout) if layout.needed else None
    if workers is not None:
        closers.append(workers.close)

    async def main(preload: Preload) -> None:
        async with connect(before_join=preload.wait) as backend:
            config = await trio.to_thread.run_sync(run_init_config, options, identity, key)
            if workers is not None:
                assert workers.dims is not None
                config = replace(config, device=str(workers.dims.device), workers=workers)
            evals = None
            if options.evals.enabled:
                evals = await trio.to_thread.run_sync(EvalSettings.from_options, options.evals)
            from psyche.client.client import Client  # libp2p and torch: loaded by now

            follow = options.iroh_relay == "psyche" and hasattr(backend, "relays_changed")
            run_relays = getattr(backend, "relays", []) if options.iroh_relay == "psyche" else []
            relays = tuple(dict.fromkeys((*network.relays, *run_relays)))
            async with (
                open_network(replace(network, relays=relays)) as connection,
                trio.open_nursery() as nursery,
            ):
                if follow:  # the relay a restarted server hosts has a new address
                    nursery.start_soon(_follow_relays, backend, connection)
                client = Client(backend, connection, config, observers=watchers, evals=evals)
                await train(backend, client, connection)
                nursery.cancel_scope.cancel()

    async def both() -> None:
        preload = Preload(options.device, workers, options.cpu_threads)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(preload.run)
            if workers is not None:
                nursery.start_soon(_watch_workers, preload, workers)
            await main(preload)
            nursery.cancel_scope.cancel()

    async def until_signalled() -> None:
        async with interrupt_on_signal():
            await both()

    try:
        if dashboard is None:
            trio.run(until_signalled)
        else:
            try:
                dashboard.run_trio(both)
            finally:
                dashboard.give_back_console_logging()
    except BaseException as e:  # judged by the root cause, not the nursery's exception group
        _close_all(closers)
        root = single_cause(e)
        if isinstance(root, KeyboardInterrupt):
            log.info("interrupted by %s; exiting", interrupted_by())
            return interrupt_exit_code()
        if user_error_message(root) is None and hasattr(root, "exit_code"):
            log.error("client stopped: %s", root)
            return int(root.exit_code)
        raise
    _close_all(closers)
    return 0


def run_observers(
    options: TrainOptions, identity: NodeIdentity, service: str
) -> tuple[Observers, list[Callable[[], None]]]:
    """The observers the options ask for (trackers, `--events-dir`), and how to close each
    (bounded: the trackers get their finish timeout). A tracker that cannot work is a
    `TrackerConfigError`, one line."""
    tracker = client_tracker(
        options.trackers,
        identity,
        service,
        run_id=options.run_id,
        run_config={"micro_batch_size": options.micro_batch_size, "device": options.device},
    )
    observers = Observers([TrackerObserver(tracker)])
    closers: list[Callable[[], None]] = [tracker.finish]
    if options.events_dir is not None:
        events = EventFiles(
            Path(options.events_dir) / str(identity),
            run_id=options.run_id,
            node_id=str(identity),
            keep=options.keep_event_files,
        )
        observers.add(events)
        closers.append(events.close)
    return observers, closers


def open_dashboard(options: TrainOptions, identity: NodeIdentity) -> Dashboard | None:
    """The `--logs tui` dashboard, taking the console's log lines into its panel; None for
    the other log modes, or (with a warning) when stdout is not a terminal."""
    import sys

    if options.logs not in ("tui", "tui-and-console"):
        return None
    if not (sys.stdout.isatty() and sys.stdin.isatty()):
        log.warning("--logs %s: not a terminal; logging to the console instead", options.logs)
        return None
    dashboard = Dashboard(DashboardState(options.run_id, str(identity)))
    dashboard.take_console_logging()
    return dashboard


def _close_all(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        try:
            close()
        except Exception as e:  # closing must not hide how the run ended
            log.warning("closing %s failed: %s", getattr(close, "__qualname__", close), e)


async def _follow_relays(backend: Any, connection: NetworkConnection) -> None:
    """Hand the network every relay the coordinator server names from now on."""
    while True:
        await backend.relays_changed.wait()
        connection.add_relays(backend.relays)


__all__ = [
    "ConnectBackend",
    "Preload",
    "TrainOnBackend",
    "network_config",
    "run_client",
    "run_init_config",
    "run_observers",
    "setup_logging",
]
