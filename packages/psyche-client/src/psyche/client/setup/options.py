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
(`TrainOptions.problems`).

Components never take the options: each owns a plain settings object, and `TrainOptions`
composes them from its fields (`ranks`: `ranks.RankLayout`, `trainer`:
`trainer_settings.TrainerSettings`, `evals`: `observe.evals.EvalOptions`,
`keep_policy`: `checkpoints.keep_policy.KeepPolicy`, `trackers`: `psyche.metrics.TrackerConfig`),
each checking itself where it can be wrong (`problems()`). This module and those settings import nothing heavy, so
`--help` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psyche.client.checkpoints.keep_policy import KeepPolicy, KeepPolicyError, parse_keep_every
from psyche.client.observe.evals import EvalOptions
from psyche.client.setup.ranks import DEFAULT_PORT, FUSED_LOSS_CHOICES, RankLayout
from psyche.client.setup.trainer_settings import TrainerSettings
from psyche.core.cli import (
    CLI_FIELD,
    EnvFlag,
    EnvOptions,
    UsageError,
    flag_name,
    options_from_args,
    parse_bool,
    parse_unsigned,
)

if TYPE_CHECKING:
    from psyche.core.identity import SecretKey
    from psyche.metrics import TrackerConfig

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


def _parse_keep_every(text: str) -> str:
    try:
        parse_keep_every(text)
    except KeepPolicyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


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
class Flag(EnvFlag):
    """How one `TrainOptions` field is given on the command line: `EnvFlag`'s keywords, and
    `not_built`, why a value other than the default is refused (the port does not build the
    feature)."""

    not_built: str | None = None


def option(default: Any = MISSING, **flag: Any) -> Any:
    """A `TrainOptions` field with its `Flag` (its help is the docstring under the field)."""
    return field(default=default, metadata={CLI_FIELD: Flag(**flag)})


def relay_problems(options: TrainOptions) -> list[str]:
    """What is wrong with `--iroh-relay`'s relay addresses (`n0`'s relays do not exist here)."""
    if options.iroh_relay == "n0":
        return ["n0's relays are iroh's; use `psyche`, `disabled` or relay addresses"]
    from psyche.network import relay_peer

    problems = []
    for addr in options.relay_addrs() or ("",):
        try:
            relay_peer(addr)
        except ValueError as e:
            problems.append(f"{addr!r} is not a relay address ({e})")
    return problems


