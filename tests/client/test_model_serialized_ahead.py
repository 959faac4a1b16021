"""A provider serializes its model ahead (a second, model-sized copy in host memory) only for an
epoch with a joiner: whole clients in one process, as `test_in_process_run`, through three
epochs: the same two clients (nothing serialized ahead), then a third joining from peers."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import pytest
import trio

from psyche.client.setup.model_loading import preload_modeling
from psyche.client.testing import InProcessServer
from psyche.coordinator import RunState

from ..polling import poll_until
from ..timing import scaled, scaled_timer
from .in_process import coordinator, fields, run_client, write_run


def test_a_model_is_serialized_ahead_for_a_joiner_and_not_for_the_same_clients(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")
    preload_modeling()
    model_dir, data_dir = write_run(tmp_path)
    state = coordinator(model_dir, data_dir)
    state.config.epoch_time = scaled_timer(3)  # short epochs (`test_in_process_run`)
    server = InProcessServer(state)

    def training(epoch: int) -> bool:
        run = server.coordinator
        return run.progress.epoch == epoch and run.run_state is RunState.RoundTrain

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            for number in (1, 2):
                nursery.start_soon(run_client, server, number)
            with trio.fail_after(scaled(150)):
                # epoch 1 with the same two clients; the third joins while it trains, for epoch 2
                for epoch, joiner in ((1, 3), (2, None)):
                    await poll_until(partial(training, epoch), 0.1)
                    if joiner is not None:
                        nursery.start_soon(run_client, server, joiner)
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    records = caplog.records
    shared = {f["epoch"] for f in fields(records, "cooldown_model")}
    assert {0, 1} <= shared  # both epochs' models were shared at their cooldowns
    ahead = [f["epoch"] for f in fields(records, "model_serialized_ahead")]
    assert ahead.count(1) == 0  # the same clients: nobody to fetch it, nothing serialized
    assert ahead.count(2) == 2  # a joiner: both providers serialize ahead
    joiner = [f for f in fields(records, "loaded_model") if f["epoch"] == 2]
    assert [f["source"] for f in joiner] == ["peers (P2P)"]
