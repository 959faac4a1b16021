"""Running the centralized server from its options (upstream's server `main.rs`): what
`psyche-server run` and `validate-config` do, callable from Python.

    from psyche.centralized.options import ServerRunOptions
    from psyche.centralized.run import run_server

    code = run_server(ServerRunOptions(state=Path("state.toml"), tui=False))

`run_server` serves until SIGINT or SIGTERM (exit status 0), or until the run is finished and
its clients have left (0); a run that cannot start is one logged line and 1. It installs its
signal handlers, so it runs in the main thread. Inside a trio program, `open_run` is the same
server as an async context manager: it loads the state, serves the run with its status page,
dashboard and trackers while the block runs, and saves the state when the block exits.

Start-up order: the trackers first (a tracker that cannot work is one line before anything
else), then the state (`--state`: a file, or the newest save of a save-state directory), the
data config and the authorized keys, each a one-line `ServerStartError` naming the file when it
is wrong; then the server (`psyche.centralized.server.open_server`) with the settings it owns,
`ServerOptions`, built from these options (`server_options`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from psyche.centralized.options import ServerRunOptions

if TYPE_CHECKING:
    from rich.console import Console

    from psyche.centralized.server import CentralizedServer, ServerOptions
    from psyche.coordinator.coordinator import Coordinator
    from psyche.data_provider.data_config import DataServerInfo
    from psyche.metrics import Tracker

log = logging.getLogger(__name__)

SERVICE_NAME = "psyche-centralized-server"
"""Upstream's OpenTelemetry service name for the server."""


# --------------------------------------------------------------------------------------------
# validate-config


def validate_config(state: Path, data_config: Path | None) -> int:
    """Check a run configuration as `run --state` would read it, and its data config: a
    one-line summary on stdout and 0 when valid, every problem on stderr and 1 otherwise."""
    from psyche.centralized.save_state import SavedStateError, resolve_state_path
    from psyche.coordinator.run_config import ConfigFileError, load_run_config
    from psyche.coordinator.verification import verification_problem

    try:
        # the same path as `run --state`: a file, or the newest save of a save-state directory
        loaded = load_run_config(resolve_state_path(state))
    except (ConfigFileError, SavedStateError) as e:
        print(f"Error found in config: {e}", file=sys.stderr)
        return 1
    for warning in loaded.warnings:
        print(f"warning: {state}: {warning}", file=sys.stderr)
    # A config upstream loads but no run can honour (upstream panics once it runs): refused.
    unrunnable = verification_problem(loaded.config)
    if unrunnable is not None:
        where, why = unrunnable
        print(f"Error found in config: {state}: {where}: {why}", file=sys.stderr)
        return 1
    lines = [loaded.summary()]
    if data_config is not None:
        from psyche.data_provider.data_config import DataConfigError, DataServerInfo

        try:
            data = DataServerInfo.load(data_config)
        except DataConfigError as e:
            print(f"Error found in data config: {e}", file=sys.stderr)
            return 1
        if data.seq_len != loaded.llm.max_seq_len:
            print(
                f"warning: {data_config}: seq_len {data.seq_len} differs from the run's "
                f"max_seq_len {loaded.llm.max_seq_len}",
                file=sys.stderr,
            )
        if not Path(data.dir).is_dir():
            print(
                f"warning: {data_config}: data directory {data.dir} does not exist (yet)",
                file=sys.stderr,
            )
        lines.append(f"data server: {data.dir} ({data.token_size.name}, seq_len {data.seq_len})")
    print("Configs are OK! " + "; ".join(lines))
    return 0


# --------------------------------------------------------------------------------------------
# run


