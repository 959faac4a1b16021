"""What the command tests and the local testnet's tests share: a Dummy run's `state.toml` (no
model, no data) and whether a process is still there."""

from __future__ import annotations

import os


def dummy_state(run_id: str) -> str:
    """A `state.toml` of run `run_id` that needs no model or data (a Dummy run) and waits for
    members, with timings short enough for a test."""
    return DUMMY_STATE_TEMPLATE.replace("{run_id}", run_id)


DUMMY_STATE_TEMPLATE = """\
run_id = "{run_id}"
run_state = "WaitingForMembers"

[config]
warmup_time = 30
cooldown_time = 2
epoch_time = 60
max_round_train_time = 2
round_witness_time = 1
min_clients = 1
init_min_clients = 2
global_batch_size_start = 4
global_batch_size_end = 4
global_batch_size_warmup_tokens = 0
verification_percent = 0
witness_nodes = 1
total_steps = 100
waiting_for_members_extra_time = 1

[model.LLM]
architecture = "HfLlama"
data_type = "Pretraining"
max_seq_len = 64
cold_start_warmup_steps = 0
data_location = "Dummy"
optimizer = "Dummy"

[model.LLM.checkpoint.Dummy]
repo_id = ""

[model.LLM.lr_schedule.Constant]
base_lr = 1.0e-3
warmup_steps = 0
warmup_init_lr = 0.0
"""


def alive(pid: int) -> bool:
    """Whether a process `pid` still exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
