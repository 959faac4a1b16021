"""Checkpoint uploads in the background (upstream `upload_to_hub` / `upload_to_gcs`, made robust
as upstream issue #362 asks).

* An upload runs on the client's nursery, not the epoch's: the next epoch, a pause, or a cooldown
  that ends first do not wait for it or stop it; the end of the run does wait.
* Uploads go one at a time, oldest first; an upload that a newer checkpoint overtakes while it
  waits or between its attempts is dropped (the newest wins).
* A failed attempt is retried with exponential backoff (`RetryPolicy`); after the last attempt
  the local copy stays and the error is logged.
* The hub never holds a partial checkpoint: all of a step's files (and the deletion of files the
  previous step had and this one has not) are one commit, so the previous commit stays whole
  until the new one exists. On GCS the manifest goes last (`gcs`).
* The coordinator is told the new checkpoint only once the upload is complete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from psyche.client.checkpoints.gcs import upload_checkpoint_to_gcs
from psyche.client.observe.logs import log_event
from psyche.client.observe.progress import PROGRESS_INTERVAL, log_progress
from psyche.coordinator.model import Checkpoint, GcsRepo, HubRepo

logger = logging.getLogger(__name__)

# Hub files a new step replaces: stale shards or an index of the previous step go in the same
# commit (README.md and .gitattributes stay).
HUB_REPLACED = ["*.safetensors", "*.json", "*.py"]


@dataclass(frozen=True)
class UploadJob:
    run_id: str
    epoch: int
    step: int
    path: Path


@dataclass(frozen=True)
class HubUpload:
    repo: str
    token: str | None = None

    def describe(self) -> str:
        return f"hub repo {self.repo}"

    def upload(self, job: UploadJob) -> Checkpoint:
        """One commit with every file of the checkpoint; the new revision."""
        from huggingface_hub import HfApi

        info = HfApi(token=self.token).upload_folder(
            repo_id=self.repo,
            folder_path=str(job.path),
            commit_message=f"step {job.step}",
            delete_patterns=HUB_REPLACED,
        )
        uploaded: Checkpoint = Checkpoint.Hub(HubRepo(self.repo, str(info.oid)))
        return uploaded


@dataclass(frozen=True)
class GcsUpload:
    bucket: str
    prefix: str | None = None

    def describe(self) -> str:
        return f"gs://{self.bucket}/{self.prefix or ''}"

    def upload(self, job: UploadJob) -> Checkpoint:
        files = sorted(p for p in job.path.iterdir() if p.is_file())
        upload_checkpoint_to_gcs(self.bucket, self.prefix, files, job.run_id, job.epoch, job.step)
        uploaded: Checkpoint = Checkpoint.Gcs(GcsRepo(self.bucket, self.prefix))
        return uploaded


UploadTarget = HubUpload | GcsUpload


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    first_delay: float = 2.0
    max_delay: float = 120.0

    def delay(self, failed_attempts: int) -> float:
        return min(self.first_delay * 2.0 ** (failed_attempts - 1), self.max_delay)


@dataclass
class Uploader:
    """Uploads checkpoints to `target` one at a time (see the module docstring)."""

    target: UploadTarget
    send_checkpoint: Callable[[Checkpoint], None]
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Steps whose upload is waiting or under way: their local directories must stay.
    in_progress: set[int] = field(default_factory=set)
    uploaded: list[int] = field(default_factory=list)
    # While an upload runs, say so this often (size and time so far) for a person watching.
    progress_interval: float = PROGRESS_INTERVAL
    _newest: int = -1
    _lock: trio.Lock = field(default_factory=trio.Lock)

    async def upload(self, job: UploadJob) -> bool:
        """Upload `job` once the uploads before it are done; True when it was uploaded and the
        coordinator told, False when it failed every attempt or a newer step overtook it."""
        self._newest = max(self._newest, job.step)
        self.in_progress.add(job.step)
        try:
            async with self._lock:
                return await self._attempts(job)
        finally:
            self.in_progress.discard(job.step)

    async def _attempts(self, job: UploadJob) -> bool:
        where = self.target.describe()
        for attempt in range(1, self.retry.attempts + 1):
            if job.step < self._newest:
                logger.info("not uploading step %d: step %d is newer", job.step, self._newest)
                return False
            started = time.monotonic()
            try:
                checkpoint = await self._upload_once(job, where, started)
            except Exception as e:
                if attempt == self.retry.attempts:
                    logger.error(
                        "Couldn't upload the checkpoint of step %d to %s after %d attempts: %s "
                        "(the local copy at %s stays)",
                        job.step,
                        where,
                        attempt,
                        e,
                        job.path,
                    )
                    return False
                delay = self.retry.delay(attempt)
                logger.warning(
                    "uploading step %d to %s failed (attempt %d of %d): %s; retrying in %.0f s",
                    job.step,
                    where,
                    attempt,
                    self.retry.attempts,
                    e,
                    delay,
                )
                await trio.sleep(delay)
                continue
            log_checkpoint_done(
                logger,
                "checkpoint_uploaded",
                f"uploaded the model of step {job.step} to {where}",
                job.step,
                started,
                target=where,
                checkpoint=str(checkpoint),
                revision=_revision(checkpoint),
            )
            self.uploaded.append(job.step)
            self.send_checkpoint(checkpoint)
            return True
        return False

    async def _upload_once(self, job: UploadJob, where: str, started: float) -> Checkpoint:
        """One attempt in a worker thread, with a progress line every `progress_interval`."""
        megabytes = sum(p.stat().st_size for p in job.path.iterdir() if p.is_file()) / 1e6
        outcome: list[Checkpoint | Exception] = []

        def describe() -> str:
            return (
                f"uploading the model of step {job.step} to {where} "
                f"({megabytes:.0f} MB, {time.monotonic() - started:.0f} s so far)"
            )

        async with trio.open_nursery() as nursery:

            async def attempt() -> None:
                try:
                    outcome.append(await trio.to_thread.run_sync(self.target.upload, job))
                except Exception as e:  # returned below, outside the nursery's group
                    outcome.append(e)
                nursery.cancel_scope.cancel()

            nursery.start_soon(attempt)
            nursery.start_soon(log_progress, logger, describe, self.progress_interval)
        (result,) = outcome
        if isinstance(result, Exception):
            raise result
        return result


def log_checkpoint_done(
    logger: logging.Logger, event: str, done: str, step: int, started: float, **fields: Any
) -> None:
    """Event `event` for the checkpoint of `step`: `done` (what was done with it, where) and
    how long it took since `started` (`time.monotonic()`), as text and as the `secs` field."""
    secs = time.monotonic() - started
    log_event(
        logger, event, text=f"{done} ({secs:.1f} s)", step=step, **fields, secs=round(secs, 3)
    )


def _revision(checkpoint: Checkpoint) -> str | None:
    match checkpoint:
        case Checkpoint.Hub(repo):
            return None if repo.revision is None else str(repo.revision)
    return None
