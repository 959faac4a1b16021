"""`psyche-solana-client predownload` against the local endpoint: a run whose checkpoint is a
GCS bucket (a gcp-storage-emulator process) and one whose checkpoint is a hub repo (the loopback
hub stand-in) have their model fetched into the caches the client reads when it joins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from psyche.client.checkpoints.gcs import upload_checkpoint_to_gcs
from psyche.modeling.configs import llama_config_dict
from psyche.solana.localnet.server import LocalnetThread

from ..client.gcs_emulator import gcs_emulator
from ..client.hub_endpoint import HubEndpoint, point_huggingface_hub_at
from .cli_helpers import EVERYONE, RUN_CONFIG, funded_wallet, ok, run_cli

pytestmark = pytest.mark.usefixtures("clean_env")

HUB_CHECKPOINT = '[model.LLM.checkpoint.Hub]\nrepo_id = "emozilla/llama2-1.1b-gqa-init"\n'


def _create_run(
    capsys: pytest.CaptureFixture[str],
    net: LocalnetThread,
    wallet: Path,
    run_id: str,
    checkpoint: str,
) -> None:
    config = wallet.parent / f"{run_id}.toml"
    config.write_text(RUN_CONFIG.replace(HUB_CHECKPOINT, checkpoint))
    ok(capsys, net, "create-run", "-r", run_id, "-c", "test", wallet=wallet)
    ok(capsys, net, "update-config", "-r", run_id, "--config-path", str(config), wallet=wallet)


def test_predownload_from_gcs_and_the_hub(
    capsys: pytest.CaptureFixture[str],
    net: LocalnetThread,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert HUB_CHECKPOINT in RUN_CONFIG
    wallet = tmp_path / "wallet.json"
    funded_wallet(net, wallet)
    ok(capsys, net, "join-authorization-create", "--authorizer", EVERYONE, wallet=wallet)
    # a hub download is bounded by the model its config.json declares: a real (tiny) one
    config_json = json.dumps(llama_config_dict("tiny")).encode()
    files = {"model.safetensors": b"weights" * 100, "config.json": config_json}
    source = tmp_path / "source"
    source.mkdir()
    for name, data in files.items():
        (source / name).write_bytes(data)
    hub = HubEndpoint()
    hub.create_repo("org/model", files)
    with gcs_emulator(monkeypatch, "bucket"), hub.serving():
        point_huggingface_hub_at(monkeypatch, hub.url, tmp_path / "hf-home")
        upload_checkpoint_to_gcs("bucket", "ckpt", sorted(source.iterdir()), "gcs-run", 2, 99)
        _create_run(
            capsys,
            net,
            wallet,
            "gcs-run",
            '[model.LLM.checkpoint.Gcs]\nbucket = "bucket"\nprefix = "ckpt"\n',
        )
        _create_run(
            capsys, net, wallet, "hub-run", '[model.LLM.checkpoint.Hub]\nrepo_id = "org/model"\n'
        )

        out = ok(capsys, net, "predownload", "-r", "gcs-run", "--model")
        assert "Predownloading model from gs://bucket/ckpt" in out
        assert out.endswith("Model predownloaded successfully.\n")
        cached = tmp_path / "hf-home" / "psyche" / "gcs" / "bucket" / "ckpt"
        [step_dir] = list(cached.iterdir())
        assert step_dir.name.startswith("step-99-")
        assert {p.name: p.read_bytes() for p in step_dir.iterdir()} == files

        out = ok(capsys, net, "predownload", "-r", "hub-run", "--model")
        assert "Predownloading model org/model revision main" in out
        snapshot = Path(out.split("Model files in ")[1].splitlines()[0])
        assert {p.name: p.read_bytes() for p in snapshot.iterdir()} == files

        code, _, err = run_cli(capsys, net, "predownload", "-r", "hub-run")
        assert code == 1
        assert "nothing to predownload" in err
        code, _, err = run_cli(capsys, net, "predownload", "-r", "hub-run", "--eval-tasks", "nope")
        assert code == 1
        assert "unknown evaluation task 'nope'" in err
        code, _, err = run_cli(capsys, net, "predownload", "-r", "absent", "--model")
        assert code == 1
        assert err.count("\n") == 1
