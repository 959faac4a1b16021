"""Whole clients of a run that names the sparse DisTrO apply route (`[model.LLM.optimizer.
DistroSparse]`): each builds its optimizer from the run's state (none is told the route
otherwise), takes the route, and the two end the run with the same model."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import trio

from psyche.client.client import Client
from psyche.client.setup.model_loading import preload_modeling
from psyche.client.testing import InProcessServer
from psyche.coordinator import RunState
from psyche.coordinator.model import Model
from psyche.core.definitions import OptimizerDefinition
from psyche.modeling.distro import Distro, DistroResult

from ..timing import scaled
from .test_in_process_run import coordinator, run_client_until_finished, write_run


def test_two_clients_of_a_sparse_route_run_end_with_the_same_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="psyche")
    # the real `Distro.apply`, counted: how many results each client applied, each time
    applies: dict[int, list[int]] = {}
    real_apply = Distro.apply

    def counted_apply(self: Distro, results: Sequence[Sequence[DistroResult]], lr: float) -> None:
        applies.setdefault(id(self), []).append(len(results))
        real_apply(self, results, lr)

    monkeypatch.setattr(Distro, "apply", counted_apply)
    preload_modeling()
    model_dir, data_dir = write_run(tmp_path)
    state = coordinator(model_dir, data_dir)
    llm = state.model.value
    settings, sparse = llm.optimizer.distro() or (None, True)
    assert settings is not None
    assert not sparse  # the harness's run is on upstream's route
    route = OptimizerDefinition.DistroSparse(settings)
    state.model = Model.LLM(dataclasses.replace(llm, optimizer=route))
    state.config.total_steps = 6
    server = InProcessServer(state)
    clients: dict[int, Client] = {}

    async def one(number: int) -> None:
        clients[number] = await run_client_until_finished(server, number, None)

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            with trio.fail_after(scaled(120)):
                async with trio.open_nursery() as both:
                    both.start_soon(one, 1)
                    both.start_soon(one, 2)
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    assert server.coordinator.run_state is RunState.Finished
    trainers = [clients[n].machine.trainer for n in (1, 2)]  # type: ignore[union-attr]
    for trainer in trainers:
        assert trainer.distro is not None
        assert trainer.distro.synthesis is not None
    # both applied results, as many each time
    assert len(applies) == 2, applies
    assert applies[id(trainers[0].distro)] == applies[id(trainers[1].distro)]
    assert any(applies[id(trainers[0].distro)])
    # The same model. Not bit for bit: a client's own lookahead (`p - sign(delta) lr` before
    # its forward pass, undone after it) leaves rounding noise of its own in the weights, on
    # either route (upstream's too); the cooldown's bf16 rounding hides it but for a value at a
    # bf16 midpoint. So: within one bf16 rounding, where a step of another sign is 2 lr (the
    # applies alone, bit for bit: tests/modeling/test_distro_route.py).
    a, b = (dict(t.model.variables()) for t in trainers)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=2.0**-7, atol=1e-6, msg=name)
