"""The DisTrO apply route as a run setting (`[model.LLM.optimizer.DistroSparse]`, a port
extension): a sparse-route run config loads, and every combination the route cannot run is
refused by `validate-config` with the field named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomli_w

from psyche.centralized.run import validate_config
from psyche.coordinator.distro_config import SPARSE_APPLY_MAX_ENTRIES
from psyche.coordinator.run_config import parse_run_config
from psyche.core.definitions import OptimizerDefinition

from .examples import refusals, tiny_cpu_state

WHERE = "model.LLM.optimizer.DistroSparse"


def _doc(**changes: Any) -> dict[str, Any]:
    doc = tiny_cpu_state()
    optimizer = doc["model"]["LLM"]["optimizer"]
    doc["model"]["LLM"]["optimizer"] = {"DistroSparse": {**optimizer["Distro"], **changes}}
    return doc


def test_a_sparse_route_run_config_loads() -> None:
    loaded = parse_run_config(_doc(), "state.toml")
    optimizer = loaded.llm.optimizer
    assert isinstance(optimizer, OptimizerDefinition.DistroSparse)
    settings, sparse = optimizer.distro() or (None, False)
    assert sparse
    assert settings is not None
    assert settings.compression_topk == 8
    # the default stays upstream's route
    upstream = tiny_cpu_state()
    assert parse_run_config(upstream, "state.toml").llm.optimizer.distro()[1] is False


def test_the_sparse_route_needs_1_bit_results() -> None:
    ((where, says),) = refusals(_doc(quantize_1bit=False))
    assert where == f"{WHERE}.quantize_1bit"
    assert "1-bit" in says


def test_more_entries_per_block_than_the_exact_synthesis_holds_are_refused() -> None:
    doc = _doc(compression_topk=1024, compression_chunk=64)  # 256 results x 1024 > the bound
    doc["config"].update(global_batch_size_start=256, global_batch_size_end=256)
    doc["config"].update(init_min_clients=2, min_clients=1)
    ((where, says),) = refusals(doc)
    assert where == f"{WHERE}.compression_topk"
    assert str(SPARSE_APPLY_MAX_ENTRIES) in says
    # the same top-k with fewer results a round fits (8 x 1024)
    doc["config"].update(global_batch_size_start=8, global_batch_size_end=8)
    parse_run_config(doc, "state.toml")
    # a top-k beyond the block's size keeps chunk^2 entries a result (16 x 16 x 256 fits)
    doc = _doc(compression_topk=60000, compression_chunk=16)
    doc["config"].update(global_batch_size_start=256, global_batch_size_end=256)
    parse_run_config(doc, "state.toml")


def test_the_sparse_route_cannot_be_named_beside_another_optimizer() -> None:
    """The route is the optimizer's variant: a config naming it for AdamW (both tables) is not
    one optimizer and is refused at the optimizer's path."""
    doc = _doc()
    doc["model"]["LLM"]["optimizer"]["AdamW"] = {
        "betas": [0.9, 0.95],
        "weight_decay": 0.0,
        "eps": 1e-8,
    }
    problems = refusals(doc)
    assert [where for where, _ in problems] == ["model.LLM.optimizer"]


def test_validate_config_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state.toml"
    state.write_text(tomli_w.dumps(_doc()))
    assert validate_config(state, None) == 0
    assert "Configs are OK!" in capsys.readouterr().out
    state.write_text(tomli_w.dumps(_doc(quantize_1bit=False)))
    assert validate_config(state, None) == 1
    err = capsys.readouterr().err
    assert f"{WHERE}.quantize_1bit" in err
    assert len(err.strip().splitlines()) == 1
