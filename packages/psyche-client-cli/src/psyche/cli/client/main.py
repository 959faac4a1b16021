"""`psyche-client`: show a client's identity, or join a centralized run and train.

Flags and defaults follow upstream's `psyche-centralized-client` (shared/client/src/cli.rs
`TrainArgs` plus `--server-addr`); every flag can also come from the environment under its
upper-snake name (`--run-id` -> `RUN_ID`). Features the Python port does not build are
accepted as flags but refused with a clear message when given a non-default value. The train
options are `psyche.client.setup.options` (`psyche-solana-client train` takes them too). This module
imports nothing heavy, so `--help` is fast; training imports torch when it starts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from psyche.client.setup.options import (
    OptionError,
    TrainOptions,
    add_train_options,
    parse_positive,
    parse_seconds,
    read_identity_secret_key,
)
from psyche.client.setup.ranks import DEFAULT_PORT, SidecarLayout
from psyche.core.cli import (
    Command,
    EnvOptions,
    command_env,
    commands_parser,
    parse_unsigned,
    run_commands,
)

PROG = "psyche-client"

DESCRIPTION = """\
The Psyche training client for centralized runs.

It connects to a coordinator server, joins a run by id, loads the model (from a local
directory, the Hugging Face hub, or from the other clients), trains its share of every round
with DisTrO and exchanges results with the other clients peer to peer.

Every option can also be given in the environment, named in upper snake case
(--run-id: RUN_ID); the identity key also comes from RAW_IDENTITY_SECRET_KEY (64 hex digits).
Ctrl+C (SIGINT) or SIGTERM stops it (exit 130 / 143). Errors are one line; --verbose (or
PSYCHE_VERBOSE=1) adds their traceback."""


def _add_server_options(parser: argparse.ArgumentParser, env: EnvOptions) -> None:
    add = env.add
    add(parser, "--server-addr", required=True, help="host:port of the coordinator server")
    add(
        parser,
        "--server-connect-timeout",
        parse=parse_seconds,
        default=30.0,
        help="Port extension: at start, keep trying to reach the coordinator server for this "
        "many seconds, saying so, before giving up",
    )
    add(
        parser,
        "--server-reconnect-timeout",
        parse=parse_seconds,
        default=120.0,
        help="Port extension: when the server goes away, keep reconnecting for this many "
        "seconds (a restarted server resumes a saved run); 0 exits at once, as upstream",
    )


def _add_sidecar_options(parser: argparse.ArgumentParser, env: EnvOptions) -> None:
    add = env.add
    add(parser, "--main-host", required=True, help="Address of the client's host (its --main-host)")
    add(
        parser,
        "--port",
        parse=parse_unsigned(16),
        default=DEFAULT_PORT,
        help="Port of the client's rank store (its --sidecar-port)",
    )
    add(
        parser,
        "--world-size",
        parse=parse_positive,
        required=True,
        help="All of the client's ranks (its --data-parallelism x --tensor-parallelism)",
    )
    add(
        parser,
        "--start-rank",
        parse=parse_unsigned(32),
        required=True,
        help="The first rank this host runs",
    )
    add(
        parser,
        "--num-local-ranks",
        parse=parse_positive,
        default=1,
        help="How many ranks this host runs (one device each)",
    )
    add(parser, "--device", default="auto", help="auto, cpu, cuda or cuda:N,M,... (one per rank)")
    add(
        parser,
        "--cpu-threads",
        parse=parse_positive,
        help="CPU threads torch uses on this host, split among its ranks",
    )


def show_identity(path: Path | None) -> int:
    key = read_identity_secret_key(path)
    if key is None:
        raise OptionError(
            "Use --identity-secret-key-path or use `RAW_IDENTITY_SECRET_KEY` env variable"
        )
    print(f"Public key: {key.public_key.hex()}")
    print(f"Secret key: {key.to_bytes().hex()}")
    return 0


def sidecar(args: argparse.Namespace) -> int:
    layout = SidecarLayout(
        main_host=args.main_host,
        port=args.port,
        world_size=args.world_size,
        start_rank=args.start_rank,
        num_local_ranks=args.num_local_ranks,
        device=args.device,
        cpu_threads=args.cpu_threads,
    )
    problems = layout.problems()
    if problems:
        raise OptionError("; ".join(problems))
    from psyche.client.observe.logs import setup_logging
    from psyche.client.setup.sidecar import run_sidecar

    setup_logging("console")
    return run_sidecar(layout)


def _add_show_identity_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--identity-secret-key-path",
        type=Path,
        metavar="<IDENTITY_SECRET_KEY_PATH>",
        help="Path to the client's secret key (`openssl rand 32 > secret.key`) or use the "
        "RAW_IDENTITY_SECRET_KEY environment variable",
    )


def _add_train_arguments(parser: argparse.ArgumentParser) -> EnvOptions:
    env = command_env(parser)
    add_train_options(parser, env)
    _add_server_options(parser, env)
    return env


def _add_sidecar_arguments(parser: argparse.ArgumentParser) -> EnvOptions:
    env = command_env(parser)
    _add_sidecar_options(parser, env)
    return env


def _show_identity(args: argparse.Namespace) -> int:
    return show_identity(args.identity_secret_key_path)


def _train(args: argparse.Namespace) -> int:
    options = TrainOptions.from_args(args).check()
    from psyche.cli.client.train import train

    return train(options, args)


COMMANDS = (
    Command(
        "show-identity",
        "Displays the client's unique identifier, used to participate in training runs",
        None,
        _show_identity,
        description="Print the public and secret key of the identity in "
        "--identity-secret-key-path or RAW_IDENTITY_SECRET_KEY.",
        add=_add_show_identity_arguments,
    ),
    Command(
        "train",
        "Allows the client to join a training run and contribute to the model's training process",
        None,
        _train,
        description="Join a run on a coordinator server and train until stopped (Ctrl+C).",
        add=_add_train_arguments,
    ),
    Command(
        "sidecar",
        "Runs ranks of a client whose rank 0 runs on another host (--main-host)",
        None,
        sidecar,
        description="Join the ranks of the client started with `train --main-host ADDR` on "
        "another host: run ranks --start-rank .. --start-rank + --num-local-ranks - 1 of its "
        "--world-size until that client closes them (exit 0), or one of them or the client "
        "dies (exit 1). Upstream's psyche-sidecar python.",
        add=_add_sidecar_arguments,
    ),
)


def build_parser() -> tuple[argparse.ArgumentParser, EnvOptions]:
    """The parser, and the environment fallbacks of `train`'s options. Its subcommands'
    `--help` is argparse's own (no defaults shown), as it always was."""
    parser, envs = commands_parser(PROG, DESCRIPTION, COMMANDS, argparse.HelpFormatter)
    return parser, envs["train"]


def main(argv: Sequence[str] | None = None) -> int:
    """The `psyche-client` command (exit codes and signals: `psyche.core.cli`)."""
    return run_commands(PROG, lambda: build_parser()[0], COMMANDS, argv)


__all__ = ["build_parser", "main", "show_identity"]


if __name__ == "__main__":
    sys.exit(main())