def setup_logging(tui: bool) -> Console | None:
    """Plain logs on stderr, or rich logs above the dashboard; returns the rich console."""
    from psyche.core.cli import apply_log_directives, log_directives_from_environment

    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    console = None
    handler: logging.Handler
    if tui:
        from rich.console import Console
        from rich.logging import RichHandler

        console = Console()
        handler = RichHandler(console=console, show_path=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    apply_log_directives(log_directives_from_environment())
    return console


def run_server(options: ServerRunOptions) -> int:
    """Serve the run of `options` until SIGINT or SIGTERM or its end (see the module); the
    exit status. The dashboard is drawn only when stdin and stdout are terminals."""
    tui = options.tui
    if tui and not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("psyche-server: not a terminal; running with --tui false", file=sys.stderr)
        tui = False
    console = setup_logging(tui)
    from psyche.metrics import ServiceInfo, build_tracker

    # before anything else: a tracker that cannot work is one line (TrackerConfigError)
    tracker = build_tracker(
        options.tracker_config(),
        service=ServiceInfo.from_env(SERVICE_NAME, "server", scope="psyche_server"),
        run_name="psyche-server",
    )
    try:
        return _serve_until_signalled(options, console, tracker)
    finally:
        tracker.finish()


def _serve_until_signalled(
    options: ServerRunOptions, console: Console | None, tracker: Tracker
) -> int:
    import signal

    import trio

    from psyche.centralized.server import ServerStartError
    from psyche.core.cli import run_serving, serve_until_signalled

    async def serve() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with (
                open_run(options, tracker=tracker, console=console),
                trio.open_nursery() as nursery,
            ):
                await serve_until_signalled(signals, nursery, log)

    return run_serving(serve, log, {ServerStartError: "%s", OSError: "cannot start the server: %s"})


@asynccontextmanager
async def open_run(
    options: ServerRunOptions, *, tracker: Tracker | None = None, console: Console | None = None
) -> AsyncIterator[CentralizedServer]:
    """The server of `options` while the block runs: loaded (`load_run`), serving, with its
    status page (`status_port`), `tracker` logging what it does and its dashboard drawn on
    `console` (None: neither). The block ends early, cancelled, when the run is finished; the
    state is saved when it exits (`save_state_dir`). A run that cannot start is a
    `ServerStartError`; a status page port that cannot be listened on, an `OSError`."""
    from functools import partial

    import trio

    from psyche.centralized.server import open_server
    from psyche.centralized.status_page import StatusHistory, serve_status, snapshot
    from psyche.centralized.telemetry import ServerTracker

    loaded = load_run(options)
    history = StatusHistory()
    async with (
        open_server(loaded.coordinator, server_options(options, loaded)) as server,
        trio.open_nursery() as nursery,
    ):
        server.listeners.append(history)
        if tracker is not None:
            server.listeners.append(ServerTracker(tracker, history))
        if options.status_port is not None:
            with _naming_the_status_port(options):
                await nursery.start(
                    partial(
                        serve_status,
                        partial(snapshot, server, history),
                        options.status_bind_address,
                        options.status_port,
                    )
                )
        if console is not None:
            from psyche.centralized.dashboard import run_dashboard

            nursery.start_soon(run_dashboard, server, console)
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()


@contextmanager
def _naming_the_status_port(options: ServerRunOptions) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise OSError(
            f"the status page port {options.status_port} (--status-port) on "
            f"{options.status_bind_address}: {e.strerror or e}"
        ) from None


@dataclass(frozen=True)
class LoadedRun:
    """What the server starts from, read from the files the options name."""

    coordinator: Coordinator
    data_config: DataServerInfo | None
    run_identity: str | None
    """The saved instance of the run when it resumes from a save (None: a new instance)."""
    authorized_keys: frozenset[bytes] | None


def load_run(options: ServerRunOptions) -> LoadedRun:
    """Read the state, the data config and the authorized keys; a `ServerStartError` naming
    the file and the problem when one is wrong."""
    from psyche.centralized.save_state import (
        SavedStateError,
        load_state,
        resolve_state_path,
        saved_run_identity,
    )
    from psyche.centralized.server import ServerStartError
    from psyche.coordinator.run_config import ConfigFileError

    try:
        state_path = resolve_state_path(options.state)
        coordinator = load_state(state_path)
    except (ConfigFileError, SavedStateError) as e:
        raise ServerStartError(f"Error found in config: {e}") from None
    data_config = None
    if options.data_config is not None:
        from psyche.data_provider.data_config import DataConfigError, DataServerInfo

        try:
            data_config = DataServerInfo.load(options.data_config)
        except DataConfigError as e:
            raise ServerStartError(f"Error found in data config: {e}") from None
    run_identity = None  # a state file a person wrote starts a new instance of the run
    if coordinator.run_state_start_unix_timestamp != 0:
        log.info(
            "resuming run %r from %s: epoch %d, step %d",
            coordinator.run_id,
            state_path,
            coordinator.progress.epoch,
            coordinator.progress.step,
        )
        run_identity = saved_run_identity(state_path)
    return LoadedRun(
        coordinator=coordinator,
        data_config=data_config,
        run_identity=run_identity,
        authorized_keys=_authorized_keys(options.authorized_keys),
    )


def _authorized_keys(path: Path | None) -> frozenset[bytes] | None:
    if path is None:
        return None
    from psyche.centralized.server import ServerStartError
    from psyche.data_provider.server import read_allow_file

    try:
        keys = frozenset(read_allow_file(path))
    except (OSError, UnicodeDecodeError) as e:
        raise ServerStartError(f"cannot read the authorized keys {path}: {e}") from None
    except ValueError as e:
        raise ServerStartError(f"authorized keys: {e}") from None
    if not keys:
        raise ServerStartError(f"{path} lists no key: nobody could join this run")
    return keys


def server_options(options: ServerRunOptions, loaded: LoadedRun) -> ServerOptions:
    """The server's own settings, from the options and what they named."""
    from psyche.centralized.server import ServerOptions

    return ServerOptions(
        host=options.bind_address,
        authorized_keys=loaded.authorized_keys,
        ban_epochs=options.ban_epochs,
        port=options.server_port or 0,
        data_config=loaded.data_config,
        save_state_dir=options.save_state_dir,
        run_identity=loaded.run_identity,
        events_dir=options.events_dir,
        init_warmup_time=options.init_warmup_time,
        withdraw_on_disconnect=options.withdraw_on_disconnect,
        relay_port=(options.relay_port or 0) if options.relay else None,
        relay_announce_host=options.relay_announce_address,
    )


__all__ = [
    "LoadedRun",
    "ServerRunOptions",
    "load_run",
    "open_run",
    "run_server",
    "server_options",
    "setup_logging",
    "validate_config",
]
