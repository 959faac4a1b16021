"""`psyche-server`: validate run configurations, run a centralized coordinator server, or run only
its circuit relay (`relay`, for runs without a centralized server)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from psyche.core.cli import (
    EnvOptions,
    add_verbose_flag,
    apply_log_directives,
    command_parser,
    log_directives_from_environment,
    parse_bool,
    parse_unsigned,
    run_command,
    serve_until_signalled,
    single_cause,
)

PROG = "psyche-server"
DESCRIPTION = """\
The Psyche centralized coordinator server.

It owns a run's coordinator state machine, ticks it forward every 500 ms and talks to training
clients over TCP. Start by checking a configuration with `validate-config`, then `run` it.
Every option of `run` can also be given in the environment, named in upper snake case
(--server-port: SERVER_PORT). `run` serves until SIGINT (Ctrl+C) or SIGTERM and then exits 0.
Errors are one line; --verbose (or PSYCHE_VERBOSE=1) adds their traceback."""

log = logging.getLogger("psyche.cli.server")


def build_parser() -> tuple[argparse.ArgumentParser, EnvOptions]:
    """The parser, and the environment fallbacks of `run`'s options (resolved after parsing)."""
    parser, commands = command_parser(PROG, DESCRIPTION)

    validate = commands.add_parser(
        "validate-config",
        help="Checks that the configuration declared in the state.toml file is valid",
        description=(
            "Checks that a run configuration is valid: the TOML schema (every field, its type "
            "and range, no unknown keys), then the coordinator's own rules (timings, client "
            "counts, batch sizes) in upstream's order. Accepts a state file (with run_id and "
            "run_state) or a plain run config ([config] and [model] only). Prints a one-line "
            "summary and exits 0 when valid; prints every problem with its TOML path and exits "
            "1 otherwise."
        ),
    )
    validate.add_argument(
        "--state",
        required=True,
        type=Path,
        metavar="<STATE>",
        help="Path to the state.toml file to validate",
    )
    validate.add_argument(
        "--data-config",
        type=Path,
        metavar="<DATA_CONFIG>",
        help="Path to data.toml file to validate. If not provided then it will not be checked",
    )

    run = commands.add_parser(
        "run",
        help="Starts the server and launches the coordinator with the declared configuration",
        description=(
            "Starts the coordinator server for the run in --state and serves it until Ctrl+C "
            "(or SIGTERM). --state may also name a --save-state-dir: the run resumes from the "
            "newest state saved there."
        ),
    )
    env = EnvOptions()
    env.add(
        run,
        "--state",
        parse=Path,
        required=True,
        metavar="<STATE>",
        help="Path to TOML of Coordinator state, or a save-state directory to resume from",
    )
    env.add(
        run,
        "--server-port",
        short="-s",
        parse=parse_unsigned(16),
        help=(
            "Port for the server, which clients will use to connect. if not specified, a random "
            "free port will be chosen."
        ),
    )
    env.add(
        run,
        "--bind-address",
        default="0.0.0.0",
        metavar="<ADDRESS>",
        help=(
            "Address the coordinator and its data server listen on (0.0.0.0: every interface, "
            "as upstream; 127.0.0.1: this machine only)"
        ),
    )
    env.add(
        run,
        "--authorized-keys",
        parse=Path,
        metavar="<FILE>",
        help=(
            "Make the run private: only the ed25519 public keys in FILE (64 hex digits each, one "
            "a line, # comments) may connect and join. Without it anyone with the run id may join"
        ),
    )
    env.add(
        run,
        "--ban-epochs",
        parse=parse_unsigned(16),
        default=1,
        metavar="<EPOCHS>",
        help=(
            "Epochs a member sits out after being dropped for not delivering (its training "
            "missing at a health check, or elected witness of a round that ended without a "
            "witness); twice its last ban when it does so again soon after one (up to 64); "
            "0 re-admits it at once, as upstream"
        ),
    )
    env.add(
        run,
        "--tui",
        parse=parse_bool,
        optional_value=True,
        default=True,
        metavar="<TUI>",
        help="Show the live dashboard (Ctrl+P pauses/resumes); false logs plainly",
    )
    env.add(
        run,
        "--relay",
        parse=parse_bool,
        optional_value=True,
        default=True,
        metavar="<RELAY>",
        help=(
            "Host a circuit relay for the run's clients, so that clients behind NAT reach each "
            "other through it (only clients connected to this server may use it)"
        ),
    )
    env.add(
        run,
        "--relay-port",
        parse=parse_unsigned(16),
        help="Port of the relay (a random free port if not specified)",
    )
    env.add(
        run,
        "--relay-announce-address",
        metavar="<ADDRESS>",
        help=(
            "Address clients dial for the relay (default: --bind-address, or the address of "
            "the default route when that is 0.0.0.0)"
        ),
    )
    env.add(run, "--data-config", parse=Path, help="Path to TOML of data server config")
    env.add(
        run,
        "--save-state-dir",
        parse=Path,
        help="Path to save the server and coordinator state (at each epoch end and on exit)",
    )
    env.add(
        run,
        "--events-dir",
        parse=Path,
        help=(
            "Directory to write event files for the observer. Coordinator state changes are "
            "appended to {events_dir}/coordinator/state.bin (format: docs/centralized.md)"
        ),
    )
    env.add(
        run,
        "--init-warmup-time",
        parse=parse_unsigned(64),
        help=(
            "Sets the warmup time for the run. This overrides the warmup_time declared in the "
            "state file."
        ),
    )
    env.add(
        run,
        "--withdraw-on-disconnect",
        parse=parse_bool,
        optional_value=True,
        default=True,
        metavar="<WITHDRAW_ON_DISCONNECT>",
        help="Automatically withdraw clients that disconnect from the server",
    )
    for flag, what in (
        ("--oltp-auth-header", "An auth header string for an opentelemetry endpoint"),
        ("--oltp-metrics-url", "A URL for sending opentelemetry metrics (OTLP/HTTP)"),
        ("--oltp-tracing-url", "A URL for sending opentelemetry traces (OTLP/HTTP)"),
        ("--oltp-logs-url", "A URL for sending opentelemetry logs (OTLP/HTTP)"),
    ):
        env.add(run, flag, help=what)
    env.add(
        run,
        "--oltp-report-interval",
        parse=float,
        default=60.0,
        metavar="<SECONDS>",
        help="Seconds between two OpenTelemetry metric exports",
    )
    env.add(
        run,
        "--metrics-jsonl",
        parse=Path,
        metavar="<FILE>",
        help=(
            "Append the run's state, membership and round durations to FILE, one JSON object a "
            "line (logged whenever they change)"
        ),
    )
    env.add(
        run,
        "--status-port",
        parse=parse_unsigned(16),
        metavar="<PORT>",
        help=(
            "Serve a read-only status page on this port: / (HTML) and /status.json (run state, "
            "members and their health, round durations, the loss curve clients report). Off "
            "unless given; 0 picks a free port"
        ),
    )
    env.add(
        run,
        "--status-bind-address",
        default="127.0.0.1",
        metavar="<ADDRESS>",
        help="Address the status page listens on (this machine only unless told otherwise)",
    )
    add_relay_command(commands)
    add_verbose_flag(parser)
    return parser, env


