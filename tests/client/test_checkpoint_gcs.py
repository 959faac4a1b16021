"""GCS checkpoints against a real emulator process (gcs_emulator.py) through
`google-cloud-storage`: the cooldown's upload (files, then upstream's manifest last), the
coordinator told `Gcs`, and a joiner of a run whose checkpoint is `Gcs` loading the same weights;
a bucket without a manifest (an old checkpoint) is read by listing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio

from psyche.client.checkpoints.cooldown import (
    Checkpointer,
    CheckpointFiles,
    CheckpointJob,
    extract_for_sharing,
)
from psyche.client.checkpoints.gcs import download_checkpoint_from_gcs, storage_client
from psyche.client.checkpoints.keep_policy import Kind
from psyche.client.checkpoints.store import CheckpointConfig, RunInstance
from psyche.client.checkpoints.upload import GcsUpload
from psyche.client.setup.model_loading import config_json_of, load_gcs_checkpoint
from psyche.coordinator.model import Checkpoint, GcsRepo

from ..modeling.tiny_trainer import make_trainer
from .gcs_emulator import gcs_emulator

BUCKET = "psyche-checkpoints"


def test_upload_at_cooldown_then_join_from_gcs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    trainer = make_trainer()
    variables, _ = extract_for_sharing(trainer)
    with gcs_emulator(monkeypatch, BUCKET):
        sent: list[Checkpoint] = []
        config = CheckpointConfig(tmp_path / "ckpt", GcsUpload(BUCKET, "runs/a"))
        checkpointer = Checkpointer(config, RunInstance("run", "instance-1"), sent.append)
        files = CheckpointFiles([], config_json_of(trainer.model), "")
        job = CheckpointJob(3, 39, Kind.recent, variables, files)
        path = trio.run(checkpointer.write, job)
        assert path is not None
        assert sent == [Checkpoint.Gcs(GcsRepo(BUCKET, "runs/a"))]
        bucket = storage_client().bucket(BUCKET)
        names = sorted(b.name for b in storage_client().list_blobs(BUCKET))
        assert names == [
            "runs/a/config.json",
            "runs/a/manifest.json",
            "runs/a/model.safetensors",
            "runs/a/psyche-manifest.json",
        ]
        manifest = json.loads(bucket.blob("runs/a/manifest.json").download_as_bytes())
        assert manifest["metadata"]["step"] == 39
        assert manifest["metadata"]["epoch"] == 3
        assert manifest["metadata"]["run_id"] == "run"
        [entry] = manifest["files"]
        assert entry["filename"] == "model.safetensors"
        assert entry["size_bytes"] == (path / "model.safetensors").stat().st_size

        loaded = load_gcs_checkpoint(BUCKET, "runs/a", "HfLlama", torch.device("cpu"))
        live = dict(trainer.model.variables())
        for name, tensor in loaded.model.variables():
            assert torch.equal(tensor, live[name]), name
        assert loaded.source.startswith(f"gs://{BUCKET}/runs/a")
        # the download went to upstream's cache layout, and a second one reuses it
        cached = download_checkpoint_from_gcs(BUCKET, "runs/a")
        assert cached.parent == tmp_path / "hf-home" / "psyche" / "gcs" / BUCKET / "runs" / "a"
        assert cached.name.startswith("step-39-")

        # an old checkpoint without a manifest: every model file by listing
        for name in ("model.safetensors", "config.json"):
            bucket.blob(f"old/{name}").upload_from_filename(str(path / name))
        old = download_checkpoint_from_gcs(BUCKET, "old")
        assert old.name == "no_manifest"
        assert sorted(p.name for p in old.iterdir()) == ["config.json", "model.safetensors"]
        with pytest.raises(Exception, match="no manifest and no safetensors"):
            download_checkpoint_from_gcs(BUCKET, "absent")
