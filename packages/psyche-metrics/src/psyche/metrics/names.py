"""The names metrics are logged under, and what OpenTelemetry calls them.

Keys are the ones upstream's client logs to W&B each round (shared/client/src/state/stats.rs,
`publish_round_stats`), kept as upstream spells them (`train/efficency` included), so dashboards
built on upstream's runs read this port's. W&B, TensorBoard and the JSONL file use the keys as
they are. OpenTelemetry uses upstream's instrument names (shared/metrics/src/lib.rs,
`ClientMetrics`): `otel_instrument` maps a key to its instrument, and a key upstream has no
instrument for becomes `psyche_` + the key in snake case (`coordinator/epoch` ->
`psyche_coordinator_epoch`), a gauge.

Keys this port adds (round timings, bytes, server state) follow the same `group/name` form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

# ---- upstream's W&B keys (client, once per round) ------------------------------------------
TRAIN_LOSS = "train/loss"
TRAIN_PERPLEXITY = "train/perplexity"
TRAIN_CONFIDENCE = "train/confidence"
TRAIN_LR = "train/lr"
TRAIN_TOTAL_TOKENS = "train/total_tokens"
TRAIN_TOKENS_PER_SEC = "train/tokens_per_sec"
TRAIN_GLOBAL_TOKEN_BATCH_SIZE = "train/global_token_batch_size"
TRAIN_EFFICIENCY = "train/efficency"  # sic: upstream's key
COORDINATOR_NUM_CLIENTS = "coordinator/num_clients"
COORDINATOR_EPOCH = "coordinator/epoch"
COORDINATOR_ROUND = "coordinator/round"
EVAL_PREFIX = "eval/"
"""`eval/<task>`: a task's main metric; upstream lowercases the task name and replaces every
character that is not ASCII alphanumeric with `_` (`eval_key`)."""
EVAL_PARTIAL_PREFIX = "eval_partial/"
"""`eval_partial/<task>` (a port addition): a task's main metric over fewer documents than the
task holds (`--eval-task-max-docs` cut it short, or the first pass is not done), kept apart
from `eval/<task>` so that a dashboard never mistakes it for a full score."""
OPTIM_PREFIX = "optim/"
"""`optim/<stat>`: an optimizer statistic."""

# ---- this port's keys (what issue 17 asks the client and server to log) ---------------------
ROUND_TRAIN_SECONDS = "round/train_seconds"
"""This client's training time in the round (upstream's OTel `psyche_last_train_time_seconds`)."""
ROUND_DISTRO_SECONDS = "round/distro_seconds"
"""DisTrO compress + apply time in the round."""
ROUND_DOWNLOAD_SECONDS = "round/download_seconds"
"""Time from the round's start until the last peer result was downloaded."""
ROUND_WITNESS_SECONDS = "round/witness_seconds"
"""Time from the round's start until this client's witness was sent."""
ROUND_DURATION_SECONDS = "round/duration_seconds"
"""Wall time of the whole round (the server logs it per round)."""
P2P_PEERS = "p2p/peers"
"""Peers connected (upstream's OTel `psyche_peer_connections`, connection_type=selected)."""
P2P_DOWNLOAD_BYTES = "p2p/download_bytes"
"""Bytes received from peers since the start, a running total (OTel counter
`psyche_download_bytes`)."""
P2P_UPLOAD_BYTES = "p2p/upload_bytes"
"""Bytes sent to peers since the start, a running total (OTel counter `psyche_upload_bytes`)."""
P2P_BANDWIDTH = "p2p/bandwidth_bytes_per_sec"
"""Current receive bandwidth (OTel `psyche_bandwidth_bytes_per_second`)."""
COORDINATOR_STEP = "coordinator/step"
COORDINATOR_RUN_STATE = "coordinator/run_state"
"""The run state's name (`Warmup`, `RoundTrain`, ...): a string."""
COORDINATOR_HEALTHY_CLIENTS = "coordinator/healthy_clients"
"""Members that delivered in the last round (server)."""


