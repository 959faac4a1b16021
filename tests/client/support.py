"""Plain values the client tests build alike: a round's report (`round_report`) and a
trainer's job for one step (`train_job`)."""

from __future__ import annotations

from typing import Any

from psyche.client.observe.telemetry import RoundReport
from psyche.client.round.train import TrainJob
from psyche.coordinator.committee_selection import Committee, CommitteeProof
from psyche.core.batch_id import BatchId
from psyche.core.node_identity import NodeIdentity


def round_report(**fields: Any) -> RoundReport:
    """A round's report with plain numbers, `fields` replacing them."""
    values: dict[str, Any] = {
        "step": 3,
        "epoch": 0,
        "total_steps": 10,
        "round_height": 2,
        "num_clients": 2,
        "loss": None,
        "lr": None,
        "tokens_per_sec": None,
        "total_tokens": 256,
        "global_token_batch_size": 128,
        "efficiency": None,
        "seconds_left": None,
        "trained": 0,
        "train_seconds": 0.25,
        "distro_seconds": 0.05,
    }
    return RoundReport(**{**values, **fields})


def train_job(step: int, batches: list[BatchId], prev: list[list[Any]]) -> TrainJob:
    """A trainer's job at `step`: `batches` to train, `prev` its results of earlier steps."""
    return TrainJob(
        step=step,
        proof=CommitteeProof(Committee.Trainer, 0, 3),
        assigned_batches=batches,
        warmup_lr_between=None,
        zero_optim=False,
        prev_self_results=prev,
        identity=NodeIdentity.from_single_key(bytes([1]) * 32),
        write_gradients_dir=None,
    )