def tracker_problems(config: TrackerConfig, run_id: str) -> list[str]:
    """What is wrong with the tracker options, found without loading anything: an OTLP URL
    that is not http, W&B flags without WANDB_API_KEY (or WANDB_MODE=offline), a tracker whose
    extra is not installed."""
    from psyche.metrics import TrackerConfigError, require_extra, wandb_info

    problems = config.problems()
    try:
        wandb = wandb_info(config, run_id)
    except TrackerConfigError as e:
        problems.append(f"Weights & Biases: {e}")
        wandb = None
    try:
        if wandb is not None:
            require_extra("wandb")
        if config.tensorboard_dir is not None:
            require_extra("tensorboard")
        if config.wants_otel:
            require_extra("otel")
    except TrackerConfigError as e:
        problems.append(str(e))
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

    logs: str = option("console", parse=parse_choice(LOG_OUTPUTS))
    """Log output: console (default), json (one JSON object a line), tui (a terminal
    dashboard: run state, loss chart, peers, evaluations), tui-and-console (the dashboard, and
    console lines to --write-log), none"""

    oltp_auth_header: str | None = option(None)
    """`authorization` header sent with every OpenTelemetry (OTLP/HTTP) export"""

    oltp_metrics_url: str | None = option(None)
    """Export the per-round metrics to this OTLP/HTTP endpoint (usually `.../v1/metrics`)"""

    oltp_tracing_url: str | None = option(None)
    """Export one span per round to this OTLP/HTTP endpoint (usually `.../v1/traces`)"""

    oltp_logs_url: str | None = option(None)
    """Export the client's log records to this OTLP/HTTP endpoint (usually `.../v1/logs`)"""

    oltp_report_interval: float = option(60.0, parse=parse_seconds)
    """Seconds between two OpenTelemetry metric exports"""

    tensorboard_dir: Path | None = option(None, parse=Path)  # noqa: RUF009 (a field)
    """Write the per-round metrics as TensorBoard event files to this directory (needs
    psyche-metrics[tensorboard])"""

    metrics_jsonl: Path | None = option(None, parse=Path)  # noqa: RUF009 (a field)
    """Append the per-round metrics to this file, one JSON object a line"""

    metrics_local_port: int | None = option(None, parse=parse_unsigned(16))
    """Local JSON metrics port (not built; ignored with a warning)"""

    run_id: str = option(parse=trim_quotes, required=True)
    """The id of the training run to join (surrounding quotes are trimmed)"""

    data_parallelism: int = option(1, parse=parse_positive)
    """Data parallel ranks on this machine: the client's batch is split over them and their
    gradients averaged (one worker process per rank; see docs/client.md, Parallelism)"""

    tensor_parallelism: int = option(1, parse=parse_positive)
    """Tensor parallel ranks per data parallel rank (Llama models; the attention heads and
    the intermediate size must divide by it)"""

    fsdp: bool = option(False, flag_only=True, parse=parse_bool)
    """Shard parameters, gradients and DisTrO's momentum over the data parallel ranks (FSDP2)
    instead of replicating them"""

    param_dtype: str = option("auto", parse=parse_choice(("auto", "bf16", "fp32")))
    """With --fsdp, the dtype parameters are gathered and computed in (auto: the model's)"""

    reduce_dtype: str = option("fp32", parse=parse_choice(("fp32", "bf16")))
    """With --fsdp, the dtype gradients are reduce-scattered in"""

    activation_checkpointing: bool = option(False, flag_only=True, parse=parse_bool)
    """Recompute each block's activations in the backward pass instead of keeping them"""

    fused_loss: str = option("off", parse=parse_choice(FUSED_LOSS_CHOICES))
    """Compute the training loss without the whole logits tensor (fused linear + cross-entropy):
    auto takes Liger's kernel on CUDA when liger-kernel is installed, else a chunked loss in
    torch; liger and chunked ask for one. The CPU computes the model's own loss whatever this
    says (the same bits as off); TP/FSDP shards and Torchtitan models take their own loss too"""

    micro_batch_size: int = option(1, parse=parse_positive)
    """Samples per forward/backward pass on each rank (gradients accumulate over the batch)"""

    write_gradients_dir: Path | None = option(None, parse=Path)  # noqa: RUF009 (a field)
    """Write every DisTrO result this client produces to this directory"""

    eval_tasks: str | None = option(None)
    """Evaluation tasks run between rounds, comma-separated (arc_easy, arc_challenge, boolq,
    hellaswag, mmlu, mmlu_pro, mmlu_cf, openbookqa, piqa, ceval); scores go to the console and
    the trackers"""

    eval_seed: int = option(42, parse=parse_unsigned(64))
    """Seed of the evaluations' few-shot shuffles"""

    eval_task_max_docs: int | None = option(None, parse=parse_positive)
    """Documents per evaluation task (all if not given)"""

    eval_data_dir: Path | None = option(None, parse=Path)  # noqa: RUF009 (a field)
    """Read the evaluation datasets from this directory, laid out as the Hugging Face hub's
    parquet branch (`<repo id>/<subset>/<split>/*.parquet` or `*.jsonl`), instead of the hub"""

    prompt_task: bool = option(False, flag_only=True, parse=parse_bool)
    """Continue a prompt one token between rounds (its tokens go with the witness metadata)"""

    checkpoint_dir: Path | None = option(None, parse=Path)  # noqa: RUF009 (a field)
    """Save the model here (Hugging Face layout) at the end of every epoch"""

    hub_repo: str | None = option(None)
    """Upload each checkpoint to this Hugging Face repo (needs --checkpoint-dir and HF_TOKEN), in
    the background, one commit per checkpoint, retried with backoff"""

    gcs_bucket: str | None = option(None)
    """Upload each checkpoint to this GCS bucket (needs --checkpoint-dir and the `gcs` extra;
    authenticated with GOOGLE_APPLICATION_CREDENTIALS, else anonymous)"""

    gcs_prefix: str | None = option(None)
    """Object prefix of the checkpoint in --gcs-bucket"""

    hub_max_concurrent_downloads: int = option(3, parse=parse_positive)
    """Parallel file downloads from the hub"""

    wandb_project: str | None = option(None)
    """Weights & Biases project (default `psyche`; W&B is on when WANDB_API_KEY is set, or with
    WANDB_MODE=offline, which writes the run under ./wandb or WANDB_DIR)"""

    wandb_run: str | None = option(None)
    """Weights & Biases run name (default `<run id>-<client identity>`)"""

    wandb_group: str | None = option(None)
    """Weights & Biases run group"""

    wandb_entity: str | None = option(None)
    """Weights & Biases entity (user or team)"""

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
    """Device: auto, cpu, cuda or cuda:N; with several ranks cpu, auto, cuda (devices 0..n-1)
    or cuda:N,M,... (one per rank)"""

    cpu_threads: int | None = option(None, parse=parse_positive)
    """CPU threads torch (OpenMP, MKL) uses in this client, split among its ranks (default:
    torch's, every core; ranks on the CPU split the cores). Set it when several clients share a
    machine: psyche-local-testnet gives each cores / clients"""

    main_host: str | None = option(None)
    """Spread this client's ranks over several hosts: the address (of this host) where they
    meet, on a TCP store this client serves at --sidecar-port; the other hosts' ranks join with
    `psyche-client sidecar --main-host ADDR --world-size N --start-rank R` (see docs/client.md,
    Parallelism). The store and the ranks' traffic are unauthenticated, as upstream's: use an
    address only the client's hosts reach"""

    sidecar_port: int | None = option(None, parse=parse_unsigned(16))
    """With --main-host, the port of the ranks' TCP store (default 34567)"""

    num_local_ranks: int | None = option(None, parse=parse_positive)
    """With --main-host, the ranks on this host (ranks 0..N-1; default all of them); the
    others join from other hosts"""

    delete_old_steps: bool = option(True, parse=parse_bool, optional_value=True)
    """Delete checkpoint directories older than the newest --keep-steps"""

    keep_steps: int = option(3, parse=parse_unsigned(32))
    """Checkpoint directories to keep (at least 1 when uploading)"""

    keep_every: str | None = option(None, parse=_parse_keep_every)
    """Permanent checkpoints, never deleted: EVERY[:UNTIL],... keeps the first checkpoint at or
    after each multiple of EVERY steps, up to step UNTIL, then the next interval (e.g.
    `1000:10000,5000`)"""

    temporary_checkpoint_interval: float | None = option(None, parse=parse_seconds)
    """Seconds between temporary checkpoints: other checkpoints are written only this long after
    the last one (the run's final one always), and each deletes the temporary one before it"""

    events_dir: Path | None = option(None, parse=Path)  # noqa: RUF009 (a field)
    """Write this client's events (state changes, rounds, evaluations) to
    `<dir>/<client identity>/epoch-<N>.jsonl`, one file per epoch"""

    keep_event_files: int = option(5, parse=parse_unsigned(64))
    """Epoch event files to keep; older ones are deleted (0: keep all)"""

    # ---- the settings of each component, composed from the fields above --------------------

    @property
    def ranks(self) -> RankLayout:
        """The client's ranks (`workers.WorkerGroup`)."""
        return RankLayout(
            dp=self.data_parallelism,
            tp=self.tensor_parallelism,
            fsdp=bool(self.fsdp),
            device=self.device,
            cpu_threads=self.cpu_threads,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            activation_checkpointing=bool(self.activation_checkpointing),
            fused_loss=self.fused_loss,
            main_host=self.main_host,
            port=DEFAULT_PORT if self.sidecar_port is None else self.sidecar_port,
            local_ranks=self.num_local_ranks,
            eval_replica=self.evals.enabled,
        )

    @property
    def trainer(self) -> TrainerSettings:
        """How the trainer trains (`init.RunInitConfig`, each rank's `workers.RankSpec`)."""
        return TrainerSettings(
            micro_batch_size=self.micro_batch_size,
            grad_accum_in_fp32=bool(self.grad_accum_in_fp32),
            optim_stats_every_n_steps=self.optim_stats_steps,
        )

    @property
    def evals(self) -> EvalOptions:
        """The evaluations between rounds (`observe.evals.EvalSettings.from_options`)."""
        return EvalOptions(
            tasks=self.eval_tasks,
            seed=self.eval_seed,
            max_docs=self.eval_task_max_docs,
            data_dir=self.eval_data_dir,
            prompt_task=bool(self.prompt_task),
        )

    @property
    def keep_policy(self) -> KeepPolicy:
        """Which checkpoints are kept (`checkpoints.keep_policy`)."""
        return KeepPolicy(
            permanent=() if self.keep_every is None else parse_keep_every(self.keep_every),
            temporary_interval_secs=self.temporary_checkpoint_interval,
            keep_steps=self.keep_steps,
            delete_old_steps=bool(self.delete_old_steps),
        )

    @property
    def trackers(self) -> TrackerConfig:
        """The experiment trackers (`psyche.metrics`, imported here: it is not light)."""
        from psyche.metrics import TrackerConfig

        return TrackerConfig.from_options(self)

    def relay_addrs(self) -> tuple[str, ...]:
        """The relays `--iroh-relay` names (none for `psyche` and `disabled`)."""
        if self.iroh_relay in ("psyche", "disabled"):
            return ()
        return tuple(a.strip() for a in self.iroh_relay.split(",") if a.strip())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainOptions:
        """The options from a namespace that `add_train_options` filled (and its `EnvOptions`
        resolved)."""
        return options_from_args(cls, args)

    def problems(self) -> list[str]:
        """What keeps the client from running with these options, as messages (empty when it
        can run)."""
        problems = []
        for f in fields(self):
            why = _flag(f.name).not_built
            value = getattr(self, f.name)
            if why is not None and value != f.default:
                problems.append(f"{flag_name(f.name)} {value}: {why}")
        if self.iroh_relay not in ("psyche", "disabled"):
            problems.extend(f"--iroh-relay {self.iroh_relay}: {p}" for p in relay_problems(self))
        if self.iroh_discovery not in ("n0", "local"):
            problems.append(f"--iroh-discovery {self.iroh_discovery}: expected n0 or local")
        ranks = self.ranks
        problems.extend(ranks.problems())
        problems.extend(tracker_problems(self.trackers, self.run_id))
        problems.extend(self.evals.problems())
        if self.hub_repo is not None and self.gcs_bucket is not None:
            problems.append("Use either GCS or HF hub for checkpoint uploads, not both.")
        uploading = self.hub_repo is not None or self.gcs_bucket is not None
        if uploading and self.checkpoint_dir is None:
            problems.append(
                "--hub-repo or --gcs-bucket was set, but no --checkpoint-dir was passed!"
            )
        if self.hub_repo is not None and not os.environ.get("HF_TOKEN"):
            problems.append("hub-repo and checkpoint-dir set, but no HF_TOKEN env variable.")
        if uploading and self.keep_steps == 0:
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
        text = (help or {}).get(f.name, docs.get(f.name, ""))
        replace(_flag(f.name), help=text).add(parser, env, f)


def _flag(name: str) -> Flag:
    flag: Flag = TrainOptions.__dataclass_fields__[name].metadata[CLI_FIELD]
    return flag


@cache
def field_docs() -> dict[str, str]:
    """Each `TrainOptions` field's docstring, on one line (read from this module's source, as
    the compiler drops attribute docstrings; empty where the source is not available)."""
    try:
        source = textwrap.dedent(inspect.getsource(TrainOptions))
    except (OSError, TypeError):
        return {}
    (cls,) = ast.parse(source).body
    assert isinstance(cls, ast.ClassDef)
    body = cls.body
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
