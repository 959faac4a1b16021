"""Which trackers a run uses: `TrackerConfig`, filled from a command line, and upstream's rules
about it.

Field names are upstream's flag names (`--wandb-project` -> `wandb_project`, `--oltp-*` ->
`oltp_*`), so a command's parsed options fill it by name (`TrackerConfig.from_options`). The
rules (`wandb_info`, `TrackerConfig.problems`) are plain functions of the config and an
environment mapping, so they are tested without touching `os.environ`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from psyche.core.cli import UserError

from .threaded import DEFAULT_QUEUE_SIZE
from .tracker import DEFAULT_FINISH_TIMEOUT

DEFAULT_WANDB_PROJECT = "psyche"
"""Upstream's project when `--wandb-project` is not given."""

DEFAULT_OLTP_REPORT_INTERVAL = 60.0
"""Upstream's `--oltp-report-interval` default, seconds."""

WANDB_OFFLINE_MODES = ("offline", "dryrun")
"""`WANDB_MODE` values under which W&B writes a local run directory and needs no API key."""


WANDB_MODES = ("online", "offline", "dryrun", "disabled", "shared", "run")
"""The `WANDB_MODE` values W&B knows."""


class TrackerConfigError(UserError):
    """A tracker setting that cannot work (W&B without `WANDB_API_KEY`, a bad interval)."""


class MissingExtraError(TrackerConfigError):
    """A tracker was asked for but its optional dependency is not installed."""

    def __init__(self, what: str, extra: str) -> None:
        super().__init__(
            f"{what} needs the '{extra}' extra, which is not installed: "
            f"pip install 'psyche-metrics[{extra}]'"
        )
        self.extra = extra


@dataclass(frozen=True, kw_only=True)
class TrackerConfig:
    """Every tracker setting a client or server command takes. All off by default."""

    wandb_project: str | None = None
    """W&B project (`--wandb-project`; upstream's default `psyche` once W&B is on)."""

    wandb_run: str | None = None
    """W&B run name (`--wandb-run`; default: the name the command gives, upstream's
    `<run id>-<identity>`)."""

    wandb_group: str | None = None
    """W&B run group (`--wandb-group`): the clients of one run side by side."""

    wandb_entity: str | None = None
    """W&B entity, a user or team (`--wandb-entity`; default: the API key's)."""

    wandb_dir: Path | None = None
    """Directory W&B writes its run directory under (default: W&B's own, `./wandb` or
    `WANDB_DIR`). With `WANDB_MODE=offline` the run is written there and synced later with
    `wandb sync`."""

    tensorboard_dir: Path | None = None
    """Write TensorBoard event files to this directory (`--tensorboard-dir`)."""

    metrics_jsonl: Path | None = None
    """Append one JSON line per logged step to this file (`--metrics-jsonl`)."""

    oltp_metrics_url: str | None = None
    """OTLP/HTTP endpoint for OpenTelemetry metrics, usually ending in `/v1/metrics`
    (`--oltp-metrics-url`)."""

    oltp_tracing_url: str | None = None
    """OTLP/HTTP endpoint for OpenTelemetry traces, usually ending in `/v1/traces`
    (`--oltp-tracing-url`): one span per logged step."""

    oltp_logs_url: str | None = None
    """OTLP/HTTP endpoint for OpenTelemetry logs, usually ending in `/v1/logs`
    (`--oltp-logs-url`): the command's log records (the `psyche` loggers)."""

    oltp_auth_header: str | None = None
    """Value of the `authorization` header sent with every OTLP request (`--oltp-auth-header`),
    for metrics, traces and logs alike."""

    oltp_report_interval: float = DEFAULT_OLTP_REPORT_INTERVAL
    """Seconds between two exports of the OpenTelemetry metrics (`--oltp-report-interval`)."""

    queue_size: int = DEFAULT_QUEUE_SIZE
    """Entries each tracker may fall behind by before it drops what is logged."""

    finish_timeout: float = DEFAULT_FINISH_TIMEOUT
    """Seconds the trackers get to write out and close when the command ends."""

    @classmethod
    def from_options(cls, options: Any, **overrides: Any) -> TrackerConfig:
        """The config from an object with attributes of the same names (a parsed argparse
        namespace, the client's `TrainOptions`); missing attributes keep their defaults and
        `overrides` win."""
        values = {
            f.name: getattr(options, f.name)
            for f in fields(cls)
            if getattr(options, f.name, None) is not None
        }
        values.update(overrides)
        return cls(**values)

    @property
    def wants_wandb(self) -> bool:
        """Whether a W&B flag was given (W&B may also be on through `WANDB_API_KEY` alone)."""
        return any(
            v is not None
            for v in (self.wandb_project, self.wandb_run, self.wandb_group, self.wandb_entity)
        )

    @property
    def wants_otel(self) -> bool:
        return any(
            v is not None
            for v in (self.oltp_metrics_url, self.oltp_tracing_url, self.oltp_logs_url)
        )

    def problems(self) -> list[str]:
        """What is wrong with the settings themselves (not the environment), one line each."""
        out = []
        if not self.oltp_report_interval > 0:
            out.append(f"--oltp-report-interval must be positive, got {self.oltp_report_interval}")
        if self.queue_size < 1:
            out.append(f"the tracker queue size must be at least 1, got {self.queue_size}")
        if not self.finish_timeout >= 0:
            out.append(f"the tracker finish timeout must be >= 0, got {self.finish_timeout}")
        for flag, url in (
            ("--oltp-metrics-url", self.oltp_metrics_url),
            ("--oltp-tracing-url", self.oltp_tracing_url),
            ("--oltp-logs-url", self.oltp_logs_url),
        ):
            if url is not None and not url.startswith(("http://", "https://")):
                out.append(f"{flag} must be an http:// or https:// URL, got {url!r}")
        if self.oltp_auth_header is not None and not self.wants_otel:
            out.append("--oltp-auth-header was given without any --oltp-*-url")
        return out


