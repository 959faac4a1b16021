"""End of an epoch (upstream `state/cooldown.rs`): freeze the model for sharing and checkpoint it.

The weights are rounded through bf16 (so a joiner that receives bf16 tensors gets exactly what
the others continue from), extracted as bf16 CPU tensors and handed to P2P model sharing; with
`--checkpoint-dir` they are written (`checkpoint`), kept or deleted by the keep policy
(`keep_policy`) and with `--hub-repo`/`--gcs-bucket` uploaded (`upload`). Writing and uploading
run in the background on the client's nursery: the next epoch, a pause or the cooldown's end do
not wait for them, the end of the run does (`wait_for_checkpoints`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from psyche.client.background import Background
from psyche.client.checkpoints.keep_policy import Kept, Kind, classify, to_delete
from psyche.client.checkpoints.store import (
    CheckpointConfig,
    RunInstance,
    checkpoint_path,
    delete_checkpoint,
    find_checkpoints,
    save_checkpoint_locally,
)
from psyche.client.checkpoints.upload import Uploader, UploadJob, log_checkpoint_done
from psyche.client.observe.logs import log_event
from psyche.coordinator.model import Checkpoint
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    import torch

    from psyche.modeling.trainer import Trainer

logger = logging.getLogger(__name__)


def live_model_hash(trainer: Trainer) -> bytes:
    """SHA-256 over the live parameters (name, dtype, shape, bytes): equal hashes, equal weights."""
    from psyche.modeling.sharing import model_hash

    return model_hash(trainer.full_variables())


def extract_for_sharing(trainer: Trainer) -> tuple[dict[str, torch.Tensor], bytes]:
    """Round the live weights through bf16 and take bf16 CPU copies (upstream `truncate_bf16` +
    `extract` + cast); also the hash of the live weights after rounding."""
    import torch

    trainer.truncate_bf16()
    variables = trainer.extract(torch.bfloat16)
    return variables, live_model_hash(trainer)


@dataclass(frozen=True)
class CheckpointFiles:
    """What a checkpoint carries besides the weights: the source checkpoint's files, and the
    config and tokenizer the client knows (written when the source had none)."""

    extra_files: list[Path] = field(default_factory=list)
    model_config_json: str = "{}"
    tokenizer_json: str = ""


@dataclass
class CheckpointJob:
    epoch: int
    step: int
    kind: Kind
    variables: dict[str, torch.Tensor]
    files: CheckpointFiles


class Checkpointer:
    """A client's checkpoints of one run instance (`run`): which to write (`plan`), writing,
    uploading and deleting them (`write`). The instance's complete checkpoints already in the
    directory (a restarted client) count for the keep policy as if this client had written
    them; another run's or instance's are never counted, replaced or deleted."""

    def __init__(
        self,
        config: CheckpointConfig,
        run: RunInstance,
        send_checkpoint: Callable[[Checkpoint], None],
    ):
        self.config = config
        self.run = run
        self.uploader = None if config.upload is None else Uploader(config.upload, send_checkpoint)
        self.kept: list[Kept] | None = None
        # step -> its directory (the plain name, or the tagged one beside another instance's)
        self.paths: dict[int, Path] = {}
        self.last_written_at: float | None = None
        self.previous_step: int | None = None

    def _seed(self) -> list[Kept]:
        if self.kept is None:
            found = find_checkpoints(self.config.checkpoint_dir, self.run)
            self.kept = [
                Kept(f.manifest.step, f.manifest.kind, f.manifest.written_at) for f in found
            ]
            self.paths.update((f.manifest.step, f.path) for f in found)
            if self.kept:
                self.last_written_at = max(k.written_at for k in self.kept)
        return self.kept

    def plan(self, step: int, final: bool, now: float | None = None) -> Kind | None:
        """The kind of the checkpoint of the cooldown at `step` (None: not written); called
        once per cooldown, in order."""
        self._seed()
        now = time.time() if now is None else now
        kind = classify(
            self.config.keep, step, self.previous_step, now, self.last_written_at, final
        )
        self.previous_step = step
        if kind is not None:
            self.last_written_at = now
        return kind

    async def write(self, job: CheckpointJob) -> Path | None:
        """Write the checkpoint, delete what the keep policy no longer keeps, then upload it
        (when a target is set); the directory written, or None when the write failed (logged).
        A failed upload leaves the local copy in place."""
        self._seed()
        path = checkpoint_path(self.config.checkpoint_dir, self.run, job.step)
        started = time.monotonic()
        try:
            await trio.to_thread.run_sync(
                lambda: save_checkpoint_locally(
                    path,
                    job.variables,
                    job.files.extra_files,
                    job.files.model_config_json,
                    job.files.tokenizer_json,
                    run=self.run,
                    step=job.step,
                    epoch=job.epoch,
                    kind=job.kind,
                )
            )
        except Exception as e:
            logger.error("Writing the checkpoint to %s failed: %s", path, e)
            return None
        log_checkpoint_done(
            logger,
            "checkpoint_saved",
            f"saved the model of step {job.step} to {path.absolute()}",
            job.step,
            started,
            path=str(path),
            kind=job.kind.value,
        )
        kept = self._seed()
        kept[:] = [k for k in kept if k.step != job.step]
        kept.append(Kept(job.step, job.kind, time.time()))
        self.paths[job.step] = path
        if self.uploader is not None:
            self.uploader.in_progress.add(job.step)  # kept until its upload is done
        self.cleanup()
        if self.uploader is not None:
            try:
                await self.uploader.upload(UploadJob(self.run.run_id, job.epoch, job.step, path))
            finally:
                self.cleanup()
        return path

    def cleanup(self) -> None:
        """Delete the checkpoints the keep policy lets go (none still uploading): this
        instance's only, each where it was found or written."""
        kept = self._seed()
        protected = set() if self.uploader is None else self.uploader.in_progress
        for step in to_delete(self.config.keep, kept, protected):
            kept[:] = [k for k in kept if k.step != step]
            path = self.paths.pop(step, None)
            if path is not None:
                delete_checkpoint(path)


