"""Whole clients of a run on either DisTrO apply route (upstream's `Distro`, or the sparse
route a run names with `[model.LLM.optimizer.DistroSparse]`): each builds its optimizer from
the run's state (none is told the route otherwise), takes the route, and the two end the run
with the same model, bit for bit."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from functools import partial
from hashlib import sha256
from pathlib import Path

import pytest
import torch

from psyche.client.client import Client
from psyche.client.setup.model_loading import preload_modeling
from psyche.client.testing import InProcessServer
from psyche.coordinator import RunState
from psyche.coordinator.model import Model
from psyche.core.definitions import OptimizerDefinition
from psyche.modeling.distro import Distro, DistroResult

from .in_process import coordinator, run_beside_server, run_client_until_finished, write_run


def weights_digest(distro: Distro) -> str:
    """A short hash of the parameters' bytes, in their own dtype (no rounding)."""
    h = sha256()
    for _, p in distro.variables:
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


@pytest.mark.parametrize("sparse_route", [False, True], ids=["upstream", "sparse"])
def test_two_clients_of_a_distro_run_end_with_the_same_model(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    sparse_route: bool,
) -> None:
    caplog.set_level(logging.INFO, logger="psyche")
    # the real `Distro.apply`, counted: how many results each client applied each time, and
    # the weights it ended with (a failure names the first apply after which they differ)
    applies: dict[int, list[tuple[int, str]]] = {}
    real_apply = Distro.apply

    def counted_apply(self: Distro, results: Sequence[Sequence[DistroResult]], lr: float) -> None:
        real_apply(self, results, lr)
        applies.setdefault(id(self), []).append((len(results), weights_digest(self)))

    monkeypatch.setattr(Distro, "apply", counted_apply)
    preload_modeling()
    model_dir, data_dir = write_run(tmp_path)
    state = coordinator(model_dir, data_dir)
    llm = state.model.value
    settings, sparse = llm.optimizer.distro() or (None, True)
    assert settings is not None
    assert not sparse  # the harness's run is on upstream's route
    if sparse_route:
        route = OptimizerDefinition.DistroSparse(settings)
        state.model = Model.LLM(dataclasses.replace(llm, optimizer=route))
    state.config.total_steps = 6
    server = InProcessServer(state)
    clients: dict[int, Client] = {}

    async def one(number: int) -> None:
        clients[number] = await run_client_until_finished(server, number, None)

    run_beside_server(server, 120, partial(one, 1), partial(one, 2))
    assert server.coordinator.run_state is RunState.Finished
    trainers = [clients[n].machine.trainer for n in (1, 2)]  # type: ignore[union-attr]
    for trainer in trainers:
        assert trainer.distro is not None
        assert (trainer.distro.synthesis is not None) is sparse_route
    # both applied results, as many each time, and held the same weights after each apply
    assert len(applies) == 2, applies
    first, second = (applies[id(t.distro)] for t in trainers)
    assert first == second
    assert any(count for count, _ in first)
    # The same model, bit for bit, in the weights' own dtype: `Trainer.train_exact` restores
    # the weights a client's lookahead moved from a copy, and `decay_weights` decays them once
    # per step on every client, so nothing of a client's own training stays in its weights.
    a, b = (dict(t.model.variables()) for t in trainers)
    assert a.keys() == b.keys()
    differing = {
        name: float((a[name].float() - b[name].float()).abs().max())
        for name in a
        if not torch.equal(a[name], b[name])
    }
    assert not differing, differing
