"""End of an epoch (upstream `state/cooldown.rs`): freeze the model for sharing and checkpoint it.

The weights are rounded through bf16 (so a joiner that receives bf16 tensors gets exactly what
the others continue from), extracted as bf16 CPU tensors and handed to P2P model sharing; with
`--checkpoint-dir` they are written (and with `--hub-repo` uploaded) by `checkpoint`. Writing
and uploading run in the background: the next epoch does not wait for them, the end of the run
does (`wait_for_checkpoints`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from psyche.client.background import Background
from psyche.client.checkpoint import CheckpointConfig, CheckpointJob, write_and_upload
from psyche.client.logs import log_event
from psyche.coordinator.model import Checkpoint
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    import torch

    from psyche.modeling.trainer import Trainer

logger = logging.getLogger(__name__)


def live_model_hash(trainer: Trainer) -> bytes:
    """SHA-256 over the live parameters (name, dtype, shape, bytes): equal hashes, equal weights."""
    from psyche.network.sharable_model import model_hash

    return model_hash(dict(trainer.model.variables()))


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


class Cooldown:
    """The cooldown of each epoch: `start` in the background, `finish` before the next epoch."""

    def __init__(
        self,
        trainer: Trainer,
        identity: NodeIdentity,
        checkpoint: CheckpointConfig | None,
        files: CheckpointFiles,
        share_model: Callable[[dict[str, torch.Tensor]], None],
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
        self._kept_steps: list[int] = []

    def start(self, tasks: Background, run_id: str, epoch: int, step: int) -> None:
        """Freeze the model that ended `epoch` at `step` (the last trained step) on `tasks`."""
        done = trio.Event()
        self._done = done
        self._error = None
        tasks.start_soon(self._run, run_id, epoch, step, done)

    async def _run(self, run_id: str, epoch: int, step: int, done: trio.Event) -> None:
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
            self._share_model(variables)
            if self.checkpoint is not None:
                job = CheckpointJob(
                    self.checkpoint,
                    run_id,
                    step,
                    variables,
                    list(self.files.extra_files),
                    self.files.model_config_json,
                    self.files.tokenizer_json,
                )
                self._writes.start_soon(self._write, job)
        except Exception as e:
            logger.exception("cooldown failed")
            self._error = e
        finally:
            done.set()

    async def _write(self, job: CheckpointJob) -> None:
        path = None
        try:
            path = await write_and_upload(job, self._kept_steps, self._send_checkpoint)
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
