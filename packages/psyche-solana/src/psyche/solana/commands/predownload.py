"""The Solana half of `predownload` (upstream solana-client's): which checkpoint a run names.
Fetching the model and the evaluation datasets it names is the client's and the trainer's, so
the command composes them above this package (`psyche.cli.solana_client.predownload`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psyche.solana.commands.args import ClusterOptions, RunQuery, env_arg, env_flag
from psyche.solana.commands.shell import run_read


@dataclass(frozen=True, kw_only=True)
class PredownloadOptions(RunQuery):
    model: bool = env_arg(
        "MODEL",
        action="store_true",
        from_env=env_flag,
        default=False,
        help="the model of the run's checkpoint (hub repo or GCS bucket)",
    )
    eval_tasks: str | None = env_arg("EVAL_TASKS", default=None)
    hub_max_concurrent_downloads: int = env_arg(
        "HUB_MAX_CONCURRENT_DOWNLOADS",
        type=int,
        default=3,
        help="accepted as upstream's (huggingface_hub picks its own parallelism)",
    )


def fetch_coordinator(cluster: ClusterOptions, run_id: str) -> Any:
    """The run's coordinator (`psyche.coordinator.Coordinator`) as the cluster holds it; a
    `UserError` when it cannot be read."""
    from psyche.solana import snapshots

    found: list[Any] = []

    async def body(backend: Any) -> None:
        snapshot = await snapshots.fetch_run(backend, run_id)
        found.append(snapshot.account.state.coordinator)

    run_read(cluster, body)
    return found[0]


__all__ = ["PredownloadOptions", "fetch_coordinator"]
