"""Checkpoint uploads through `huggingface_hub` to a hub stand-in on loopback (hub_endpoint.py),
as upstream issue #362 asks: in the background (the next cooldowns end while an upload is held),
one commit per checkpoint with every file (the previous commit stays whole until then, stale
files go in the same commit), retried with backoff, the newest checkpoint winning over one that
waits; the coordinator is told the revision, and a joiner loads the model from it."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
import trio

from psyche.client.background import Background
from psyche.client.checkpoints.cooldown import (
    Checkpointer,
    CheckpointFiles,
    CheckpointJob,
    Cooldown,
)
from psyche.client.checkpoints.keep_policy import KeepPolicy, Kind
from psyche.client.checkpoints.store import (
    MANIFEST_NAME,
    CheckpointConfig,
    RunInstance,
    verify_checkpoint,
)
from psyche.client.checkpoints.upload import HubUpload, RetryPolicy
from psyche.client.setup.model_loading import config_json_of, load_hub_checkpoint
from psyche.coordinator.model import Checkpoint, HubRepo
from psyche.core.node_identity import NodeIdentity

from ..modeling.tiny_trainer import make_trainer
from ..polling import poll_until
from .hub_endpoint import HubEndpoint

REPO = "org/model"
RUN = "run"
INSTANCE = RunInstance(RUN, "instance-1")
FAST_RETRY = RetryPolicy(attempts=4, first_delay=0.01)


def test_a_failing_hub_is_retried_and_never_left_partial(hub: HubEndpoint, tmp_path: Path) -> None:
    # the previous checkpoint was sharded: its shards and index go in the new step's commit
    old = {
        "model-00001-of-00002.safetensors": b"a",
        "model-00002-of-00002.safetensors": b"b",
        "model.safetensors.index.json": b"{}",
        "README.md": b"model card",
    }
    hub.create_repo(REPO, old)
    hub.fail_commits = 2
    sent: list[Checkpoint] = []
    config = CheckpointConfig(tmp_path / "ckpt", HubUpload(REPO, "token"))
    checkpointer = Checkpointer(config, INSTANCE, sent.append)
    assert checkpointer.uploader is not None
    checkpointer.uploader.retry = FAST_RETRY
    job = CheckpointJob(1, 9, Kind.recent, {"w": torch.ones(32)}, CheckpointFiles([], "{}", ""))
    path = trio.run(checkpointer.write, job)
    assert path is not None
    assert verify_checkpoint(path) is not None
    assert hub.fail_commits == 0  # both failures were met, then a retry went through
    assert hub.commit_messages(REPO) == ["initial commit", "step 9"]
    files = hub.head_files(REPO)
    local = {p.name: p.read_bytes() for p in path.iterdir()}
    assert {k: v for k, v in files.items() if k not in (".gitattributes", "README.md")} == local
    assert MANIFEST_NAME in files
    assert files["README.md"] == b"model card"
    head = hub.repos[REPO].head
    assert head is not None
    assert sent == [Checkpoint.Hub(HubRepo(REPO, head.oid))]


def test_uploads_run_behind_the_epochs_and_the_newest_wins(
    hub: HubEndpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client.checkpoints.upload")
    hub.create_repo(REPO)
    hub.hold_commits = threading.Event()
    trainer = make_trainer()
    sent: list[Checkpoint] = []
    shared: list[int] = []  # the version each cooldown's model is shared under
    config = CheckpointConfig(tmp_path / "ckpt", HubUpload(REPO, "token"), KeepPolicy(keep_steps=1))
    files = CheckpointFiles([], config_json_of(trainer.model), "")
    identity = NodeIdentity.from_single_key(bytes(range(32)))

    def saved() -> list[str]:
        return sorted(p.name for p in config.checkpoint_dir.iterdir() if not p.name.startswith("."))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            tasks = Background(nursery)
            cooldown = Cooldown(
                trainer,
                identity,
                INSTANCE,
                config,
                files,
                lambda _, version: shared.append(version),
                sent.append,
                nursery,
            )
            assert cooldown.checkpointer is not None
            assert cooldown.checkpointer.uploader
            cooldown.checkpointer.uploader.retry = FAST_RETRY
            cooldown.checkpointer.uploader.progress_interval = 0.2
            cooldown.start(tasks, 0, 9)
            await cooldown.finish()
            # the upload of step 9 is under way and held by the hub
            assert await trio.to_thread.run_sync(hub.commit_started.wait, 60)
            for epoch, step in ((1, 19), (2, 29)):  # the next epochs end meanwhile
                cooldown.start(tasks, epoch, step, step == 29)
                await cooldown.finish()
            with trio.fail_after(60):
                # written, waiting for their uploads: all kept
                await poll_until(lambda: len(saved()) >= 3, 0.05)
            assert sent == []
            assert hub.commit_messages(REPO) == ["initial commit"]
            with trio.fail_after(60):  # a person watching sees the held upload go on
                await poll_until(
                    lambda: any(
                        r.getMessage().startswith(
                            f"uploading the model of step 9 to hub repo {REPO}"
                        )
                        and "s so far)" in r.getMessage()
                        for r in caplog.records
                    ),
                    0.05,
                )
            hub.hold_commits.set()
            with trio.fail_after(120):
                await cooldown.wait_for_checkpoints()
            # each model is shared as of the step it starts (its cooldown's own, one past the
            # last trained step), whatever the live state is when the extraction ends
            assert shared == [10, 20, 30]

    trio.run(main)
    # step 19 was overtaken by 29 while it waited; the hub went from one whole commit to the next
    assert hub.commit_messages(REPO) == ["initial commit", "step 9", "step 29"]
    revisions = [c.oid for c in hub.repos[REPO].commits[1:]]
    assert sent == [Checkpoint.Hub(HubRepo(REPO, r)) for r in revisions]
    assert saved() == [f"{RUN}-step29"]  # keep-steps 1, once nothing is uploading
    # a joiner of the run loads the uploaded model: the weights the cooldown rounded
    loaded = load_hub_checkpoint(REPO, revisions[-1], "HfLlama", torch.device("cpu"))
    live = dict(trainer.model.variables())
    for name, tensor in loaded.model.variables():
        assert torch.equal(tensor, live[name]), name
