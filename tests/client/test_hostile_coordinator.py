"""What a hostile coordinator (or anyone on the plaintext coordinator link) can make a client do
with the strings of its state (issue 24, item 6): its run id named where the client wrote its
checkpoints (an absolute path: outside `--checkpoint-dir`, after an `rmtree` of that path), and
a `Hub` repo id made it download any repo's safetensors, whatever their size. The client now
refuses a state of another run in one line and ends; every local path built from a remote
string stays inside the directory it belongs in; a hub download is bounded by the model the
repo's config.json declares."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import trio

from psyche.client.checkpoints.gcs import _cache_dir, cache_base
from psyche.client.client import WrongRun
from psyche.client.setup.model_loading import load_hub_checkpoint, preload_modeling
from psyche.client.testing import InProcessServer
from psyche.core.cli import single_cause, user_error_message
from psyche.modeling.causal_lm import ModelLoadError
from psyche.modeling.configs import llama_config_dict

from ..polling import poll_until
from .hub_endpoint import HubEndpoint
from .in_process import RUN_ID, coordinator, run_client, write_run


class RenamingServer(InProcessServer):
    """Runs the run honestly but tells its clients another run id: an absolute path."""

    forged_run_id = ""

    def _post_state_change(self, *, broadcast: bool) -> None:
        self.core.after_change()
        if broadcast:
            for backend in self.backends.values():
                state = self.coordinator.copy()
                state.run_id = self.forged_run_id
                backend._deliver(state)


def test_a_state_of_another_run_is_refused_and_nothing_is_written_outside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, both clients trained and wrote `<forged path>-step{N}` at the first cooldown."""
    caplog.set_level(logging.INFO, logger="psyche")
    preload_modeling()
    server = RenamingServer(coordinator(*write_run(tmp_path)))
    outside = tmp_path / "outside"
    outside.mkdir()
    server.forged_run_id = str(outside / "victim")
    checkpoints = tmp_path / "checkpoints"
    errors: list[BaseException] = []

    async def one(number: int) -> None:
        try:
            await run_client(server, number, checkpoint_dir=checkpoints)
        except* WrongRun as group:  # raised from the client's nurseries
            errors.append(single_cause(group))

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            with trio.fail_after(90):  # the clients end, or (before) a cooldown writes
                async with trio.open_nursery() as clients:
                    clients.start_soon(one, 1)
                    clients.start_soon(one, 2)

                    async def watch() -> None:
                        await poll_until(lambda: list(outside.iterdir()), 0.2)
                        clients.cancel_scope.cancel()

                    clients.start_soon(watch)
                    await poll_until(lambda: len(errors) >= 2, 0.1)
                    clients.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    assert list(outside.iterdir()) == []
    assert not checkpoints.exists()
    assert len(errors) == 2, errors
    assert all(isinstance(e, WrongRun) for e in errors), errors
    line = user_error_message(errors[0])
    assert line is not None
    assert "\n" not in line
    assert f"joined run {RUN_ID!r}" in line
    assert "refusing" in line
    assert not [r for r in caplog.records if r.getMessage() == "loaded_model"]


def test_a_bucket_and_prefix_never_take_a_gcs_download_outside_its_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    base = tmp_path / "hf" / "psyche" / "gcs"
    for bucket, prefix in (
        ("../../../x", "../../../../etc"),
        ("/abs", "/abs/olute/.."),
        ("..", ".."),
        ("b", "a/./b//c"),
    ):
        directory = _cache_dir(bucket, prefix, "step-1-2")
        assert directory.is_relative_to(base), directory
        assert ".." not in directory.parts, directory
        assert cache_base(bucket).parent == base
    assert _cache_dir("b", "a/./b//c", "leaf") == base / "b" / "a" / "b" / "c" / "leaf"


# ---- hub downloads ---------------------------------------------------------------------------


def tiny_repo() -> dict[str, bytes]:
    from safetensors.torch import save

    from psyche.modeling.causal_lm import CausalLM, ModelOptions

    config = llama_config_dict("tiny")
    model = CausalLM.from_config(config, ModelOptions(architecture="HfLlama", device="cpu"))
    weights = save({k: v.contiguous() for k, v in model.extract(None).items()})
    return {"config.json": json.dumps(config).encode(), "model.safetensors": weights}


def test_a_hub_repo_larger_than_its_declared_model_is_not_downloaded(hub: HubEndpoint) -> None:
    files = tiny_repo()
    hub.create_repo("org/honest", files)
    loaded = load_hub_checkpoint("org/honest", None, "HfLlama", torch.device("cpu"))
    assert loaded.model.model.config.hidden_size == llama_config_dict("tiny")["hidden_size"]
    # the same config with 64 MiB of "weights" beside it
    junk = {**files, "model-00002-of-00002.safetensors": bytes(64 << 20)}
    hub.create_repo("org/junk", junk)
    hub.requests.clear()
    with pytest.raises(ModelLoadError, match=r"more than the model its config\.json declares"):
        load_hub_checkpoint("org/junk", None, "HfLlama", torch.device("cpu"))
    fetched = [r for r in hub.requests if "/resolve/" in r and r.startswith("GET")]
    assert fetched, fetched
    assert all(r.endswith("/config.json") for r in fetched), fetched


def test_a_hub_repo_with_an_oversized_config_file_is_not_downloaded(hub: HubEndpoint) -> None:
    files = tiny_repo()
    hub.create_repo("org/big-tokenizer", {**files, "tokenizer.json": b" " * (65 << 20)})
    hub.requests.clear()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json .* bytes"):
        load_hub_checkpoint("org/big-tokenizer", None, "HfLlama", torch.device("cpu"))
    assert not [r for r in hub.requests if "/resolve/" in r and r.startswith("GET")]