def eval_key(task_name: str, *, partial: bool = False) -> str:
    """The key of an evaluation task's score, as upstream forms it (`eval/<task>`), or of a
    partial one (`eval_partial/<task>`)."""
    cleaned = "".join(c if c.isascii() and c.isalnum() else "_" for c in task_name.lower())
    return (EVAL_PARTIAL_PREFIX if partial else EVAL_PREFIX) + cleaned


# ---- OpenTelemetry ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Instrument:
    """One OpenTelemetry instrument a key is recorded on."""

    name: str
    kind: Literal["gauge", "counter"]
    """A gauge takes the logged value; a counter is logged as a running total and the OTel
    sink adds the difference from the last value it saw (a total that went down restarts)."""
    description: str = ""
    attributes: dict[str, str] = field(default_factory=dict)


ROUND_STEP = Instrument("psyche_round_step", "gauge", "Current step in the training round")
"""Recorded with the step of every `log` call."""

_UPSTREAM: dict[str, Instrument] = {
    TRAIN_LOSS: Instrument("psyche_training_loss", "gauge", "Current training loss"),
    TRAIN_PERPLEXITY: Instrument(
        "psyche_training_perplexity", "gauge", "Current training perplexity"
    ),
    TRAIN_CONFIDENCE: Instrument(
        "psyche_training_confidence", "gauge", "Current training confidence"
    ),
    TRAIN_LR: Instrument("psyche_learning_rate", "gauge", "Current learning rate"),
    TRAIN_TOTAL_TOKENS: Instrument("psyche_total_tokens", "gauge", "Total tokens processed"),
    TRAIN_TOKENS_PER_SEC: Instrument(
        "psyche_tokens_per_second", "gauge", "Tokens processed per second"
    ),
    TRAIN_GLOBAL_TOKEN_BATCH_SIZE: Instrument(
        "psyche_token_batch_size", "gauge", "Current token batch size"
    ),
    TRAIN_EFFICIENCY: Instrument(
        "psyche_training_efficiency", "gauge", "Training efficiency metric"
    ),
    ROUND_TRAIN_SECONDS: Instrument(
        "psyche_last_train_time_seconds", "gauge", "Last training round's training time"
    ),
    P2P_PEERS: Instrument(
        "psyche_peer_connections",
        "gauge",
        "Number of peer connections by type",
        {"connection_type": "selected"},
    ),
    P2P_BANDWIDTH: Instrument(
        "psyche_bandwidth_bytes_per_second",
        "gauge",
        "Current bandwidth usage in bytes per second",
    ),
    P2P_DOWNLOAD_BYTES: Instrument(
        "psyche_download_bytes", "counter", "Total number of bytes recv'd thru blobs"
    ),
    P2P_UPLOAD_BYTES: Instrument(
        "psyche_upload_bytes", "counter", "Total number of bytes sent to peers"
    ),
}

_NOT_SNAKE = re.compile(r"[^a-z0-9]+")


def otel_instrument(key: str) -> Instrument:
    """The instrument `key` is recorded on (see the module docstring)."""
    known = _UPSTREAM.get(key)
    if known is not None:
        return known
    if key.startswith(EVAL_PREFIX):
        return Instrument(
            "psyche_eval_metrics",
            "gauge",
            "Training eval metrics",
            {"metric": key[len(EVAL_PREFIX) :]},
        )
    if key.startswith(EVAL_PARTIAL_PREFIX):
        return Instrument(
            "psyche_eval_metrics",
            "gauge",
            "Training eval metrics",
            {"metric": key[len(EVAL_PARTIAL_PREFIX) :], "partial": "true"},
        )
    if key.startswith(OPTIM_PREFIX):
        return Instrument(
            "psyche_optimizer_stats", "gauge", "Optimizer stats", {"stat": key[len(OPTIM_PREFIX) :]}
        )
    snake = _NOT_SNAKE.sub("_", key.lower()).strip("_")
    return Instrument(f"psyche_{snake}", "gauge")
