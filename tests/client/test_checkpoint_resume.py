"""Complete checkpoints only: every checkpoint carries a manifest of its files' sizes and hashes,
an interrupted write (a staging directory, a file missing or changed, no manifest) is never
chosen, a restarted client resumes from its directory's checkpoint of the epoch's start step,
and the keep policy counts the checkpoints a previous run of the client left."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import trio

from psyche.client.checkpoints.cooldown import Checkpointer, CheckpointFiles, CheckpointJob
from psyche.client.checkpoints.keep_policy import KeepPolicy, Kind
from psyche.client.checkpoints.store import (
    MANIFEST_NAME,
    CheckpointConfig,
    RunInstance,
    checkpoint_path,
    latest_complete,
    remove_stale_staging,
    save_checkpoint_locally,
    verify_checkpoint,
)
from psyche.client.setup.model_loading import resume_checkpoint

RUN = "run"
INSTANCE = RunInstance(RUN, "instance-1")


def save(
    directory: Path,
    step: int,
    value: float = 0.0,
    kind: Kind = Kind.recent,
    run: RunInstance = INSTANCE,
) -> Path:
    path = checkpoint_path(directory, run, step)
    save_checkpoint_locally(
        path,
        {"w": torch.full((64,), value)},
        [],
        '{"a": 1}',
        "{}",
        run=run,
        step=step,
        epoch=1,
        kind=kind,
    )
    return path


def test_the_manifest_names_every_file(tmp_path: Path) -> None:
    path = save(tmp_path, 9)
    manifest = verify_checkpoint(path)
    assert manifest is not None
    assert (
        manifest.run_id,
        manifest.run_identity,
        manifest.step,
        manifest.epoch,
        manifest.kind,
    ) == (RUN, "instance-1", 9, 1, Kind.recent)
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
    found = latest_complete(tmp_path, INSTANCE)
    assert found is not None
    assert found.path == older
    assert found.manifest.step == 9
    assert latest_complete(tmp_path, INSTANCE, 19) is None
    assert resume_checkpoint(tmp_path, INSTANCE, 19) is None
    assert resume_checkpoint(tmp_path, INSTANCE, 9) == older
    assert latest_complete(tmp_path, RunInstance("other-run", "instance-1")) is None
    # the staging directory's writer is gone: it is removed at start
    assert remove_stale_staging(tmp_path) == [staging]


def test_resume_needs_the_exact_step(tmp_path: Path) -> None:
    save(tmp_path, 9)
    assert resume_checkpoint(tmp_path, INSTANCE, 9) == tmp_path / f"{RUN}-step9"
    assert resume_checkpoint(tmp_path, INSTANCE, 10) is None  # an older model would diverge
    assert resume_checkpoint(tmp_path, INSTANCE, -1) is None
    assert resume_checkpoint(tmp_path / "absent", INSTANCE, 9) is None


def test_a_restarted_client_keeps_counting_its_checkpoints(tmp_path: Path) -> None:
    """keep-steps 2: the first client wrote steps 9 and 19; a restarted one writes 29 and
    deletes 9 (its own policy includes what it found), and a temporary from before goes as
    soon as a newer checkpoint lands."""
    save(tmp_path, 9)
    save(tmp_path, 19)
    save(tmp_path, 14, kind=Kind.temporary)
    config = CheckpointConfig(tmp_path, keep=KeepPolicy(keep_steps=2))
    checkpointer = Checkpointer(config, INSTANCE, lambda _: None)
    kind = checkpointer.plan(29, final=False)
    assert kind is Kind.recent
    job = CheckpointJob(2, 29, kind, {"w": torch.zeros(64)}, CheckpointFiles([], "{}", ""))
    assert trio.run(checkpointer.write, job) == tmp_path / f"{RUN}-step29"
    assert sorted(os.listdir(tmp_path)) == [f"{RUN}-step19", f"{RUN}-step29"]


def test_a_second_run_in_the_same_directory_keeps_its_checkpoints_and_leaves_the_firsts(
    tmp_path: Path,
) -> None:
    """The README's run twice in one `--checkpoint-dir` (issue 24, item 10): the same run id, a
    new instance (the coordinator's run identity differs). The second run's checkpoint of step
    15 is written beside the first run's (whose directory has the plain name), survives its
    keep policy, and the first run's checkpoints are never deleted, replaced or resumed. Before,
    the first run's steps counted as the second's: its step 15 replaced the first's and was
    deleted 1 ms after it was written."""
    first = RunInstance(RUN, "first-instance")
    second = RunInstance(RUN, "second-instance")
    for step in (15, 36, 57, 151, 172, 199):
        save(tmp_path, step, value=1.0, run=first)
    # a checkpoint from before instances were recorded (a version 1 manifest)
    old = save(tmp_path, 8, value=3.0, run=first)
    doc = json.loads((old / MANIFEST_NAME).read_text())
    del doc["run_identity"]
    doc["version"] = 1
    (old / MANIFEST_NAME).write_text(json.dumps(doc))
    before = {p.name: snapshot(p) for p in tmp_path.iterdir()}

    config = CheckpointConfig(tmp_path, keep=KeepPolicy(keep_steps=3))
    checkpointer = Checkpointer(config, second, lambda _: None)
    written = []
    for epoch, step in enumerate((15, 36, 57, 78)):
        kind = checkpointer.plan(step, final=False)
        assert kind is Kind.recent
        job = CheckpointJob(epoch, step, kind, {"w": torch.full((64,), 2.0)}, CheckpointFiles())
        path = trio.run(checkpointer.write, job)
        assert path == tmp_path / (
            f"{RUN}-step{step}" if step == 78 else f"{RUN}-{second.tag}-step{step}"
        )
        written.append(path)
        if step == 15:
            assert path.is_dir()
            assert verify_checkpoint(path) is not None
    # keep-steps 3 counted the second run's own: its step 15 went once it had four
    assert [p.exists() for p in written] == [False, True, True, True]
    # the first run's (and the old) checkpoints are exactly as they were
    assert {p.name: snapshot(p) for p in tmp_path.iterdir() if p.name in before} == before
    # each instance resumes its own only; the old one is nobody's
    assert resume_checkpoint(tmp_path, second, 36) == written[1]
    assert resume_checkpoint(tmp_path, second, 151) is None
    assert resume_checkpoint(tmp_path, first, 36) == tmp_path / f"{RUN}-step36"
    assert resume_checkpoint(tmp_path, first, 8) is None
    # a restarted client of the second run counts what it wrote, and nothing else
    again = Checkpointer(config, second, lambda _: None)
    again.plan(99, final=False)
    assert sorted(k.step for k in again.kept or []) == [36, 57, 78]


def test_a_run_id_never_takes_a_checkpoint_outside_its_directory(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    elsewhere = str(tmp_path / "elsewhere")  # an absolute path beside the checkpoint directory
    for run_id in (elsewhere, "../up", "..", "", "a/b/../../c", ".hidden", "x" * 300):
        path = checkpoint_path(directory, RunInstance(run_id, "i"), 7)
        assert path.parent == directory, path
        assert path.name.endswith("-step7"), path
        assert not path.name.startswith("."), path
    save(directory, 7, run=RunInstance(elsewhere, "i"))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]
    found = latest_complete(directory, RunInstance(elsewhere, "i"))
    assert found is not None
    assert found.manifest.run_id == elsewhere


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
