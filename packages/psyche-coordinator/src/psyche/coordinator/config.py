"""The `[config]` section of a run: timings, client counts and batch sizes (upstream
`CoordinatorConfig`). All times are whole seconds."""

from __future__ import annotations

import dataclasses
import enum

from psyche.core.numeric import round_half_away_from_zero, saturating_cast_unsigned
from psyche.core.serde import U8, U16, U32, U64, struct

SOLANA_MAX_NUM_CLIENTS = 256
SOLANA_MAX_NUM_WITNESSES = 32
# Upstream exports this but never reads it; the per-run `waiting_for_members_extra_time` is used.
# Here it is the default for configs written before that field existed.
WAITING_FOR_MEMBERS_EXTRA_SECONDS = 10


class ConfigError(enum.Enum):
    """Why `CoordinatorConfig.check_error` rejects a config (first failure wins)."""

    EpochTime = "epoch_time must be greater than 0"
    WarmupTime = "warmup_time must be less than epoch_time"
    MaxRoundTrainTime = "max_round_train_time must be greater than 0 and less than epoch_time"
    RoundWitnessTime = "round_witness_time must be greater than 0"
    MinClients = "min_clients must be greater than 0"
    InitMinClients = "init_min_clients must be at least min_clients and at most 256"
    GlobalBatchSize = (
        "global_batch_size_start and global_batch_size_end must be greater than 0, "
        "with end >= start"
    )
    TotalSteps = "total_steps must be greater than 0"
    WitnessNodes = "witness_nodes must be at most min_clients and at most 32"
    CooldownTime = "cooldown_time must be greater than 0"
    WaitingForMembersExtraTime = "waiting_for_members_extra_time must be greater than 0"

    @property
    def field(self) -> str:
        """The config field this error is about (for messages that name the TOML path)."""
        return {
            ConfigError.InitMinClients: "init_min_clients",
            ConfigError.GlobalBatchSize: "global_batch_size_start",
        }.get(self, _snake(self.name))


def _snake(name: str) -> str:
    out = ""
    for ch in name:
        out += ("_" + ch.lower()) if ch.isupper() and out else ch.lower()
    return out


@struct
class CoordinatorConfig:
    warmup_time: U64
    cooldown_time: U64
    max_round_train_time: U64
    round_witness_time: U64
    global_batch_size_warmup_tokens: U64
    epoch_time: U64
    total_steps: U32
    init_min_clients: U16
    min_clients: U16
    witness_nodes: U16
    global_batch_size_start: U16
    global_batch_size_end: U16
    verification_percent: U8
    waiting_for_members_extra_time: U8
    # A port extension (issue 27), in TOML and JSON only: upstream's postcard bytes and the Solana
    # account have no room for it (the centralized server sends it beside the state, in
    # `RunExtras`; a Solana run cannot turn it on). With `verification_percent > 0`, verifiers and
    # the tie-breaker also train a share of the round's batch (`data_selection`) and recompute in
    # the round's idle time after it; off, they train nothing (the rule before it existed).
    verifiers_train: bool = dataclasses.field(default=False, metadata={"wire": False})
    # A port extension (issue 27), in TOML and JSON only, carried as `verifiers_train` is: with
    # `verification_percent > 0` and a count here, each trainer's followers rebuild its payload
    # bit for bit (`psyche.coordinator.following`), every member computing with this many CPU
    # intra-op threads (the determinism class). 0 (the default): off.
    exact_verification_threads: U16 = dataclasses.field(default=0, metadata={"wire": False})

    def check_error(self) -> ConfigError | None:
        """Upstream's validation, in upstream's order; None when the config is valid."""
        if self.epoch_time == 0:
            return ConfigError.EpochTime
        if self.warmup_time >= self.epoch_time:
            return ConfigError.WarmupTime
        if self.max_round_train_time == 0 or self.max_round_train_time >= self.epoch_time:
            return ConfigError.MaxRoundTrainTime
        if self.round_witness_time == 0:
            return ConfigError.RoundWitnessTime
        if self.min_clients == 0:
            return ConfigError.MinClients
        if (
            self.init_min_clients < self.min_clients
            or self.init_min_clients > SOLANA_MAX_NUM_CLIENTS
        ):
            return ConfigError.InitMinClients
        if (
            self.global_batch_size_start == 0
            or self.global_batch_size_end == 0
            or self.global_batch_size_end < self.global_batch_size_start
        ):
            return ConfigError.GlobalBatchSize
        if self.total_steps == 0:
            return ConfigError.TotalSteps
        if self.witness_nodes > self.min_clients or self.witness_nodes > SOLANA_MAX_NUM_WITNESSES:
            return ConfigError.WitnessNodes
        if self.cooldown_time == 0:
            return ConfigError.CooldownTime
        if self.waiting_for_members_extra_time == 0:
            return ConfigError.WaitingForMembersExtraTime
        return None

    def get_batch_size(self, tokens_processed: int) -> int:
        """Global batch size (in sequences) once `tokens_processed` tokens have been trained."""
        if tokens_processed >= self.global_batch_size_warmup_tokens:
            return self.global_batch_size_end
        # Each integer is converted to f64 before dividing, as Rust's `as f64` does (Python's
        # int / int would round the exact quotient instead).
        progress = float(tokens_processed) / float(self.global_batch_size_warmup_tokens)
        start = float(self.global_batch_size_start)
        end = float(self.global_batch_size_end)
        # Rust: `(start + (end - start) * progress).round() as u16` — half away from zero, then a
        # saturating cast.
        return saturating_cast_unsigned(
            round_half_away_from_zero(start + (end - start) * progress), 16
        )
