"""The training client's options, shared by `psyche-client train` and `psyche-solana-client
train` (upstream's `TrainArgs`, flattened into both binaries).

Every option can also come from the environment under its upper-snake name (`--run-id` ->
`RUN_ID`); the command line wins. Features the Python port does not build are accepted as flags
but refused with a clear message when given a non-default value (`check_supported`). This module
imports nothing heavy, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psyche.core.cli import UsageError

LOG_OUTPUTS = ("tui", "console", "json", "tui-and-console", "none")


class OptionError(ValueError, UsageError):
    """A flag value the client cannot honour (unsupported feature, invalid combination, a
    malformed key): one line and exit 2, as argparse's usage errors."""


# --------------------------------------------------------------------------------------------
# Parsing with environment fallbacks


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_unsigned(bits: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not 0 <= value < (1 << bits):
            raise ValueError(f"{value} is not a u{bits}")
        return value

    parse.__name__ = f"u{bits}"
    return parse


def parse_positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} must be at least 1")
    return value


def parse_seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError("Duration cannot be negative")
    return value


def trim_quotes(text: str) -> str:
    return text.strip('"')


def env_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True)
class _Option:
    dest: str
    flag: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    required: bool


class EnvOptions:
    """Options whose missing values are read from the environment (upstream clap `env`)."""

    def __init__(self) -> None:
        self._options: list[_Option] = []

    def add(
        self,
        parser: argparse.ArgumentParser,
        flag: str,
        *,
        parse: Callable[[str], Any] = str,
        default: Any = None,
        required: bool = False,
        short: str | None = None,
        flag_only: bool = False,
        optional_value: bool = False,
        help: str = "",
    ) -> None:
        dest = flag.lstrip("-").replace("-", "_")
        env = env_name(flag)
        shown = f" [default: {default}]" if default not in (None, False) else ""
        text = f"{help}{shown} [env: {env}]".strip()
        names = [short, flag] if short else [flag]
        kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": text}
        if flag_only:
            kwargs["action"] = "store_const"
            kwargs["const"] = True
        else:
            kwargs["type"] = parse
            kwargs["metavar"] = f"<{dest.upper()}>"
            if optional_value:
                kwargs["nargs"] = "?"
                kwargs["const"] = True
        parser.add_argument(*names, **kwargs)
        self._options.append(_Option(dest, flag, env, parse, default, required))

    def resolve(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        for option in self._options:
            if getattr(args, option.dest, None) is not None:
                continue
            raw = os.environ.get(option.env)
            if raw is not None:
                try:
                    value = option.parse(raw)
                except (ValueError, TypeError) as e:
                    parser.error(f"environment variable {option.env}: {e}")
                setattr(args, option.dest, value)
            elif option.required:
                parser.error(
                    f"the following arguments are required: {option.flag} (or {option.env})"
                )
            else:
                setattr(args, option.dest, option.default)


IDENTITY_HELP = (
    "Path to the client's 32-byte secret key (`openssl rand 32 > secret.key`); "
    "random if neither this nor RAW_IDENTITY_SECRET_KEY is given"
)
DISCOVERY_HELP = (
    "Discovery: `n0` = addresses through the coordinator server; `local` = files in "
    "a directory shared by clients on this machine"
)


def add_train_options(
    parser: argparse.ArgumentParser,
    env: EnvOptions,
    *,
    identity_help: str = IDENTITY_HELP,
    discovery_help: str = DISCOVERY_HELP,
) -> None:
    """Upstream's `TrainArgs` (shared/client/src/cli.rs): what every client binary accepts.
    The help of the identity and discovery options depends on the backend."""
    add = env.add
    add(
        parser,
        "--identity-secret-key-path",
        short="-i",
        parse=Path,
        help=identity_help,
    )
    add(
        parser,
        "--bind-p2p-port",
        parse=parse_unsigned(16),
        help="Port for the peer-to-peer network (random if not given)",
    )
    add(
        parser,
        "--bind-p2p-interface",
        help="Network interface for the peer-to-peer network (all interfaces if not given)",
    )
    add(
        parser,
        "--iroh-relay",
        default="psyche",
        help="Relays (iroh): the port has none; only `psyche` (default) or `disabled`",
    )
    add(
        parser,
        "--iroh-discovery",
        default="n0",
        help=discovery_help,
    )
    add(
        parser,
        "--logs",
        default="tui",
        parse=parse_choice(LOG_OUTPUTS),
        help="Log output: tui (not built: console with a note), console, json",
    )
    for flag in (
        "--oltp-auth-header",
        "--oltp-metrics-url",
        "--oltp-tracing-url",
        "--oltp-logs-url",
    ):
        add(parser, flag, help="OpenTelemetry export (not built; refused when set)")
    add(
        parser,
        "--oltp-report-interval",
        parse=parse_seconds,
        default=60.0,
        help="OpenTelemetry report interval in seconds (not built)",
    )
    add(
        parser,
        "--metrics-local-port",
        parse=parse_unsigned(16),
        help="Local JSON metrics port (not built; ignored with a warning)",
    )
    add(
        parser,
        "--run-id",
        parse=trim_quotes,
        required=True,
        help="The id of the training run to join (surrounding quotes are trimmed)",
    )
    add(
        parser,
        "--data-parallelism",
        parse=parse_positive,
        default=1,
        help="Data-parallel trainers on this machine (only 1 is built)",
    )
    add(
        parser,
        "--tensor-parallelism",
        parse=parse_positive,
        default=1,
        help="Tensor-parallel ranks per trainer (only 1 is built)",
    )
    add(
        parser,
        "--micro-batch-size",
        parse=parse_positive,
        default=1,
        help="Samples per forward/backward pass (gradients accumulate over the batch)",
    )
    add(
        parser,
        "--write-gradients-dir",
        parse=Path,
        help="Write every DisTrO result this client produces to this directory",
    )
    add(parser, "--eval-tasks", help="Evaluation tasks (not built; refused when set)")
    add(
        parser,
        "--eval-seed",
        parse=parse_unsigned(64),
        default=42,
        help="Evaluation seed (not built)",
    )
    add(parser, "--eval-task-max-docs", parse=int, help="Evaluation docs per task (not built)")
    add(
        parser,
        "--prompt-task",
        flag_only=True,
        parse=parse_bool,
        default=False,
        help="Run the prompt task (not built; refused when set)",
    )
    add(
        parser,
        "--checkpoint-dir",
        parse=Path,
        help="Save the model here (Hugging Face layout) at the end of every epoch",
    )
    add(
        parser,
        "--hub-repo",
        help="Upload each checkpoint to this Hugging Face repo (needs --checkpoint-dir and "
        "HF_TOKEN)",
    )
    add(parser, "--gcs-bucket", help="GCS checkpoint uploads (not built; refused when set)")
    add(parser, "--gcs-prefix", help="GCS prefix (not built; refused when set)")
    add(
        parser,
        "--hub-max-concurrent-downloads",
        parse=parse_positive,
        default=3,
        help="Parallel file downloads from the hub",
    )
    for flag in ("--wandb-project", "--wandb-run", "--wandb-group", "--wandb-entity"):
        add(parser, flag, help="Weights & Biases logging (not built; refused when set)")
    add(parser, "--write-log", parse=Path, help="Also write the logs to this file")
    add(
        parser,
        "--optim-stats-steps",
        parse=parse_positive,
        help="Compute optimizer statistics every N steps",
    )
    add(
        parser,
        "--grad-accum-in-fp32",
        flag_only=True,
        parse=parse_bool,
        default=False,
        help="Accumulate micro-batch gradients in float32",
    )
    add(
        parser,
        "--dummy-training-delay-secs",
        parse=parse_unsigned(64),
        help="Training delay of upstream's dummy model (not built; refused when set)",
    )
    add(
        parser,
        "--max-concurrent-parameter-requests",
        parse=parse_positive,
        default=8,
        help="Model parameters downloaded from peers at once when joining",
    )
    add(
        parser,
        "--max-concurrent-downloads",
        parse=parse_positive,
        default=4,
        help="Accepted for compatibility (unused, as upstream)",
    )
    add(parser, "--device", default="auto", help="Device: auto, cpu, cuda or cuda:N")
    add(
        parser,
        "--sidecar-port",
        parse=parse_unsigned(16),
        help="Python sidecar port (not built; refused when set)",
    )
    add(
        parser,
        "--delete-old-steps",
        parse=parse_bool,
        default=True,
        optional_value=True,
        help="Delete checkpoint directories older than the newest --keep-steps",
    )
    add(
        parser,
        "--keep-steps",
        parse=parse_unsigned(32),
        default=3,
        help="Checkpoint directories to keep (at least 1 when uploading)",
    )
    add(parser, "--events-dir", parse=Path, help="Event files (not built; refused when set)")
    add(
        parser,
        "--keep-event-files",
        parse=parse_unsigned(64),
        default=5,
        help="Event files to keep (not built)",
    )


def parse_choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        lowered = text.lower()
        if lowered not in choices:
            raise ValueError(f"invalid choice {text!r} (choose from {', '.join(choices)})")
        return lowered

    return parse


# --------------------------------------------------------------------------------------------
# Checks of what is and is not built


_NOT_BUILT: tuple[tuple[str, Any, str], ...] = (
    ("oltp_auth_header", None, "OpenTelemetry export is not built in the Python client"),
    ("oltp_metrics_url", None, "OpenTelemetry export is not built in the Python client"),
    ("oltp_tracing_url", None, "OpenTelemetry export is not built in the Python client"),
    ("oltp_logs_url", None, "OpenTelemetry export is not built in the Python client"),
    ("oltp_report_interval", 60.0, "OpenTelemetry export is not built in the Python client"),
    ("eval_tasks", None, "evaluations are not built in the Python client"),
    ("eval_seed", 42, "evaluations are not built in the Python client"),
    ("eval_task_max_docs", None, "evaluations are not built in the Python client"),
    ("prompt_task", False, "the prompt task is not built in the Python client"),
    ("gcs_bucket", None, "GCS checkpoints are not built in the Python client"),
    ("gcs_prefix", None, "GCS checkpoints are not built in the Python client"),
    ("wandb_project", None, "Weights & Biases logging is not built in the Python client"),
    ("wandb_run", None, "Weights & Biases logging is not built in the Python client"),
    ("wandb_group", None, "Weights & Biases logging is not built in the Python client"),
    ("wandb_entity", None, "Weights & Biases logging is not built in the Python client"),
    ("dummy_training_delay_secs", None, "upstream's dummy model is not built"),
    ("sidecar_port", None, "Python sidecars (multi-process parallelism) are not built"),
    ("events_dir", None, "event files are not built in the Python client"),
    ("keep_event_files", 5, "event files are not built in the Python client"),
    ("data_parallelism", 1, "data parallelism is not built: one trainer per client"),
    ("tensor_parallelism", 1, "tensor parallelism is not built: one device per client"),
)


def check_supported(args: argparse.Namespace) -> list[str]:
    """Problems with the train options, as messages (empty when the client can run)."""
    problems = []
    for dest, default, why in _NOT_BUILT:
        value = getattr(args, dest)
        if value != default:
            flag = "--" + dest.replace("_", "-")
            problems.append(f"{flag} {value}: {why}")
    if args.iroh_relay not in ("psyche", "disabled"):
        problems.append(
            f"--iroh-relay {args.iroh_relay}: relays are not built (clients connect directly); "
            "use the default or `disabled`"
        )
    if args.iroh_discovery not in ("n0", "local"):
        problems.append(f"--iroh-discovery {args.iroh_discovery}: expected n0 or local")
    device = args.device
    if device not in ("auto", "cpu", "cuda") and not (
        device.startswith("cuda:") and device[5:].isdigit()
    ):
        problems.append(
            f"--device {device}: supported are auto, cpu, cuda and cuda:N (mps and several "
            "devices are not built)"
        )
    if args.hub_repo is not None and args.checkpoint_dir is None:
        problems.append("--hub-repo was set, but no --checkpoint-dir was passed!")
    if args.hub_repo is not None and not os.environ.get("HF_TOKEN"):
        problems.append("hub-repo and checkpoint-dir set, but no HF_TOKEN env variable.")
    if args.hub_repo is not None and args.keep_steps == 0:
        problems.append(f"keep_steps must be >= 1 for checkpoint uploads (got {args.keep_steps})")
    return problems


# --------------------------------------------------------------------------------------------
# Identity


def read_identity_secret_key(path: Path | None) -> Any:
    """The key from RAW_IDENTITY_SECRET_KEY (64 hex digits, `0x` allowed) or the key file; None
    when neither. A malformed key is an `OptionError` saying what is wrong with it."""
    from psyche.core.identity import SecretKey

    raw = os.environ.get("RAW_IDENTITY_SECRET_KEY")
    if raw is not None and path is not None:
        raise OptionError(
            "both RAW_IDENTITY_SECRET_KEY and --identity-secret-key-path are set; use one"
        )
    if raw is not None:
        try:
            return SecretKey.from_hex(raw, "RAW_IDENTITY_SECRET_KEY")
        except ValueError as e:
            raise OptionError(str(e)) from None
    if path is not None:
        try:
            return SecretKey.read_file(path)
        except OSError as e:
            raise OptionError(f"cannot read key file {path}: {e.strerror or e}") from e
        except ValueError as e:
            raise OptionError(str(e)) from e
    return None
