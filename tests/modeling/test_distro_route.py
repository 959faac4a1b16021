"""The DisTrO apply route is the run's: a `Trainer` built from the run config's optimizer
(`Distro`: upstream's dense route; `DistroSparse`: the exact sparse synthesis), as every client
builds it. Two clients of a sparse-route run, each training its own batch and applying both
payloads as they arrive over the wire, hold bit-identical weights; the same run on upstream's
route holds other bits."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from psyche.coordinator.distro_config import SPARSE_APPLY_MAX_ENTRIES
from psyche.coordinator.run_config import parse_run_config
from psyche.core.batch_id import BatchId
from psyche.core.definitions import ConstantLR, LearningRateSchedule, OptimizerDefinition
from psyche.modeling.dct import SparseSynthesis, TransformDCT
from psyche.modeling.serialized_distro import decode_transmittable
from psyche.modeling.trainer import Batch, Trainer

REPO = Path(__file__).resolve().parents[2]


def _run_optimizer(route: str) -> OptimizerDefinition:
    """The optimizer of configs/tiny-cpu's run (chunk 16, top-k 8, 1-bit) on `route`."""
    doc = tomllib.loads((REPO / "configs/tiny-cpu/state.toml").read_text())
    settings = doc["model"]["LLM"]["optimizer"]["Distro"]
    doc["model"]["LLM"]["optimizer"] = {route: settings}
    optimizer: OptimizerDefinition = parse_run_config(doc, "state.toml").llm.optimizer
    return optimizer


def _two_clients(
    tiny_llama: Callable, corpus: torch.Tensor, route: str, steps: int = 2
) -> list[list[dict[str, torch.Tensor]]]:
    """Two clients of one run, each training its half of every step's batch, then applying the
    step's two payloads (decoded from their bytes, in batch order) to the same weights; each
    client's weights after every apply.

    The same weights: a client's own lookahead (`p - sign(delta) lr` before its forward pass,
    undone after it) does not round-trip exactly, and differs between clients (upstream's too;
    the cooldown's bf16 rounding hides it), so each apply starts from the first client's
    weights to show the applies alone."""
    optimizer = _run_optimizer(route)
    schedule = LearningRateSchedule.Constant(ConstantLR(3e-3, 0.0, 0))
    clients = [Trainer(tiny_llama(), schedule, optimizer, micro_batch_size=2) for _ in "ab"]
    for trainer in clients:
        assert trainer.distro is not None
        assert (trainer.distro.synthesis is not None) is (route == "DistroSparse")
    own: list[list] = [[], []]  # type: ignore[type-arg]
    applied: list[list[dict[str, torch.Tensor]]] = [[], []]
    for step in range(1, steps + 1):
        payloads = []
        for c, trainer in enumerate(clients):
            start = ((step - 1) * 2 + c) * 4
            out = trainer.train(
                step, Batch(corpus[start : start + 4]), prev_self_distro_results=own[c]
            )
            prepared = trainer.prepare_result(out, step=step, batch_id=BatchId(start, start + 3))
            payloads.append(prepared.payload.to_bytes())
            own[c] = [out.distro_results]
        reference = {name: p.detach().clone() for name, p in clients[0].model.variables()}
        for c, trainer in enumerate(clients):
            with torch.no_grad():
                for name, p in trainer.model.variables():
                    p.copy_(reference[name])
            arrived = [trainer.results_from_payload(decode_transmittable(p)) for p in payloads]
            trainer.optimize(step + 1, distro_results=arrived)
            applied[c].append({n: p.detach().clone() for n, p in trainer.model.variables()})
    return applied


def test_two_clients_of_a_sparse_route_run_agree_and_differ_from_upstreams_route(
    tiny_llama: Callable, corpus: torch.Tensor
) -> None:
    sparse = _two_clients(tiny_llama, corpus, "DistroSparse")
    upstream = _two_clients(tiny_llama, corpus, "Distro")
    for a, b in (sparse, upstream):
        for step_a, step_b in zip(a, b, strict=True):
            for name in step_a:
                assert torch.equal(step_a[name], step_b[name]), name
    # the routes' update bits differ in a few coordinates (the first step: the same weights
    # and payloads on both routes but for the sparse route's own encode order)
    first_sparse, first_upstream = sparse[0][0], upstream[0][0]
    total = sum(t.numel() for t in first_sparse.values())
    changed = sum(int((first_sparse[n] != first_upstream[n]).sum()) for n in first_sparse)
    assert 0 < changed < total // 10


def test_the_configs_bound_on_entries_is_the_synthesis_own() -> None:
    """validate-config's `SPARSE_APPLY_MAX_ENTRIES` is where the exact synthesis starts refusing
    for blocks whose integer basis reaches its 13-bit maximum (5793, from 246 up), and within
    what it accepts for every other size (64: at most 5791)."""
    for n, refuses_beyond in ((256, True), (64, False)):
        synthesis = SparseSynthesis(TransformDCT([((n, n), torch.float32, "cpu")], n))
        for entries in (SPARSE_APPLY_MAX_ENTRIES, SPARSE_APPLY_MAX_ENTRIES + 1):
            idx = (torch.arange(entries) % (n * n)).view(1, entries)
            negative = torch.zeros_like(idx, dtype=torch.bool)
            if refuses_beyond and entries > SPARSE_APPLY_MAX_ENTRIES:
                with pytest.raises(ValueError, match="too many entries"):
                    synthesis.prepare_signs(idx, negative, n, n)
            else:
                synthesis.prepare_signs(idx, negative, n, n)
