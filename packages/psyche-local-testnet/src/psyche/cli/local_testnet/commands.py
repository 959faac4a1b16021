"""The command lines the local testnet runs (upstream `local-testnet/src/main.rs`), built purely.

Server: `psyche-server run --state DIR/state.toml --server-port P --tui B [--data-config
DIR/data.toml] [--events-dir D] [--metrics-jsonl M/server.jsonl] [--status-port S]`. Client i (1-based): environment `RAW_IDENTITY_SECRET_KEY` =
64 hex digits of i, `RUST_LOG`, `RUST_BACKTRACE=1` (`HF_TOKEN` when given), then `psyche-client
train --run-id R --server-addr localhost:P --logs tui|console` and the optional flags in
upstream's order. Programs run with the testnet's own Python (`python -m psyche.cli.server`), so
no activated environment is needed in a tmux pane.

Divergences: upstream also sets `METRICS_LOCAL_PORT` (the port has no local metrics, so the
client would only warn about it); client 1 always gets `--checkpoint-dir` (`checkpoint_dir`,
`./checkpoints` by default; upstream only with `--first-client-checkpoint`), so the run's final
model is kept; and the log default is `warn,psyche=info` (upstream: `psyche=debug`). The
port's trackers are forwarded too: `metrics_dir` gives the server `--metrics-jsonl
M/server.jsonl` and client i `--metrics-jsonl M/client-i.jsonl`, `tensorboard_dir` gives client
i `--tensorboard-dir T/client-i`, and `--eval-data-dir` goes with `--eval-tasks`. Each client
gets `--cpu-threads` (the testnet's share of the cores per client, so N clients do not each run
torch on every core; upstream's clients train on GPUs). Every client
command line parses with the client's own parser (tests/local_testnet).
"""

from __future__ import annotations

import datetime
import random
import shlex
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_LOG = "warn,psyche=info"
DEFAULT_CHECKPOINT_DIR = Path("checkpoints")


