"""`psyche-local-testnet start`: a coordinator server and N training clients on this machine."""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from psyche.cli.local_testnet.commands import (
    DEFAULT_LOG,
    TestnetPlan,
    log_dir_name,
    read_run_id,
    split_args,
)
from psyche.client.setup.cpu_threads import available_cores, threads_per_client
from psyche.core.cli import (
    EnvOptions,
    HelpFormatter,
    UserError,
    add_verbose_flag,
    command_env,
    command_parser,
    parse_bool,
    parse_command,
    parse_unsigned,
    run_command,
)

PROG = "psyche-local-testnet"

DESCRIPTION = """\
Starts a local testnet: the coordinator server and N training clients, each in its own tmux
pane (server top left, a GPU monitor bottom left, clients on the right), or with --headless as
child processes whose output is printed with a [name] prefix. Client i uses the identity key
whose 32 bytes are the number i. Stop it with Ctrl+C or SIGTERM (headless: every child is
stopped, then it exits 0) or by leaving tmux. Errors are one line; --verbose (or
PSYCHE_VERBOSE=1) adds their traceback."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("NUM_CLIENTS must be a positive integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("NUM_CLIENTS must be a positive integer")
    return value


# Upstream's clap types: a port is a u16, a count or a number of seconds a u64.
parse_port = parse_unsigned(16)
parse_count = parse_unsigned(64)


def existing_path(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"Config path {text} does not exist")
    return path


def client_numbers(text: str) -> tuple[int, ...]:
    if not text.strip():
        return ()
    return tuple(positive_int(part) for part in text.split(","))


def build_parser() -> tuple[argparse.ArgumentParser, EnvOptions]:
    """The parser, and the environment fallbacks of `start`'s options (`parse_command`
    resolves them)."""
    parser, commands = command_parser(PROG, DESCRIPTION)
    start = commands.add_parser(
        "start",
        help="Starts the local-testnet running each part of the system in a separate pane",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    env = command_env(start)
    add = start.add_argument
    add("--num-clients", type=positive_int, required=True, metavar="<NUM_CLIENTS>",
        help="Number of clients to start")  # fmt: skip
    add("--config-path", type=existing_path, required=True, metavar="<CONFIG_PATH>",
        help="Directory with the run's state.toml (and data.toml when it hosts the data)")  # fmt: skip
    add("--write-distro-data", type=Path, metavar="<WRITE_DISTRO_DATA>",
        help="If provided, write DisTrO data to disk in this path")  # fmt: skip
    add("--server-port", type=parse_port, default=20000, metavar="<SERVER_PORT>",
        help="Port the server listens on (the clients connect to it) [default: 20000]")  # fmt: skip
    env.add(start, "--tui", parse=parse_bool, optional_value=True, default=True,
            help="Terminal dashboards for the server and clients")  # fmt: skip
    add("--random-kill-num", type=parse_count, metavar="<RANDOM_KILL_NUM>",
        help="Kill N clients randomly every <RANDOM_KILL_INTERVAL> seconds (and restart them)")  # fmt: skip
    add("--allowed-to-kill", type=client_numbers, default=(), metavar="<ALLOWED_TO_KILL>",
        help="Which clients (1-based, comma separated) may be killed randomly [default: all]")  # fmt: skip
    add("--random-kill-interval", type=parse_count, default=120,
        metavar="<RANDOM_KILL_INTERVAL>",
        help="Kill <RANDOM_KILL_NUM> clients randomly every N seconds [default: 120]")  # fmt: skip
    add("--log", default=DEFAULT_LOG, metavar="<LOG>",
        help=f"Log levels, passed as RUST_LOG [default: {DEFAULT_LOG}]")  # fmt: skip
    add("--first-client-checkpoint", metavar="<FIRST_CLIENT_CHECKPOINT>",
        help="HF repo the first client uploads checkpoints to (--checkpoint-dir ./checkpoints)")  # fmt: skip
    add("--hf-token", metavar="<HF_TOKEN>",
        help="HF token for all the clients to fetch the model at the beginning of the run")  # fmt: skip
    add("--write-log", action="store_true",
        help="Write every process's log to ./logs/<start time, UTC>/")  # fmt: skip
    env.add(start, "--wandb-project")
    env.add(start, "--wandb-group")
    env.add(start, "--wandb-entity")
    env.add(start, "--optim-stats", parse=parse_count,
            help="Passed to the clients as --optim-stats-steps")  # fmt: skip
    env.add(start, "--eval-tasks")
    add("--events-dir", type=Path, metavar="<EVENTS_DIR>",
        help="Event files of the server and each client go under this directory")  # fmt: skip
    add("--eval-data-dir", type=Path, metavar="<EVAL_DATA_DIR>",
        help="The clients read the --eval-tasks datasets from this directory (not the hub)")  # fmt: skip
    add("--metrics-dir", type=Path, metavar="<METRICS_DIR>",
        help="The server and each client append their metrics to DIR/server.jsonl and "
        "DIR/client-N.jsonl")  # fmt: skip
    add("--tensorboard-dir", type=Path, metavar="<TENSORBOARD_DIR>",
        help="Each client writes TensorBoard event files to DIR/client-N")  # fmt: skip
    add("--status-port", type=parse_port, metavar="<STATUS_PORT>",
        help="The server serves its status page on this port (http://127.0.0.1:PORT/)")  # fmt: skip
    add("--cpu-threads", type=parse_count, metavar="<CPU_THREADS>",
        help="CPU threads each client's torch uses (0: torch's default, every core) "
        "[default: the cores this process may use / NUM_CLIENTS, at least 1]")  # fmt: skip
    add("--headless", action="store_true",
        help="No tmux: run everything as child processes, output prefixed with [name]")  # fmt: skip
    # Hidden: for tests and scripted use.
    add("--tmux-socket", help=argparse.SUPPRESS)
    add("--no-attach", action="store_true", help=argparse.SUPPRESS)
    add("--client-program", help=argparse.SUPPRESS)
    add("--client-args", help=argparse.SUPPRESS)
    add("--server-args", help=argparse.SUPPRESS)
    add_verbose_flag(parser)
    return parser, env


def client_cpu_threads(requested: int | None, num_clients: int) -> int | None:
    """Each client's `--cpu-threads`: as requested (0: none, torch's default), else an equal
    share of this machine's cores (three clients each on every core starve each other)."""
    if requested is not None:
        return requested or None
    return threads_per_client(available_cores(), num_clients)


