"""`psyche-solana-client predownload` (upstream's): fetch a run's model (`--model`) and the
evaluation datasets it names (`--eval-tasks`) into the local caches before joining, so the
client's warmup does not wait for them. The run's checkpoint decides the source: a hub repo
(and revision) into the Hugging Face cache, a GCS bucket into `$HF_HOME/psyche/gcs/...` (the
cache the client reads when it joins). Composed here: the checkpoint is the Solana library's
(`psyche.solana.commands.predownload`), the downloads the trainer's and the client's."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from psyche.core.cli import UserError

if TYPE_CHECKING:
    from psyche.solana.commands.predownload import PredownloadOptions


def predownload(options: PredownloadOptions) -> int:
    from psyche.solana.commands.predownload import fetch_coordinator

    if not options.model and not options.eval_tasks:
        raise UserError("nothing to predownload: pass --model and/or --eval-tasks")
    if options.eval_tasks:
        from psyche.modeling.eval.tasks import UnknownTaskError, check_task_names

        try:
            check_task_names(options.eval_tasks)
        except UnknownTaskError as e:
            raise UserError(str(e)) from None
    coordinator = fetch_coordinator(options.cluster, options.run_id)
    if options.model:
        _predownload_model(coordinator)
        print("Model predownloaded successfully.")
    if options.eval_tasks:
        from psyche.modeling.eval.tasks import tasktype_from_name

        for name in options.eval_tasks.split(","):
            tasktype_from_name(name)
        print(f"Eval tasks `{options.eval_tasks}` predownloaded successfully.")
    return 0


def _predownload_model(coordinator: Any) -> Path:
    from psyche.coordinator.model import Checkpoint

    llm = coordinator.model.value
    match llm.checkpoint:
        case Checkpoint.Ephemeral():
            raise UserError("Can't predownload model with ephemeral checkpoint.")
        case Checkpoint.Dummy(repo) | Checkpoint.Hub(repo) | Checkpoint.P2P(repo):
            repo_id = str(repo.repo_id)
            revision = None if repo.revision is None else str(repo.revision)
            print(f"Predownloading model {repo_id} revision {revision or 'main'}")
            if revision is None and Path(repo_id).is_dir():
                print(f"{repo_id} is a local directory: nothing to download")
                return Path(repo_id)
            from psyche.modeling.causal_lm import (
                ModelLoadError,
                architecture_name,
                download_model_repo,
            )

            try:
                architecture = architecture_name(llm.architecture)
                path = download_model_repo(repo_id, revision, architecture=architecture)
            except ModelLoadError as e:
                raise UserError(str(e)) from None
        case Checkpoint.Gcs(repo) | Checkpoint.P2PGcs(repo):
            bucket = str(repo.bucket)
            prefix = None if repo.prefix is None else str(repo.prefix)
            print(f"Predownloading model from gs://{bucket}/{prefix or ''}")
            from psyche.client.checkpoints.gcs import GcsError, download_checkpoint_from_gcs

            try:
                path = download_checkpoint_from_gcs(bucket, prefix)
            except GcsError as e:
                raise UserError(str(e)) from None
            except Exception as e:  # the storage client's errors (network, permissions)
                raise UserError(f"cannot fetch gs://{bucket}/{prefix or ''}: {e}") from None
        case _:
            raise UserError(f"unknown checkpoint {llm.checkpoint!r}")
    print(f"Model files in {path}")
    return path
