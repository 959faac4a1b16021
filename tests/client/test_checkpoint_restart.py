"""Resume after a restart of everything: the server starts from a state saved at an epoch's end
(`save_state` / `load_state`, as `psyche-server run --save-state-dir` does) and the clients start
again with the checkpoint directories they wrote. Each loads its complete local checkpoint of
the epoch's start step (a newer partial one, a staging directory left by a killed write and
another run instance's checkpoint of that step are never chosen), both start from the same
weights, which are the checkpoint's and not the random init, and they train on together. A
third client without a checkpoint takes that model from them, although the saved state names
the stored checkpoint (the random init)."""

from __future__ import annotations

import functools
import logging
import shutil
from pathlib import Path

import pytest
import torch
import trio

from psyche.centralized.save_state import load_state, save_state, saved_run_identity
from psyche.client.checkpoints.store import (
    RunInstance,
    checkpoint_path,
    save_checkpoint_locally,
)
from psyche.client.setup.model_loading import config_json_of, load_from_directory, preload_modeling
from psyche.client.testing import InProcessServer
from psyche.coordinator import CoordinatorProgress, RunState
from psyche.modeling.sharing import model_hash

from ..polling import poll_until
from ..timing import scaled, scaled_timer
from .in_process import RUN_ID, coordinator, fields, identities, run_client, write_run

STEP = 12  # the saved state's step: the epoch starts from the checkpoint of step 11
INSTANCE = RunInstance(RUN_ID, "saved-instance")


pytestmark = pytest.mark.usefixtures("single_thread")


def test_clients_and_server_restarted_resume_from_the_last_complete_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")
    preload_modeling()
    model_dir, data_dir = write_run(tmp_path)
    # the model the last epoch ended with: the random init, moved, rounded through bf16
    initial = load_from_directory(model_dir, "HfLlama", torch.device("cpu"))
    trained = {
        name: (t.detach() + 0.01).to(torch.bfloat16) for name, t in initial.model.variables()
    }
    config_json = config_json_of(initial.model)
    dirs = [tmp_path / "client-1", tmp_path / "client-2"]
    # client 2's directory also holds another instance's checkpoint of that step (the same run
    # config run before, from the random init) under the plain name
    other = RunInstance(RUN_ID, "an-earlier-instance")
    save_checkpoint_locally(
        checkpoint_path(dirs[1], other, STEP - 1),
        dict(initial.model.variables()),
        [],
        config_json,
        "",
        run=other,
        step=STEP - 1,
    )
    for directory in dirs:
        save_checkpoint_locally(
            checkpoint_path(directory, INSTANCE, STEP - 1),
            trained,
            [],
            config_json,
            "",
            run=INSTANCE,
            step=STEP - 1,
        )
    # client 1 also holds an older checkpoint; client 2 a newer one whose write was cut short
    # (a file missing) and the staging directory of a killed writer
    save_checkpoint_locally(
        dirs[0] / f"{RUN_ID}-step{STEP - 6}",
        dict(initial.model.variables()),
        [],
        config_json,
        "",
        run=INSTANCE,
        step=STEP - 6,
    )
    mine = checkpoint_path(dirs[1], INSTANCE, STEP - 1)
    assert mine.name == f"{RUN_ID}-{INSTANCE.tag}-step{STEP - 1}"
    partial = dirs[1] / f"{RUN_ID}-step{STEP + 5}"
    shutil.copytree(mine, partial)
    (partial / "model.safetensors").unlink()
    staging = dirs[1] / f".{RUN_ID}-step{STEP + 9}.pid999999999.x.tmp"
    shutil.copytree(mine, staging)

    state = coordinator(model_dir, data_dir)
    state.run_state = RunState.WaitingForMembers
    # a valid saved state: longer than a round and the warmup
    state.config.epoch_time = scaled_timer(30)
    state.config.init_min_clients = 3
    state.config.warmup_time = scaled_timer(20)  # ends once all three are ready
    state.progress = CoordinatorProgress(epoch=3, step=STEP, epoch_start_data_index=40)
    # the server resumed from its save keeps the run's identity
    saved = save_state(tmp_path / "saved", state, INSTANCE.identity)
    server = InProcessServer(load_state(saved), run_identity=saved_run_identity(saved))

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            for number, directory in enumerate([*dirs, None], start=1):
                nursery.start_soon(
                    functools.partial(run_client, server, number, checkpoint_dir=directory)
                )
            # until all three applied the first round of the epoch
            with trio.fail_after(scaled(120)):
                await poll_until(lambda: len(fields(caplog.records, "applied_results")) >= 3, 0.1)
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    loaded = {f["client_id"]: f for f in fields(caplog.records, "loaded_model")}
    assert len(loaded) == 3
    first, second, third = (loaded[str(i)] for i in identities(1, 2, 3))
    assert first["source"].endswith(f"{RUN_ID}-step{STEP - 1} (resumed)"), first
    assert second["source"].endswith(f"{mine.name} (resumed)"), second
    assert third["source"] == "peers (P2P)", third  # not the stored checkpoint
    want = model_hash({name: t.to(torch.float32) for name, t in trained.items()})
    assert [f["model_hash"] for f in (first, second, third)] == [want, want, want]
    assert want != model_hash(dict(initial.model.variables()))
    assert all(f["epoch"] == 3 and f["step"] == STEP for f in loaded.values())
    applied: dict[int, set[tuple[str, ...]]] = {}
    for f in fields(caplog.records, "applied_results"):
        applied.setdefault(f["step"], set()).add(tuple(str(b) for b in f["batches"]))
    assert applied
    assert all(len(v) == 1 for v in applied.values())
    assert partial.exists()
    assert staging.exists()