class Cooldown:
    """The cooldown of each epoch: `start` in the background, `finish` before the next epoch."""

    def __init__(
        self,
        trainer: Trainer,
        identity: NodeIdentity,
        run: RunInstance,
        checkpoint: CheckpointConfig | None,
        files: CheckpointFiles,
        share_model: Callable[[dict[str, torch.Tensor], int], None],
        send_checkpoint: Callable[[Checkpoint], None],
        nursery: trio.Nursery,
    ) -> None:
        self.trainer = trainer
        self.identity = identity
        self.checkpoint = checkpoint
        self.files = files
        self._share_model = share_model
        self._send_checkpoint = send_checkpoint
        self._writes = Background(nursery)
        self._done: trio.Event | None = None
        self._error: BaseException | None = None
        # step -> the directory its checkpoint was written to (None: the write failed)
        self.checkpoints: dict[int, Path | None] = {}
        self.checkpointer = (
            None if checkpoint is None else Checkpointer(checkpoint, run, send_checkpoint)
        )

    def start(self, tasks: Background, epoch: int, step: int, final: bool = False) -> None:
        """Freeze the model that ended `epoch` at `step` (the last trained step) on `tasks`;
        `final`: the run ends or pauses here (a checkpoint is written whatever the policy)."""
        done = trio.Event()
        self._done = done
        self._error = None
        tasks.start_soon(self._run, epoch, step, final, done)

    async def _run(self, epoch: int, step: int, final: bool, done: trio.Event) -> None:
        try:
            variables, live_hash = await trio.to_thread.run_sync(extract_for_sharing, self.trainer)
            log_event(
                logger,
                "cooldown_model",
                text=f"epoch {epoch} ended at step {step}: model hash {live_hash.hex()[:16]}",
                client_id=str(self.identity),
                epoch=epoch,
                step=step,
                model_hash=live_hash,
                parameters=len(variables),
            )
            # the step this model starts: its version, as joiners of the next epoch expect it
            self._share_model(variables, step + 1)
            if self.checkpointer is not None:
                kind = self.checkpointer.plan(step, final)
                if kind is None:
                    logger.info(
                        "no checkpoint of step %d: the temporary interval has not passed", step
                    )
                else:
                    job = CheckpointJob(epoch, step, kind, variables, self.files)
                    self._writes.start_soon(self._write, job)
        except Exception as e:
            logger.exception("cooldown failed")
            self._error = e
        finally:
            done.set()

    async def _write(self, job: CheckpointJob) -> None:
        path = None
        assert self.checkpointer is not None
        try:
            path = await self.checkpointer.write(job)
        finally:
            self.checkpoints[job.step] = path

    async def finish(self) -> None:
        """Wait for the cooldown started last (not for its checkpoint write); raise its error."""
        done, self._done = self._done, None
        if done is not None:
            await done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    async def wait_for_checkpoints(self) -> None:
        """Return once every checkpoint write and upload started so far has ended."""
        await self._writes.wait_idle()