def add_relay_command(commands: Any) -> None:
    """The `relay` subcommand; its environment fallbacks travel in `args.relay_env`."""
    env = EnvOptions()
    relay = commands.add_parser(
        "relay",
        help="Runs only a circuit relay, for clients behind NAT in runs without this server",
        description=(
            "Runs the circuit relay that `run` hosts, on its own (for Solana runs): clients "
            "behind NAT reserve a slot on it and reach each other through it. Give clients "
            "its address (printed at start) with --iroh-relay. Only the keys of "
            "--authorized-keys may use it (re-read when the file changes), or anyone with "
            "--open. Serves until Ctrl+C or SIGTERM."
        ),
    )
    env.add(
        relay,
        "--bind-address",
        default="0.0.0.0",
        metavar="<ADDRESS>",
        help="Address the relay listens on (0.0.0.0: every interface)",
    )
    env.add(
        relay,
        "--relay-port",
        parse=parse_unsigned(16),
        help="Port of the relay (a random free port if not specified)",
    )
    env.add(
        relay,
        "--relay-announce-address",
        metavar="<ADDRESS>",
        help=(
            "Address clients dial (default: --bind-address, or the address of the default "
            "route when that is 0.0.0.0)"
        ),
    )
    env.add(
        relay,
        "--identity-secret-key-path",
        parse=Path,
        metavar="<FILE>",
        help=(
            "The relay's 32-byte secret key (`openssl rand 32 > relay.key`); its address "
            "names the key, so keep one to keep the address (random if not given)"
        ),
    )
    env.add(
        relay,
        "--authorized-keys",
        parse=Path,
        metavar="<FILE>",
        help="The run's members: ed25519 public keys, 64 hex digits a line, # comments",
    )
    env.add(
        relay,
        "--open",
        parse=parse_bool,
        optional_value=True,
        default=False,
        metavar="<OPEN>",
        help="Serve any peer (an open run); its caps still bound what each can hold",
    )
    env.add(
        relay,
        "--max-reservations",
        parse=parse_unsigned(32),
        default=1024,
        metavar="<N>",
        help="Peers that may hold a slot at once",
    )
    relay.set_defaults(relay_env=env)


# --------------------------------------------------------------------------------------------
# validate-config