def plan_from_args(
    args: argparse.Namespace,
    config_path: Path,
    run_id: str,
    *,
    headless: bool,
    log_dir: Path | None,
) -> TestnetPlan:
    """The testnet's command lines from its parsed options (every option that reaches the
    server or the clients goes through here)."""
    return TestnetPlan(
        num_clients=args.num_clients,
        config_path=config_path,
        run_id=run_id,
        server_port=args.server_port,
        tui=bool(args.tui) and not headless,
        log=args.log,
        write_distro_data=args.write_distro_data,
        first_client_checkpoint=args.first_client_checkpoint,
        hf_token=args.hf_token,
        # Headless captures every process's output itself.
        write_log_dir=None if headless else log_dir,
        wandb_project=args.wandb_project,
        wandb_group=args.wandb_group,
        wandb_entity=args.wandb_entity,
        optim_stats=args.optim_stats,
        eval_tasks=args.eval_tasks,
        events_dir=args.events_dir,
        eval_data_dir=args.eval_data_dir,
        metrics_dir=args.metrics_dir,
        tensorboard_dir=args.tensorboard_dir,
        status_port=args.status_port,
        cpu_threads=client_cpu_threads(args.cpu_threads, args.num_clients),
        client_program=split_args(args.client_program),
        client_args=split_args(args.client_args),
        server_args=split_args(args.server_args),
    )


def start(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.random_kill_num is not None and args.random_kill_num > args.num_clients:
        parser.error(
            f"You requested to kill {args.random_kill_num} clients randomly, but you only have "
            f"{args.num_clients} clients."
        )
    config_path: Path = args.config_path.resolve()
    state_path = config_path / "state.toml"
    try:
        run_id = read_run_id(state_path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the run id: {e}") from e

    headless = args.headless
    if not headless and shutil.which("tmux") is None:
        print("psyche-local-testnet: tmux is not installed; running --headless", file=sys.stderr)
        headless = True
    if not headless and not args.no_attach and not sys.stdin.isatty():
        print("psyche-local-testnet: not a terminal; running --headless", file=sys.stderr)
        headless = True

    log_dir = None
    if args.write_log:
        log_dir = Path("logs") / log_dir_name(datetime.datetime.now(datetime.UTC))
        log_dir.mkdir(parents=True, exist_ok=True)

    plan = plan_from_args(args, config_path, run_id, headless=headless, log_dir=log_dir)
    print(f"psyche-local-testnet: run {run_id!r}, {args.num_clients} clients, config {config_path}")
    validate = plan.validate_command()
    if subprocess.run(list(validate.argv)).returncode != 0:
        raise UserError(f"the run config in {config_path} is not valid (see above)")

    kill = {
        "random_kill_num": args.random_kill_num,
        "allowed_to_kill": args.allowed_to_kill,
        "random_kill_interval": float(args.random_kill_interval),
    }
    if headless:
        import trio

        from psyche.cli.local_testnet.headless import run_headless

        return trio.run(lambda: run_headless(plan, log_dir=log_dir, **kill))

    from psyche.cli.local_testnet.headless import TestnetError
    from psyche.cli.local_testnet.tmux import run_tmux

    try:
        layout = run_tmux(plan, socket_name=args.tmux_socket, attach=not args.no_attach, **kill)
    except TestnetError as e:
        raise UserError(str(e)) from e
    if args.no_attach:
        print(
            f"panes: server {layout.server}, monitor {layout.monitor}, clients "
            + " ".join(layout.clients)
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The `psyche-local-testnet` command (exit codes and signals: `psyche.core.cli`)."""
    return run_command(PROG, _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser, _ = build_parser()
    args = parse_command(parser, argv)
    if args.command == "start":
        return start(args, parser)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