@dataclass(frozen=True)
class WandbInfo:
    """A W&B run to create (upstream's `WandBInfo`)."""

    project: str
    run: str
    entity: str | None
    group: str | None
    api_key: str | None
    """None only in offline mode."""
    mode: str | None
    """`WANDB_MODE` as given (`offline`, `online`, ...), None for W&B's default."""
    dir: Path | None


def wandb_info(
    config: TrackerConfig, run_name: str, env: Mapping[str, str] | None = None
) -> WandbInfo | None:
    """Upstream's rule (`TrainArgs::wandb_info`): with `WANDB_API_KEY` set, W&B is on (project
    `psyche` and run `run_name` unless given); without it, any `--wandb-*` flag is an error, and
    with none W&B is off. This port adds offline mode: under `WANDB_MODE=offline` the flags
    need no key and the run is written locally. `WANDB_MODE=disabled` turns W&B off."""
    env = os.environ if env is None else env
    api_key = env.get("WANDB_API_KEY") or None
    mode = (env.get("WANDB_MODE") or "").strip().lower() or None
    if mode == "disabled":
        return None
    if mode is not None and mode not in WANDB_MODES:
        raise TrackerConfigError(
            f"WANDB_MODE={mode!r} is not a W&B mode (one of {', '.join(WANDB_MODES)})"
        )
    offline = mode in WANDB_OFFLINE_MODES
    if offline:
        mode = "offline"
    if api_key is None and not (offline and config.wants_wandb):
        if config.wants_wandb:
            raise TrackerConfigError(
                "WANDB_API_KEY environment variable must be set for wandb integration "
                "(or WANDB_MODE=offline to write the run to a local directory)"
            )
        return None
    return WandbInfo(
        project=config.wandb_project or DEFAULT_WANDB_PROJECT,
        run=config.wandb_run or run_name,
        entity=config.wandb_entity,
        group=config.wandb_group,
        api_key=api_key,
        mode=mode,
        dir=config.wandb_dir,
    )


@dataclass(frozen=True)
class ServiceInfo:
    """Who is reporting, sent with every OpenTelemetry export as resource attributes
    (upstream's `ServiceInfo`, the same five attributes)."""

    name: str
    """`service.name`: upstream's `psyche-centralized-client` / `psyche-centralized-server`."""
    instance_id: str
    """`service.instance.id`: the client's public key; upstream's server says `server`."""
    namespace: str = "psyche"
    """`service.namespace`."""
    deployment_environment: str = "development"
    """`deployment.environment.name`: upstream reads `DEPLOYMENT_ENV` (`from_env`)."""
    run_id: str | None = None
    """`run.id` (sent as "" when None, as upstream)."""
    scope: str = "psyche"
    """The instrumentation scope metrics and spans are recorded under (upstream's client
    meter is `psyche_client`)."""

    @classmethod
    def from_env(
        cls,
        name: str,
        instance_id: str,
        *,
        run_id: str | None = None,
        scope: str = "psyche",
        env: Mapping[str, str] | None = None,
    ) -> ServiceInfo:
        env = os.environ if env is None else env
        return cls(
            name=name,
            instance_id=instance_id,
            deployment_environment=env.get("DEPLOYMENT_ENV", "development"),
            run_id=run_id,
            scope=scope,
        )

    def attributes(self) -> dict[str, str]:
        return {
            "service.name": self.name,
            "service.instance.id": self.instance_id,
            "service.namespace": self.namespace,
            "deployment.environment.name": self.deployment_environment,
            "run.id": self.run_id or "",
        }