def validate_config(state: Path, data_config: Path | None) -> int:
    from psyche.centralized.save_state import SavedStateError, resolve_state_path
    from psyche.coordinator.run_config import ConfigFileError, load_run_config

    try:
        # the same path as `run --state`: a file, or the newest save of a save-state directory
        loaded = load_run_config(resolve_state_path(state))
    except (ConfigFileError, SavedStateError) as e:
        print(f"Error found in config: {e}", file=sys.stderr)
        return 1
    for warning in loaded.warnings:
        print(f"warning: {state}: {warning}", file=sys.stderr)
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


def setup_logging(tui: bool) -> Any:
    """Plain logs on stderr, or rich logs above the dashboard; returns the rich console."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = None
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


def run(args: argparse.Namespace) -> int:
    tui = bool(args.tui)
    if tui and not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("psyche-server: not a terminal; running with --tui false", file=sys.stderr)
        tui = False
    console = setup_logging(tui)
    from psyche.core.metrics import ServiceInfo, TrackerConfig, build_tracker

    # before anything else: a tracker that cannot work is one line (TrackerConfigError)
    tracker = build_tracker(
        TrackerConfig.from_options(args),
        service=ServiceInfo.from_env("psyche-centralized-server", "server", scope="psyche_server"),
        run_name="psyche-server",
    )
    try:
        return _run_server(args, console, tracker)
    finally:
        tracker.finish()


def _run_server(args: argparse.Namespace, console: Any, tracker: Any) -> int:

    from psyche.centralized.save_state import (
        SavedStateError,
        load_state,
        resolve_state_path,
        saved_run_identity,
    )
    from psyche.coordinator.run_config import ConfigFileError

    try:
        state_path = resolve_state_path(args.state)
        coordinator = load_state(state_path)
    except (ConfigFileError, SavedStateError) as e:
        log.error("Error found in config: %s", e)
        return 1
    data_config = None
    if args.data_config is not None:
        from psyche.data_provider.data_config import DataConfigError, DataServerInfo

        try:
            data_config = DataServerInfo.load(args.data_config)
        except DataConfigError as e:
            log.error("Error found in data config: %s", e)
            return 1
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

    import trio

    from psyche.centralized.server import ServerOptions, ServerStartError, open_server

    authorized_keys = None
    if args.authorized_keys is not None:
        from psyche.data_provider.server import read_allow_file

        try:
            authorized_keys = frozenset(read_allow_file(args.authorized_keys))
        except (OSError, UnicodeDecodeError) as e:
            log.error("cannot read the authorized keys %s: %s", args.authorized_keys, e)
            return 1
        except ValueError as e:
            log.error("authorized keys: %s", e)
            return 1
        if not authorized_keys:
            log.error("%s lists no key: nobody could join this run", args.authorized_keys)
            return 1

    options = ServerOptions(
        host=args.bind_address,
        authorized_keys=authorized_keys,
        ban_epochs=args.ban_epochs,
        port=args.server_port or 0,
        data_config=data_config,
        save_state_dir=args.save_state_dir,
        run_identity=run_identity,
        events_dir=args.events_dir,
        init_warmup_time=args.init_warmup_time,
        withdraw_on_disconnect=args.withdraw_on_disconnect,
        relay_port=(args.relay_port or 0) if args.relay else None,
        relay_announce_host=args.relay_announce_address,
    )

    from psyche.centralized.status_page import StatusHistory

    history = StatusHistory()

    async def serve() -> None:
        import signal

        from psyche.cli.server.telemetry import ServerTracker

        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_server(coordinator, options) as server, trio.open_nursery() as nursery:
                server.listeners += [history, ServerTracker(tracker, history)]
                if args.status_port is not None:
                    from functools import partial

                    from psyche.centralized.status_page import serve_status, snapshot

                    with _status_port(args):
                        await nursery.start(
                            partial(
                                serve_status,
                                partial(snapshot, server, history),
                                args.status_bind_address,
                                args.status_port,
                            )
                        )
                if console is not None:
                    from psyche.centralized.dashboard import run_dashboard

                    nursery.start_soon(run_dashboard, server, console)
                await serve_until_signalled(signals, nursery, log)

    try:
        trio.run(serve)
    except BaseException as e:
        cause = single_cause(e)
        if isinstance(cause, ServerStartError):
            log.error("%s", cause)
            return 1
        if isinstance(cause, OSError):
            log.error("cannot start the server: %s", cause)
            return 1
        raise
    return 0


@contextmanager
def _status_port(args: argparse.Namespace) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise OSError(
            f"the status page port {args.status_port} (--status-port) on "
            f"{args.status_bind_address}: {e.strerror or e}"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """The `psyche-server` command (exit codes and signals: `psyche.core.cli`)."""
    return run_command(PROG, _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser, env = build_parser()
    args = parser.parse_args(argv)
    if args.command == "validate-config":
        return validate_config(args.state, args.data_config)
    if args.command == "run":
        env.resolve(parser, args)
        return run(args)
    if args.command == "relay":
        from psyche.cli.server.relay import run_relay

        args.relay_env.resolve(parser, args)
        return run_relay(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
