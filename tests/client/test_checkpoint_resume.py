"""Complete checkpoints only: every checkpoint carries a manifest of its files' sizes and hashes,
an interrupted write (a staging directory, a file missing or changed, no manifest) is never
chosen, a restarted client resumes from its directory's checkpoint of the epoch's start step,
and the keep policy counts the checkpoints a previous run of the client left."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import trio

from psyche.client.checkpoint import (
    MANIFEST_NAME,
    CheckpointConfig,
    latest_complete,
    remove_stale_staging,
    save_checkpoint_locally,
    verify_checkpoint,
)
from psyche.client.cooldown import Checkpointer, CheckpointFiles, CheckpointJob
from psyche.client.keep_policy import KeepPolicy, Kind
from psyche.client.model_loading import resume_checkpoint

RUN = "run"


def save(directory: Path, step: int, value: float = 0.0, kind: Kind = Kind.recent) -> Path:
    path = directory / f"{RUN}-step{step}"
    save_checkpoint_locally(
        path, {"w": torch.full((64,), value)}, [], '{"a": 1}', "{}", epoch=1, kind=kind
    )
    return path


def test_the_manifest_names_every_file(tmp_path: Path) -> None:
    path = save(tmp_path, 9)
    manifest = verify_checkpoint(path)
    assert manifest is not None
    assert (manifest.run_id, manifest.step, manifest.epoch, manifest.kind) == (
        RUN,
        9,
        1,
        Kind.recent,
    )
    assert sorted(manifest.files) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(p.name for p in path.iterdir()) == sorted([*manifest.files, MANIFEST_NAME])
    assert manifest.files["model.safetensors"].size == (path / "model.safetensors").stat().st_size


@pytest.mark.parametrize("damage", ["missing file", "changed file", "no manifest", "bad manifest"])
def test_a_partial_checkpoint_is_never_chosen(tmp_path: Path, damage: str) -> None:
    older = save(tmp_path, 9, 1.0)
    newest = save(tmp_path, 19, 2.0)
    # an interrupted write: its staging directory, holding a newer step's files
    staging = tmp_path / f".{RUN}-step29.pid999999999.abc.tmp"
    shutil.copytree(newest, staging)
    match damage:
        case "missing file":
            (newest / "model.safetensors").unlink()
        case "changed file":
            data = bytearray((newest / "model.safetensors").read_bytes())
            data[-1] ^= 1
            (newest / "model.safetensors").write_bytes(bytes(data))
        case "no manifest":
            (newest / MANIFEST_NAME).unlink()
        case "bad manifest":
            (newest / MANIFEST_NAME).write_text("{")
    assert verify_checkpoint(newest) is None
    found = latest_complete(tmp_path, RUN)
    assert found is not None and found.path == older and found.manifest.step == 9
    assert latest_complete(tmp_path, RUN, 19) is None
    assert resume_checkpoint(tmp_path, RUN, 19) is None
    assert resume_checkpoint(tmp_path, RUN, 9) == older
    assert latest_complete(tmp_path, "other-run") is None
    # the staging directory's writer is gone: it is removed at start
    assert remove_stale_staging(tmp_path) == [staging]


def test_resume_needs_the_exact_step(tmp_path: Path) -> None:
    save(tmp_path, 9)
    assert resume_checkpoint(tmp_path, RUN, 9) == tmp_path / f"{RUN}-step9"
    assert resume_checkpoint(tmp_path, RUN, 10) is None  # an older model would diverge
    assert resume_checkpoint(tmp_path, RUN, -1) is None
    assert resume_checkpoint(tmp_path / "absent", RUN, 9) is None


def test_a_restarted_client_keeps_counting_its_checkpoints(tmp_path: Path) -> None:
    """keep-steps 2: the first client wrote steps 9 and 19; a restarted one writes 29 and
    deletes 9 (its own policy includes what it found), and a temporary from before goes as
    soon as a newer checkpoint lands."""
    save(tmp_path, 9)
    save(tmp_path, 19)
    save(tmp_path, 14, kind=Kind.temporary)
    config = CheckpointConfig(tmp_path, keep=KeepPolicy(keep_steps=2))
    checkpointer = Checkpointer(config, lambda _: None)
    kind = checkpointer.plan(RUN, 29, final=False)
    assert kind is Kind.recent
    job = CheckpointJob(RUN, 2, 29, kind, {"w": torch.zeros(64)}, CheckpointFiles([], "{}", ""))
    assert trio.run(checkpointer.write, job) == tmp_path / f"{RUN}-step29"
    assert sorted(os.listdir(tmp_path)) == [f"{RUN}-step19", f"{RUN}-step29"]
