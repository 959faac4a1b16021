"""Run configurations that several coordinator tests read."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from psyche.coordinator import CoordinatorConfig
from psyche.coordinator.run_config import ConfigFileError, parse_run_config

REPO = Path(__file__).resolve().parents[2]

# upstream's config/test/state.toml
TEST_STATE = """
run_id = "test"
run_state = "WaitingForMembers"
[config]
warmup_time = 5
cooldown_time = 5
epoch_time = 60
max_round_train_time = 5
round_witness_time = 2
min_clients = 2
init_min_clients = 2
global_batch_size_start = 4
global_batch_size_end = 4
global_batch_size_warmup_tokens = 0
verification_percent = 0
witness_nodes = 1
total_steps = 10
waiting_for_members_extra_time = 3

[model.LLM]
architecture = "HfLlama"
data_type = "Pretraining"
max_seq_len = 512
optimizer = "Dummy"
data_location = "Dummy"
cold_start_warmup_steps = 0

[model.LLM.checkpoint.Dummy]
repo_id = ""

[model.LLM.lr_schedule.Cosine]
base_lr = 4.0e-4
warmup_steps = 20
warmup_init_lr = 0.0
total_steps = 2000
final_lr = 4.0e-5
"""

# upstream's consilience run: 12288 -> 32768 sequences over 549755813888 tokens
CONSILIENCE = CoordinatorConfig(
    warmup_time=3600,
    cooldown_time=120,
    max_round_train_time=360,
    round_witness_time=5,
    global_batch_size_warmup_tokens=549755813888,
    epoch_time=100000,
    total_steps=325000,
    init_min_clients=16,
    min_clients=16,
    witness_nodes=0,
    global_batch_size_start=12288,
    global_batch_size_end=32768,
    verification_percent=0,
    waiting_for_members_extra_time=10,
)


def tiny_cpu_state(name: str = "tiny-cpu") -> dict[str, Any]:
    """The project's `configs/<name>/state.toml` as a TOML document, to change and parse."""
    return tomllib.loads((REPO / "configs" / name / "state.toml").read_text())


def refusals(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The (field, problem) lines `doc` is refused with; fails the test if it loads."""
    with pytest.raises(ConfigFileError) as e:
        parse_run_config(doc, "state.toml")
    return e.value.problems
