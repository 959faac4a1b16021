"""A run configured with the `DiLoCo` optimizer: accepted as documented, refused with a precise
line for each setting that cannot work."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from psyche.coordinator.run_config import parse_run_config
from psyche.core.definitions import DilocoTransmission, OptimizerDefinition

from .examples import refusals, tiny_cpu_state

DILOCO = {
    "inner_steps": 4,
    "transmission": "Sparse",
    "value_bits": 2,
    "compression_chunk": 16,
    "compression_topk": 8,
    "nesterov": True,
    "outer_lr_follows_schedule": False,
    "inner_weight_decay": 0.0,
    "inner_clip_grad_norm": 1.0,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "outer_clip_grad_norm": 0.0,
}


def _doc(**changes: Any) -> dict[str, Any]:
    doc = tiny_cpu_state()
    doc["config"].update(global_batch_size_start=12, global_batch_size_end=12)
    doc["model"]["LLM"]["optimizer"] = {"DiLoCo": {**DILOCO, **changes}}
    return doc


def test_a_diloco_run_config_loads() -> None:
    loaded = parse_run_config(_doc(), "state.toml")
    optimizer = loaded.llm.optimizer
    assert isinstance(optimizer, OptimizerDefinition.DiLoCo)
    assert optimizer.value.transmission is DilocoTransmission.Sparse
    assert optimizer.value.inner_steps == 4


@pytest.mark.parametrize(
    ("changes", "where", "says"),
    [
        ({"inner_steps": 0}, "inner_steps", "at least 1"),
        ({"outer_lr": 0.0}, "outer_lr", "> 0"),
        ({"outer_momentum": 1.0}, "outer_momentum", "[0, 1)"),
        ({"outer_momentum": 0.0}, "nesterov", "needs outer_momentum > 0"),
        ({"value_bits": 3}, "value_bits", "one of [1, 2, 4, 8]"),
        ({"compression_topk": 0}, "compression_topk", "at least 1"),
        ({"compression_chunk": 0}, "compression_chunk", "at least 1"),
        ({"inner_clip_grad_norm": -1.0}, "inner_clip_grad_norm", ">= 0"),
        ({"outer_clip_grad_norm": float("nan")}, "outer_clip_grad_norm", "finite"),
        ({"peer_clip_multiple": 0.5}, "peer_clip_multiple", ">= 1"),
        ({"peer_clip_multiple": float("inf")}, "peer_clip_multiple", "0 (off) or a finite"),
    ],
)
def test_bad_settings_are_named(changes: dict[str, Any], where: str, says: str) -> None:
    problems = refusals(_doc(**changes))
    assert len(problems) == 1, problems
    path, message = problems[0]
    assert path == f"model.LLM.optimizer.DiLoCo.{where}"
    assert says in message


def test_every_client_needs_a_sample_per_inner_step() -> None:
    problems = refusals(_doc(inner_steps=8))  # 8 x init_min_clients 2 = 16 > 12
    assert [p for p, _ in problems] == [
        "config.global_batch_size_start",
        "config.global_batch_size_end",
    ]
    assert "at least inner_steps (8) x init_min_clients (2) = 16" in problems[0][1]


def test_the_round_must_allow_the_inner_steps() -> None:
    doc = _doc(inner_steps=300)
    doc["config"].update(global_batch_size_start=600, global_batch_size_end=600)
    (problem,) = refusals(doc)
    assert problem[0] == "config.max_round_train_time"
    assert "leaves 0.0667 s per inner step for inner_steps = 300" in problem[1]
    assert "raise max_round_train_time to at least 30" in problem[1]


def test_dense_forms_ignore_the_sparse_settings() -> None:
    loaded = parse_run_config(
        _doc(transmission="Bf16", value_bits=0, compression_topk=0, compression_chunk=0),
        "state.toml",
    )
    assert loaded.llm.optimizer.value.transmission is DilocoTransmission.Bf16  # type: ignore[attr-defined]
    assert refusals(copy.deepcopy(_doc(transmission="Int8", compression_chunk=0)))[0][0].endswith(
        "compression_chunk"
    )


def test_the_bounded_aggregate_is_off_unless_set_and_on_in_tiny_cpu_diloco() -> None:
    """`peer_clip_multiple` (appended to DiLoCo, postcard and TOML only): absent means 0, off;
    the project's DiLoCo config turns it on."""
    loaded = parse_run_config(_doc(), "state.toml")
    assert loaded.llm.optimizer.value.peer_clip_multiple == 0.0
    assert (
        parse_run_config(
            _doc(peer_clip_multiple=2.0), "state.toml"
        ).llm.optimizer.value.peer_clip_multiple
        == 2.0
    )
    tiny = tiny_cpu_state("tiny-cpu-diloco")
    optimizer = parse_run_config(tiny, "state.toml").llm.optimizer
    assert isinstance(optimizer, OptimizerDefinition.DiLoCo)
    assert optimizer.value.peer_clip_multiple == 2.0
