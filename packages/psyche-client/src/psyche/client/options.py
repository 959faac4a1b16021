"""The training client's options (upstream's `TrainArgs` in shared/client/src/cli.rs), which
every client command takes: `psyche-client train` and `psyche-solana-client train`.

`TrainOptions` is the one place an option is declared: its field (name, type, default), its
`option(...)` (how it parses, whether it is required, why a non-default value is refused when
the port does not build the feature) and the docstring under it, which is its `--help` text, as
upstream's doc comments are clap's. `add_train_options` puts every field on a parser as
`--field-name`; `TrainOptions.from_args` builds the options from the parsed namespace.

Every option can also come from the environment under its upper-snake name (`--run-id` ->
`RUN_ID`); the command line wins (`psyche.core.cli.EnvOptions`). Features the Python port does
not build are accepted as flags but refused with a clear message when given a non-default value
(`TrainOptions.problems`). This module imports nothing heavy, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psyche.core.cli import EnvOptions, UsageError, parse_bool, parse_unsigned

if TYPE_CHECKING:
    from psyche.core.identity import SecretKey

LOG_OUTPUTS = ("tui", "console", "json", "tui-and-console", "none")


class OptionError(ValueError, UsageError):
    """A flag value the client cannot honour (unsupported feature, invalid combination, a
    malformed key): one line and exit 2, as argparse's usage errors."""


# --------------------------------------------------------------------------------------------
# Value parsers


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


def parse_choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        lowered = text.lower()
        if lowered not in choices:
            raise ValueError(f"invalid choice {text!r} (choose from {', '.join(choices)})")
        return lowered

    return parse


# --------------------------------------------------------------------------------------------
# The options


@dataclass(frozen=True)
class Flag:
    """How one `TrainOptions` field is given on the command line."""

    parse: Callable[[str], Any] = str
    short: str | None = None
    required: bool = False
    flag_only: bool = False
    """A switch: `--flag` sets True (the environment variable is parsed with `parse`)."""
    optional_value: bool = False
    """`--flag` alone means True; `--flag VALUE` parses VALUE."""
    not_built: str | None = None
    """Why a value other than the default is refused: the port does not build the feature."""


def option(default: Any = MISSING, **flag: Any) -> Any:
    """A `TrainOptions` field with its `Flag` (its help is the docstring under the field)."""
    return field(default=default, metadata={"flag": Flag(**flag)})


OTEL = "OpenTelemetry export is not built in the Python client"
EVALS = "evaluations are not built in the Python client"
GCS = "GCS checkpoints are not built in the Python client"
WANDB = "Weights & Biases logging is not built in the Python client"
EVENTS = "event files are not built in the Python client"


