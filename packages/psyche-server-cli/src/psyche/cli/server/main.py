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
    Command,
    EnvOptions,
    commands_parser,
    run_commands,
)

PROG = "psyche-server"
DESCRIPTION = """\
The Psyche centralized coordinator server.

It owns a run's coordinator state machine, ticks it forward every 500 ms and talks to training
clients over TCP. Start by checking a configuration with `validate-config`, then `run` it.
Every option of `run` can also be given in the environment, named in upper snake case
(--server-port: SERVER_PORT). `run` serves until SIGINT (Ctrl+C) or SIGTERM and then exits 0.
Errors are one line; --verbose (or PSYCHE_VERBOSE=1) adds their traceback."""


def _add_validate_arguments(validate: argparse.ArgumentParser) -> None:
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


def _validate_config(args: argparse.Namespace) -> int:
    from psyche.centralized.run import validate_config

    return validate_config(args.state, args.data_config)


def _run_server(options: ServerRunOptions) -> int:
    from psyche.centralized.run import run_server

    return run_server(options)


def _run_relay(options: StandaloneRelayOptions) -> int:
    from psyche.centralized.standalone_relay import run_relay

    return run_relay(options)


COMMANDS = (
    Command(
        "validate-config",
        "Checks that the configuration declared in the state.toml file is valid",
        None,
        _validate_config,
        description=(
            "Checks that a run configuration is valid: the TOML schema (every field, its type "
            "and range, no unknown keys), then the coordinator's own rules (timings, client "
            "counts, batch sizes) in upstream's order. Accepts a state file (with run_id and "
            "run_state) or a plain run config ([config] and [model] only). Prints a one-line "
            "summary and exits 0 when valid; prints every problem with its TOML path and exits "
            "1 otherwise."
        ),
        add=_add_validate_arguments,
    ),
    Command(
        "run",
        "Starts the server and launches the coordinator with the declared configuration",
        ServerRunOptions,
        _run_server,
        description=(
            "Starts the coordinator server for the run in --state and serves it until Ctrl+C "
            "(or SIGTERM). --state may also name a --save-state-dir: the run resumes from the "
            "newest state saved there."
        ),
    ),
    Command(
        "relay",
        "Runs only a circuit relay, for clients behind NAT in runs without this server",
        StandaloneRelayOptions,
        _run_relay,
        description=(
            "Runs the circuit relay that `run` hosts, on its own (for Solana runs): clients "
            "behind NAT reserve a slot on it and reach each other through it. Give clients "
            "its address (printed at start) with --iroh-relay. Only the keys of "
            "--authorized-keys may use it (re-read when the file changes), or anyone with "
            "--open. Serves until Ctrl+C or SIGTERM."
        ),
    ),
)


def build_parser() -> tuple[argparse.ArgumentParser, EnvOptions]:
    """The parser, and the environment fallbacks of `run`'s options (`parse_command` resolves
    those of the command it parses). Its subcommands' `--help` is argparse's own (no defaults
    shown), as it always was."""
    parser, envs = commands_parser(PROG, DESCRIPTION, COMMANDS, argparse.HelpFormatter)
    return parser, envs["run"]


def main(argv: Sequence[str] | None = None) -> int:
    """The `psyche-server` command (exit codes and signals: `psyche.core.cli`)."""
    return run_commands(PROG, lambda: build_parser()[0], COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
