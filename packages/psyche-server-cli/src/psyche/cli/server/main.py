"""`psyche-server`: validate run configurations, run a centralized coordinator server, or run only
its circuit relay (`relay`, for runs without a centralized server).

This module only parses: the options of `run` and `relay` are declared in the library
(`psyche.centralized.options`), and the commands are its functions (`psyche.centralized.run`,
`psyche.centralized.standalone_relay`), which research code calls the same way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from psyche.centralized.options import ServerRunOptions, StandaloneRelayOptions
from psyche.core.cli import (
    EnvOptions,
    add_options,
    add_verbose_flag,
    command_env,
    command_parser,
    options_from_args,
    parse_command,
    run_command,
)

PROG = "psyche-server"
DESCRIPTION = """\
The Psyche centralized coordinator server.

It owns a run's coordinator state machine, ticks it forward every 500 ms and talks to training
clients over TCP. Start by checking a configuration with `validate-config`, then `run` it.
Every option of `run` can also be given in the environment, named in upper snake case
(--server-port: SERVER_PORT). `run` serves until SIGINT (Ctrl+C) or SIGTERM and then exits 0.
Errors are one line; --verbose (or PSYCHE_VERBOSE=1) adds their traceback."""


def build_parser() -> tuple[argparse.ArgumentParser, EnvOptions]:
    """The parser, and the environment fallbacks of `run`'s options (`parse_command` resolves
    those of the command it parses)."""
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
    env = command_env(run)
    add_options(run, env, ServerRunOptions)
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
    add_options(relay, command_env(relay), StandaloneRelayOptions)
    add_verbose_flag(parser)
    return parser, env


def main(argv: Sequence[str] | None = None) -> int:
    """The `psyche-server` command (exit codes and signals: `psyche.core.cli`)."""
    return run_command(PROG, _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_command(build_parser()[0], argv)
    if args.command == "validate-config":
        from psyche.centralized.run import validate_config

        return validate_config(args.state, args.data_config)
    if args.command == "run":
        from psyche.centralized.run import run_server

        return run_server(options_from_args(ServerRunOptions, args))
    if args.command == "relay":
        from psyche.centralized.standalone_relay import run_relay

        return run_relay(options_from_args(StandaloneRelayOptions, args))
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
