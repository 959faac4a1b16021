"""Round statistics and the metadata a witness sends with its witness (upstream `stats.rs`).

The coordinator ignores the metadata; it is there for dashboards. No evals or prompt task run
here, so those fields stay empty.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from psyche.coordinator.coordinator import Coordinator, WitnessMetadata

_HISTORY = 16


def _no_nan(value: float, default: float) -> float:
    return default if math.isnan(value) else value


@dataclass
class StatsLogger:
    losses: list[float] = field(default_factory=list)
    step_durations: deque[float] = field(default_factory=lambda: deque(maxlen=_HISTORY))
    round_durations: deque[float] = field(default_factory=lambda: deque(maxlen=_HISTORY))
    last_optim_stats: dict[str, float] = field(default_factory=dict)
    bandwidth_total: float = 0.0

    def push_round_stats(
        self,
        round_losses: list[float],
        round_duration: float,
        step_duration: float | None,
        optim_stats: dict[str, float],
    ) -> float | None:
        """Record a finished training phase; returns the round's loss (the mean of its batches)."""
        loss = None
        if round_losses:
            loss = sum(round_losses) / len(round_losses)
            self.losses.append(loss)
        self.round_durations.append(round_duration)
        if step_duration is not None:
            self.step_durations.append(step_duration)
        self.last_optim_stats = optim_stats
        return loss

    def global_tokens_per_second(self, state: Coordinator) -> float:
        if not self.step_durations:
            return 0.0
        seconds = sum(self.step_durations)
        if seconds == 0.0:
            return 0.0
        tokens = (
            state.get_target_global_batch_size(state.current_round())
            * state.get_sequence_length()
            * len(self.step_durations)
        )
        return tokens / seconds

    def efficency(self) -> float:
        """(sic) Share of each step spent training, over the recent steps."""
        step_seconds = sum(self.step_durations)
        recent = list(self.round_durations)[len(self.round_durations) - len(self.step_durations) :]
        if step_seconds == 0.0:
            return math.nan
        return sum(recent) / step_seconds

    def witness_metadata(self, state: Coordinator) -> WitnessMetadata:
        loss = self.losses[-1] if self.losses else math.inf
        return WitnessMetadata(
            step=state.progress.step,
            tokens_per_sec=_no_nan(self.global_tokens_per_second(state), 0.0),
            bandwidth_per_sec=_no_nan(self.bandwidth_total, 0.0),
            loss=_no_nan(loss, math.inf),
            efficency=_no_nan(self.efficency(), 0.0),
        )
