"""Checkpoints of the model an epoch ended with (upstream `state/cooldown.rs`, its checkpoint
half): written in Hugging Face layout to `{dir}/{run_id}-step{step}`, uploaded to the hub with
`--hub-repo` (the coordinator is then told the new revision), old steps removed.

A checkpoint is written into a staging directory `.{run_id}-step{step}.pid{pid}.{random}.tmp`
next to it and renamed when complete. A client killed meanwhile leaves its staging directory
behind; `remove_stale_staging` (called when a client starts) removes those whose writer is no
longer running (on this machine), so they do not pile up.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from psyche.client.logs import log_event
from psyche.coordinator.model import Checkpoint, HubRepo
from psyche.core.atomic_file import fsync_directory

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_dir: Path
    hub_repo: str | None = None
    hub_token: str | None = None
    delete_old_steps: bool = True
    keep_steps: int = 3


def checkpoint_path(config: CheckpointConfig, run_id: str, step: int) -> Path:
    return config.checkpoint_dir / f"{run_id}-step{step}"


def save_checkpoint_locally(
    path: Path,
    variables: dict[str, torch.Tensor],
    extra_files: Sequence[Path],
    model_config_json: str,
    tokenizer_json: str,
) -> list[Path]:
    """The safetensors parts, the source checkpoint's config/tokenizer files, and a config.json
    (and tokenizer.json) written from what the client knows when the source had none.

    Everything is written into a temporary sibling directory that is renamed to `path` once
    complete, so a failed save (a full disk) leaves no half checkpoint under a step's name.
    """
    from psyche.modeling.checkpoint import save_tensors_into_safetensors

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(prefix=f".{path.name}.pid{os.getpid()}.", suffix=".tmp", dir=path.parent)
    )
    try:
        written = save_tensors_into_safetensors(variables, staging)
        names = set()
        for src in extra_files:
            shutil.copyfile(src, staging / src.name)
            written.append(staging / src.name)
            names.add(src.name)
        if "config.json" not in names:
            (staging / "config.json").write_text(model_config_json + "\n")
            written.append(staging / "config.json")
        if "tokenizer.json" not in names and tokenizer_json:
            (staging / "tokenizer.json").write_text(tokenizer_json)
            written.append(staging / "tokenizer.json")
        for file in written:
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        if path.exists():
            shutil.rmtree(path)  # the same step saved again
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_directory(path.parent)
    return [path / file.name for file in written]


_STAGING = re.compile(r"^\..+-step\d+\.pid(\d+)\.[^.]+\.tmp$")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def remove_stale_staging(checkpoint_dir: Path) -> list[Path]:
    """Remove the staging directories in `checkpoint_dir` that a killed client left behind (those
    whose writing process is gone); returns them. A live writer's, this process's and anything
    not named like a staging directory are left alone; a missing directory is fine."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(checkpoint_dir))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        match = _STAGING.match(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _running(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.exists(entry.path):
            logger.info("removed %s, left by a client stopped while checkpointing", entry.path)
            removed.append(Path(entry.path))
    return removed


def upload_to_hub(path: Path, repo_id: str, token: str | None, step: int) -> str:
    """Upload a checkpoint directory; returns the commit (revision) it created."""
    from huggingface_hub import HfApi

    info = HfApi(token=token).upload_folder(
        repo_id=repo_id, folder_path=str(path), commit_message=f"step {step}"
    )
    return str(info.oid)


def check_hub_repo_writable(repo_id: str, token: str) -> None:
    """Fail early (as upstream) when the upload repo is not writable with this token."""
    from huggingface_hub import HfApi

    try:
        HfApi(token=token).auth_check(repo_id, repo_type="model", write=True)
    except TypeError:  # older huggingface_hub without `write`
        HfApi(token=token).auth_check(repo_id, repo_type="model")
    except Exception as e:
        raise RuntimeError(
            f"Checkpoint upload repo {repo_id} is not writable with the passed API key: {e}"
        ) from e


def cleanup_old_steps(config: CheckpointConfig, run_id: str, kept: list[int], step: int) -> None:
    """Keep the newest `keep_steps` step directories this client wrote (upstream's heap)."""
    if not config.delete_old_steps:
        return
    kept.append(step)
    kept.sort()
    while len(kept) > config.keep_steps:
        old = kept.pop(0)
        doomed = checkpoint_path(config, run_id, old)
        try:
            shutil.rmtree(doomed)
            logger.info("Successfully removed %s", doomed)
        except OSError as e:
            logger.warning("Error removing %s : %s", doomed, e)


@dataclass
class CheckpointJob:
    config: CheckpointConfig
    run_id: str
    step: int
    variables: dict[str, torch.Tensor]
    extra_files: list[Path]
    model_config_json: str
    tokenizer_json: str


async def write_and_upload(
    job: CheckpointJob, kept_steps: list[int], send_checkpoint: Callable[[Checkpoint], None]
) -> Path | None:
    """Write the checkpoint (then upload it when a hub repo is set); the directory written, or
    None when the write failed (logged). A failed upload leaves the local copy in place."""
    path = checkpoint_path(job.config, job.run_id, job.step)
    started = time.monotonic()
    try:
        await trio.to_thread.run_sync(
            save_checkpoint_locally,
            path,
            job.variables,
            job.extra_files,
            job.model_config_json,
            job.tokenizer_json,
        )
    except Exception as e:
        logger.error("Writing the checkpoint to %s failed: %s", path, e)
        return None
    secs = time.monotonic() - started
    log_event(
        logger,
        "checkpoint_saved",
        text=f"saved the model of step {job.step} to {path.absolute()} ({secs:.1f} s)",
        step=job.step,
        path=str(path),
        secs=round(secs, 3),
    )
    if job.config.hub_repo is not None:
        try:
            revision = await trio.to_thread.run_sync(
                upload_to_hub, path, job.config.hub_repo, job.config.hub_token, job.step
            )
        except Exception as e:
            logger.error("Couldn't upload model to huggingface: %s", e)
            return path
        log_event(
            logger,
            "checkpoint_uploaded",
            step=job.step,
            repo=job.config.hub_repo,
            revision=revision,
        )
        send_checkpoint(Checkpoint.Hub(HubRepo(job.config.hub_repo, revision)))
    cleanup_old_steps(job.config, job.run_id, kept_steps, job.step)
    return path
