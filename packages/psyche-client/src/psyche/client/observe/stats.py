"""Round statistics and the metadata a witness sends with its witness (upstream `stats.rs`), and
what a person reads: the progress line and the run summary.

The coordinator ignores the metadata; it is there for dashboards. With evaluations running
(`psyche.client.observe.evals`), it carries their latest scores (at most 8, names cut to 32 bytes) and the
prompt task's tokens, as upstream's `get_witness_metadata`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from psyche.coordinator import Coordinator, WitnessMetadata
from psyche.coordinator.run_state import MAX_TOKENS_TO_SEND, WitnessEvalResult

_HISTORY = 16


def _no_nan(value: float, default: float) -> float:
    return default if math.isnan(value) else value


class EvalSource(Protocol):
    """Where the witness metadata's evaluation fields come from (`EvalWorker`)."""

    def scores(self) -> dict[str, float]: ...

    def prompt_results(self) -> tuple[list[int], int]: ...


_MAX_EVALS = 8


@dataclass
class StatsLogger:
    losses: list[float] = field(default_factory=list)
    step_durations: deque[float] = field(default_factory=lambda: deque(maxlen=_HISTORY))
    round_durations: deque[float] = field(default_factory=lambda: deque(maxlen=_HISTORY))
    last_optim_stats: dict[str, float] = field(default_factory=dict)
    bandwidth_total: float = 0.0
    evals: EvalSource | None = None

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
        evals: list[WitnessEvalResult] = []
        prompt_results: list[int] = []
        prompt_index = 0
        if self.evals is not None:
            evals = [
                WitnessEvalResult.new_trunc_name(name, _no_nan(value, 0.0))
                for name, value in list(self.evals.scores().items())[:_MAX_EVALS]
            ]
            prompt_results, prompt_index = self.evals.prompt_results()
        return WitnessMetadata(
            step=state.progress.step,
            tokens_per_sec=_no_nan(self.global_tokens_per_second(state), 0.0),
            bandwidth_per_sec=_no_nan(self.bandwidth_total, 0.0),
            loss=_no_nan(loss, math.inf),
            efficency=_no_nan(self.efficency(), 0.0),
            evals=evals,
            prompt_results=prompt_results[-MAX_TOKENS_TO_SEND:],
            prompt_index=prompt_index,
        )


# --------------------------------------------------------------------------------------------
# Progress a person reads: step N of M, tokens per second, time left


@dataclass
class RunProgress:
    """The steps this client trained and when, for the progress line and the run summary.

    The time left is the remaining steps at the rate of the last `window` steps; epoch
    boundaries (warmup, cooldown) inside that window count, so the estimate includes them once
    the window spans an epoch.
    """

    window: int = 64
    recent: deque[tuple[int, float]] = field(default_factory=deque)
    first: tuple[int, float] | None = None
    last: tuple[int, float] | None = None
    tokens: int = 0

    def record(self, step: int, now: float, tokens: int) -> None:
        """Step `step` (of `tokens` tokens, the whole run's batch) finished at `now`."""
        if self.first is None:
            self.first = (step, now)
        else:
            self.tokens += tokens
        self.last = (step, now)
        self.recent.append((step, now))
        while len(self.recent) > self.window:
            self.recent.popleft()

    def seconds_per_step(self) -> float | None:
        if len(self.recent) < 2:
            return None
        (s0, t0), (s1, t1) = self.recent[0], self.recent[-1]
        if s1 <= s0:
            return None
        return (t1 - t0) / (s1 - s0)

    def seconds_left(self, step: int, total_steps: int) -> float | None:
        per_step = self.seconds_per_step()
        if per_step is None:
            return None
        return max(0, total_steps - step) * per_step

    def tokens_per_second(self) -> float | None:
        """The run's tokens per second since the first step this client trained."""
        if self.first is None or self.last is None or self.last[1] <= self.first[1]:
            return None
        return self.tokens / (self.last[1] - self.first[1])


def format_duration(seconds: float) -> str:
    """`45s`, `8m20s`, `2h05m`."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def progress_text(
    step: int,
    total_steps: int,
    epoch: int,
    loss: float | None,
    tokens_per_sec: float | None,
    seconds_left: float | None,
    verification: str = "",
) -> str:
    """The per-step progress line: `step 12/200 (epoch 0): loss 5.6507, 1,229 tok/s, about
    8m20s left`; a round this client had no batch in says so instead of a loss. `verification`
    (`VerificationSummary.text`, in a run with verifiers) follows after a semicolon:
    `...; verified 2 (1 mismatch: fd50b8e3 B[4, 7]), punished fd50b8e3 (trainer)`."""
    parts = ["no batch this round" if loss is None else f"loss {loss:.4f}"]
    if tokens_per_sec:
        parts.append(f"{tokens_per_sec:,.0f} tok/s")
    if seconds_left is not None:
        parts.append(f"about {format_duration(seconds_left)} left")
    line = f"step {step}/{total_steps} (epoch {epoch}): " + ", ".join(parts)
    return f"{line}; {verification}" if verification else line


def run_summary(
    run_id: str,
    fields: dict[str, Any],
    *,
    stage: str,
    final_checkpoint: Path | None,
    checkpointing: bool,
) -> str:
    """The one-line run summary (`run_finished`) from its fields; `stage` is how far this client
    got (`waiting`, `initializing`, `running`), `checkpointing` whether it had a checkpoint dir."""
    head = f"run {run_id!r} finished at step {fields['step']} of {fields['total_steps']}"
    if stage == "waiting":
        return f"{head}; this client joined after it ended: nothing to do"
    if stage == "initializing":
        return f"{head} while this client was still loading the model"
    parts = [f"{fields['epochs']} epoch" + ("" if fields["epochs"] == 1 else "s")]
    if fields["final_loss"] is not None:
        parts.append(f"final loss {fields['final_loss']:.4f}")
    if fields["tokens_per_sec"]:
        parts.append(f"{fields['tokens_per_sec']:,.0f} tok/s overall")
    parts.append(f"{format_duration(fields['wall_secs'])} in all")
    if final_checkpoint is not None:
        where = f"model saved to {final_checkpoint.absolute()}"
    elif not checkpointing:
        where = "model not saved (no --checkpoint-dir)"
    else:
        where = "no model saved (this client did not train in the last epoch)"
    return f"{head} ({', '.join(parts)}); {where}"