@dataclass(frozen=True)
class Command:
    """A program with its environment additions; `shell()` is what a tmux pane is sent."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def shell(self) -> str:
        assigns = [f"{k}={shlex.quote(v)}" for k, v in self.env]
        return " ".join([*assigns, *(shlex.quote(a) for a in self.argv)])

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, **dict(self.env)}


@dataclass(frozen=True)
class TestnetPlan:
    __test__ = False  # not a pytest test class

    num_clients: int
    config_path: Path
    run_id: str
    server_port: int = 20000
    tui: bool = True
    log: str = DEFAULT_LOG
    write_distro_data: Path | None = None
    first_client_checkpoint: str | None = None
    # Where client 1 saves the model at every epoch end (None: nowhere).
    checkpoint_dir: Path | None = DEFAULT_CHECKPOINT_DIR
    hf_token: str | None = None
    write_log_dir: Path | None = None
    wandb_project: str | None = None
    wandb_group: str | None = None
    wandb_entity: str | None = None
    optim_stats: int | None = None
    eval_tasks: str | None = None
    events_dir: Path | None = None
    eval_data_dir: Path | None = None
    metrics_dir: Path | None = None
    tensorboard_dir: Path | None = None
    status_port: int | None = None
    # Each client's `--cpu-threads` (None: torch's default, every core).
    cpu_threads: int | None = None
    # Hidden options: another client program (tests), extra client/server arguments.
    client_program: tuple[str, ...] = ()
    client_args: tuple[str, ...] = ()
    server_args: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)

    @property
    def state_path(self) -> Path:
        return self.config_path / "state.toml"

    @property
    def data_path(self) -> Path | None:
        path = self.config_path / "data.toml"
        return path if path.exists() else None

    def validate_command(self) -> Command:
        argv = [self.python, "-m", "psyche.cli.server", "validate-config"]
        argv += ["--state", str(self.state_path)]
        if self.data_path is not None:
            argv += ["--data-config", str(self.data_path)]
        return Command(tuple(argv))

    def server_command(self) -> Command:
        argv = [self.python, "-m", "psyche.cli.server", "run", "--state", str(self.state_path)]
        argv += ["--server-port", str(self.server_port), "--tui", str(self.tui).lower()]
        if self.data_path is not None:
            argv += ["--data-config", str(self.data_path)]
        if self.events_dir is not None:
            argv += ["--events-dir", str(self.events_dir)]
        if self.metrics_dir is not None:
            argv += ["--metrics-jsonl", str(self.metrics_dir / "server.jsonl")]
        if self.status_port is not None:
            argv += ["--status-port", str(self.status_port)]
        argv += self.server_args
        return Command(tuple(argv), (("RUST_LOG", self.log),))

    def client_command(self, number: int) -> Command:
        """The command of client `number` (1-based; its key is the hex of `number`)."""
        env: list[tuple[str, str]] = []
        if self.hf_token is not None:
            env.append(("HF_TOKEN", self.hf_token))
        env += [
            ("RUST_LOG", self.log),
            ("RUST_BACKTRACE", "1"),
            ("RAW_IDENTITY_SECRET_KEY", identity_secret_key_hex(number)),
        ]
        program = self.client_program or default_client_program(self.python)
        argv = [*program, "train", "--run-id", self.run_id]
        argv += ["--server-addr", f"localhost:{self.server_port}"]
        argv += ["--logs", "tui" if self.tui else "console"]
        if self.cpu_threads is not None:
            argv += ["--cpu-threads", str(self.cpu_threads)]
        if self.write_distro_data is not None:
            argv += ["--write-gradients-dir", str(self.write_distro_data)]
        if number == 1:
            checkpoint_dir = self.checkpoint_dir
            if checkpoint_dir is None and self.first_client_checkpoint is not None:
                checkpoint_dir = DEFAULT_CHECKPOINT_DIR
            if checkpoint_dir is not None:
                argv += ["--checkpoint-dir", str(checkpoint_dir)]
            if self.first_client_checkpoint is not None:
                argv += ["--hub-repo", self.first_client_checkpoint]
        for flag, value in (
            ("--wandb-entity", self.wandb_entity),
            ("--wandb-group", self.wandb_group),
            ("--wandb-project", self.wandb_project),
        ):
            if value is not None:
                argv += [flag, value]
        if self.write_log_dir is not None:
            argv += ["--write-log", str(self.write_log_dir / f"client-{number}.txt")]
        if self.optim_stats is not None:
            # Upstream passes `--optim-stats`, a flag its client does not have.
            argv += ["--optim-stats-steps", str(self.optim_stats)]
        if self.eval_tasks is not None:
            argv += ["--eval-tasks", self.eval_tasks]
            if self.eval_data_dir is not None:
                argv += ["--eval-data-dir", str(self.eval_data_dir)]
        if self.events_dir is not None:
            argv += ["--events-dir", str(self.events_dir)]
        if self.metrics_dir is not None:
            argv += ["--metrics-jsonl", str(self.metrics_dir / f"client-{number}.jsonl")]
        if self.tensorboard_dir is not None:
            argv += ["--tensorboard-dir", str(self.tensorboard_dir / f"client-{number}")]
        argv += self.client_args
        return Command(tuple(argv), tuple(env))


def default_client_program(python: str) -> tuple[str, ...]:
    """`psyche-client` next to `python` (its environment's script), else `python -m`."""
    script = Path(python).parent / "psyche-client"
    if script.is_file():
        return (str(script),)
    return (python, "-m", "psyche.cli.client")


def identity_secret_key_hex(number: int) -> str:
    """Upstream's test keys: the secret key's 32 bytes are the big-endian integer `number`."""
    return format(number, "064x")


def log_dir_name(start: datetime.datetime) -> str:
    """`./logs/<this>/`: the testnet's start time in UTC, as upstream."""
    return start.astimezone(datetime.UTC).strftime("%Y-%m-%d_%H:%M:%S")


def read_run_id(state_path: Path) -> str:
    with open(state_path, "rb") as f:
        doc = tomllib.load(f)
    run_id = doc.get("run_id")
    if not isinstance(run_id, str):
        raise ValueError(f"{state_path}: no run_id string")
    return run_id


def split_args(text: str | None) -> tuple[str, ...]:
    return tuple(shlex.split(text)) if text else ()


def pick_victims(
    candidates: Sequence[int], allowed: Sequence[int], count: int, rng: random.Random
) -> list[int]:
    """Upstream's random kill choice: allowed clients (all when `allowed` is empty), shuffled,
    the first `count`."""
    pool = [c for c in candidates if not allowed or c in allowed]
    rng.shuffle(pool)
    return pool[:count]


__all__ = [
    "DEFAULT_CHECKPOINT_DIR",
    "DEFAULT_LOG",
    "Command",
    "TestnetPlan",
    "default_client_program",
    "identity_secret_key_hex",
    "log_dir_name",
    "pick_victims",
    "read_run_id",
    "split_args",
]
