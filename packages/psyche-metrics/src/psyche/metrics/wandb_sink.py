"""Weights & Biases (the `wandb` extra): one W&B run per command, as upstream's client creates.

The run is created on the tracker's worker thread (`wandb.init` starts W&B's service process
and, online, talks to the server: seconds, or a failure without a network). As upstream, a run
that cannot be created does not stop training: the tracker is switched off with one warning.
Under `WANDB_MODE=offline` nothing leaves the machine: the run is written to
`<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb`, for `wandb sync` later.

W&B is told not to capture the console, sample system statistics, or save code and git state:
the command's output stays its own, and nothing but what is logged is recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

import wandb

from .config import WandbInfo
from .tracker import MetricValue

WandbMode = Literal["online", "offline", "disabled", "shared"]


class WandbSink:
    name = "wandb"

    def __init__(self, info: WandbInfo, run_config: Mapping[str, Any] | None = None) -> None:
        self.info = info
        self._run_config = dict(run_config or {})
        self._run: Any = None

    def open(self) -> None:
        info = self.info
        settings: dict[str, Any] = {
            "console": "off",
            "silent": True,
            "x_disable_stats": True,
            "save_code": False,
            "disable_git": True,
        }
        if info.api_key is not None:
            settings["api_key"] = info.api_key
        self._run = wandb.init(
            project=info.project,
            name=info.run,
            entity=info.entity,
            group=info.group,
            config=self._run_config,
            dir=None if info.dir is None else str(info.dir),
            # wandb types the mode as a Literal; ours is WANDB_MODE as given, which wandb checks.
            mode=cast(WandbMode, info.mode),
            reinit="create_new",
            settings=wandb.Settings(**settings),
        )

    def write(self, metrics: dict[str, MetricValue], step: int, timestamp: float) -> None:
        self._run.log(metrics, step=step, commit=True)  # one call per step: the row is whole

    def write_summary(self, metrics: dict[str, MetricValue], timestamp: float) -> None:
        self._run.summary.update(metrics)

    def close(self, timeout: float) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()
            # W&B's service process writes the run file; `finish` can return before that file
            # is complete (wandb 0.31, offline). `teardown` waits for the service to exit, so
            # the run is whole on disk when the tracker's `finish` returns. The commands make
            # one W&B run per process, so no other run is cut short.
            wandb.teardown()