def relay_problems(options: TrainOptions) -> list[str]:
    """What is wrong with `--iroh-relay`'s relay addresses (`n0`'s relays do not exist here)."""
    if options.iroh_relay == "n0":
        return ["n0's relays are iroh's; use `psyche`, `disabled` or relay addresses"]
    from psyche.network.reachability import relay_peer

    problems = []
    for addr in options.relay_addrs() or ("",):
        try:
            relay_peer(addr)
        except ValueError as e:
            problems.append(f"{addr!r} is not a relay address ({e})")
    return problems


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """What every client command accepts, in upstream's order (shared/client/src/cli.rs
    `TrainArgs`). Fields without a `not_built` reason are honoured."""

    identity_secret_key_path: Path | None = option(None, short="-i", parse=Path)  # noqa: RUF009 (a field)
    """Path to the client's 32-byte secret key (`openssl rand 32 > secret.key`); random if
    neither this nor RAW_IDENTITY_SECRET_KEY is given"""

    bind_p2p_port: int | None = option(None, parse=parse_unsigned(16))
    """Port for the peer-to-peer network (random if not given)"""

    bind_p2p_interface: str | None = option(None)
    """Network interface for the peer-to-peer network (all interfaces if not given)"""

    iroh_relay: str = option("psyche")
    """Relays for reaching peers behind NAT: `psyche` (default) = the run's own (the relay
    the centralized server hosts; none for a Solana run), `disabled` = none (peers must be
    directly reachable), or relay addresses `/ip4/…/tcp/…/p2p/<relay id>` separated by commas
    (e.g. a `psyche-server relay`)"""

    iroh_discovery: str = option("n0")
    """Discovery: `n0` = addresses through the coordinator server; `local` = files in a
    directory shared by clients on this machine"""

    logs: str = option("tui", parse=parse_choice(LOG_OUTPUTS))
    """Log output: tui (not built: console with a note), console, json"""

    oltp_auth_header: str | None = option(None, not_built=OTEL)
    """OpenTelemetry export (not built; refused when set)"""

    oltp_metrics_url: str | None = option(None, not_built=OTEL)
    """OpenTelemetry export (not built; refused when set)"""

    oltp_tracing_url: str | None = option(None, not_built=OTEL)
    """OpenTelemetry export (not built; refused when set)"""

    oltp_logs_url: str | None = option(None, not_built=OTEL)
    """OpenTelemetry export (not built; refused when set)"""

    oltp_report_interval: float = option(60.0, parse=parse_seconds, not_built=OTEL)
    """OpenTelemetry report interval in seconds (not built)"""

    metrics_local_port: int | None = option(None, parse=parse_unsigned(16))
    """Local JSON metrics port (not built; ignored with a warning)"""

    run_id: str = option(parse=trim_quotes, required=True)
    """The id of the training run to join (surrounding quotes are trimmed)"""

    data_parallelism: int = option(
        1, parse=parse_positive, not_built="data parallelism is not built: one trainer per client"
    )
    """Data-parallel trainers on this machine (only 1 is built)"""

    tensor_parallelism: int = option(
        1,
        parse=parse_positive,
        not_built="tensor parallelism is not built: one device per client",
    )
    """Tensor-parallel ranks per trainer (only 1 is built)"""

    micro_batch_size: int = option(1, parse=parse_positive)
    """Samples per forward/backward pass (gradients accumulate over the batch)"""

    write_gradients_dir: Path | None = option(None, parse=Path)  # noqa: RUF009 (a field)
    """Write every DisTrO result this client produces to this directory"""

    eval_tasks: str | None = option(None, not_built=EVALS)
    """Evaluation tasks (not built; refused when set)"""

    eval_seed: int = option(42, parse=parse_unsigned(64), not_built=EVALS)
    """Evaluation seed (not built)"""

    eval_task_max_docs: int | None = option(None, parse=int, not_built=EVALS)
    """Evaluation docs per task (not built)"""

    prompt_task: bool = option(
        False,
        flag_only=True,
        parse=parse_bool,
        not_built="the prompt task is not built in the Python client",
    )
    """Run the prompt task (not built; refused when set)"""

    checkpoint_dir: Path | None = option(None, parse=Path)  # noqa: RUF009 (a field)
    """Save the model here (Hugging Face layout) at the end of every epoch"""

    hub_repo: str | None = option(None)
    """Upload each checkpoint to this Hugging Face repo (needs --checkpoint-dir and HF_TOKEN)"""

    gcs_bucket: str | None = option(None, not_built=GCS)
    """GCS checkpoint uploads (not built; refused when set)"""

    gcs_prefix: str | None = option(None, not_built=GCS)
    """GCS prefix (not built; refused when set)"""

    hub_max_concurrent_downloads: int = option(3, parse=parse_positive)
    """Parallel file downloads from the hub"""

    wandb_project: str | None = option(None, not_built=WANDB)
    """Weights & Biases logging (not built; refused when set)"""

    wandb_run: str | None = option(None, not_built=WANDB)
    """Weights & Biases logging (not built; refused when set)"""

    wandb_group: str | None = option(None, not_built=WANDB)
    """Weights & Biases logging (not built; refused when set)"""

    wandb_entity: str | None = option(None, not_built=WANDB)
    """Weights & Biases logging (not built; refused when set)"""

    write_log: Path | None = option(None, parse=Path)  # noqa: RUF009 (a field)
    """Also write the logs to this file"""

    optim_stats_steps: int | None = option(None, parse=parse_positive)
    """Compute optimizer statistics every N steps"""

    grad_accum_in_fp32: bool = option(False, flag_only=True, parse=parse_bool)
    """Accumulate micro-batch gradients in float32"""

    dummy_training_delay_secs: int | None = option(
        None, parse=parse_unsigned(64), not_built="upstream's dummy model is not built"
    )
    """Training delay of upstream's dummy model (not built; refused when set)"""

    max_concurrent_parameter_requests: int = option(8, parse=parse_positive)
    """Model parameters downloaded from peers at once when joining"""

    max_concurrent_downloads: int = option(4, parse=parse_positive)
    """Accepted for compatibility (unused, as upstream)"""

    device: str = option("auto")
    """Device: auto, cpu, cuda or cuda:N"""

    sidecar_port: int | None = option(
        None,
        parse=parse_unsigned(16),
        not_built="Python sidecars (multi-process parallelism) are not built",
    )
    """Python sidecar port (not built; refused when set)"""

    delete_old_steps: bool = option(True, parse=parse_bool, optional_value=True)
    """Delete checkpoint directories older than the newest --keep-steps"""

    keep_steps: int = option(3, parse=parse_unsigned(32))
    """Checkpoint directories to keep (at least 1 when uploading)"""

    events_dir: Path | None = option(None, parse=Path, not_built=EVENTS)  # noqa: RUF009 (a field)
    """Event files (not built; refused when set)"""

    keep_event_files: int = option(5, parse=parse_unsigned(64), not_built=EVENTS)
    """Event files to keep (not built)"""

    def relay_addrs(self) -> tuple[str, ...]:
        """The relays `--iroh-relay` names (none for `psyche` and `disabled`)."""
        if self.iroh_relay in ("psyche", "disabled"):
            return ()
        return tuple(a.strip() for a in self.iroh_relay.split(",") if a.strip())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainOptions:
        """The options from a namespace that `add_train_options` filled (and its `EnvOptions`
        resolved)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def problems(self) -> list[str]:
        """What keeps the client from running with these options, as messages (empty when it
        can run)."""
        problems = []
        for f in fields(self):
            why = _flag(f.name).not_built
            value = getattr(self, f.name)
            if why is not None and value != f.default:
                problems.append(f"{_flag_name(f.name)} {value}: {why}")
        if self.iroh_relay not in ("psyche", "disabled"):
            problems.extend(f"--iroh-relay {self.iroh_relay}: {p}" for p in relay_problems(self))
        if self.iroh_discovery not in ("n0", "local"):
            problems.append(f"--iroh-discovery {self.iroh_discovery}: expected n0 or local")
        device = self.device
        if device not in ("auto", "cpu", "cuda") and not (
            device.startswith("cuda:") and device[5:].isdigit()
        ):
            problems.append(
                f"--device {device}: supported are auto, cpu, cuda and cuda:N (mps and several "
                "devices are not built)"
            )
        if self.hub_repo is not None and self.checkpoint_dir is None:
            problems.append("--hub-repo was set, but no --checkpoint-dir was passed!")
        if self.hub_repo is not None and not os.environ.get("HF_TOKEN"):
            problems.append("hub-repo and checkpoint-dir set, but no HF_TOKEN env variable.")
        if self.hub_repo is not None and self.keep_steps == 0:
            problems.append(
                f"keep_steps must be >= 1 for checkpoint uploads (got {self.keep_steps})"
            )
        return problems

    def check(self) -> TrainOptions:
        """These options, or an `OptionError` listing every problem."""
        problems = self.problems()
        if problems:
            raise OptionError("; ".join(problems))
        return self


def add_train_options(
    parser: argparse.ArgumentParser, env: EnvOptions, *, help: Mapping[str, str] | None = None
) -> None:
    """Every `TrainOptions` field as `--field-name` on `parser`, with its environment fallback
    in `env`. `help` replaces the help of some fields by name (what the identity and discovery
    options mean depends on the backend)."""
    docs = field_docs()
    for f in fields(TrainOptions):
        flag = _flag(f.name)
        env.add(
            parser,
            _flag_name(f.name),
            short=flag.short,
            parse=flag.parse,
            default=None if f.default is MISSING else f.default,
            required=flag.required,
            flag_only=flag.flag_only,
            optional_value=flag.optional_value,
            help=(help or {}).get(f.name, docs.get(f.name, "")),
        )


def _flag(name: str) -> Flag:
    return TrainOptions.__dataclass_fields__[name].metadata["flag"]


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@cache
def field_docs() -> dict[str, str]:
    """Each `TrainOptions` field's docstring, on one line (read from this module's source, as
    the compiler drops attribute docstrings; empty where the source is not available)."""
    try:
        source = textwrap.dedent(inspect.getsource(TrainOptions))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


# --------------------------------------------------------------------------------------------
# Identity


def read_identity_secret_key(path: Path | None) -> SecretKey | None:
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


__all__ = [
    "LOG_OUTPUTS",
    "Flag",
    "OptionError",
    "TrainOptions",
    "add_train_options",
    "field_docs",
    "option",
    "read_identity_secret_key",
]
