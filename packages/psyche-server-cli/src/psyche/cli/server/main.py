"""`psyche-server`: validate run configurations and run a centralized coordinator server."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

DESCRIPTION = """\
The Psyche centralized coordinator server.

It owns a run's coordinator state machine, ticks it forward every 500 ms and talks to training
clients over TCP. Start by checking a configuration with `validate-config`."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psyche-server",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="<COMMAND>", required=True)

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
    return parser


def validate_config(state: Path, data_config: Path | None) -> int:
    from psyche.coordinator.run_config import ConfigFileError, load_run_config

    try:
        loaded = load_run_config(state)
    except ConfigFileError as e:
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "validate-config":
        return validate_config(args.state, args.data_config)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
