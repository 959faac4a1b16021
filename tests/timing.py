"""Round timers for tests, sized from this machine's measured speed.

The run configs the tests write give the coordinator's timers (warmup, round training,
witnessing, cooldown, epoch) in seconds, tuned on a busy two-core machine. On a slower or busier
machine the clients' work takes longer while the timers stay put: rounds run out, witnesses
miss their window, members are dropped, and the test fails for the machine, not the code.

`time_scale()` measures once per process how long a training step of the tiny CPU model
(configs/tiny-cpu, one thread, one batch of 8 x 128 tokens) takes here, against
`REFERENCE_STEP_SECONDS`, the same step at the load the timers were tuned for; the ratio, never
below 1 and at most `MAX_SCALE`, stretches the timers (`scaled_timers`) and the tests' waits
for what those timers pace (`scaled`, `Deadline`). A machine as fast keeps the tuned values, so
what a test checks about the timers' order and semantics is unchanged. The measure is the
lower quartile of steps spread over about a second: sustained load raises it, a passing spike
does not. `PSYCHE_TEST_TIME_SCALE=F` sets the factor instead of measuring.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REFERENCE_STEP_SECONDS = 0.05
"""The calibration step on the two-core machine the timers were tuned on, at the load they were
tuned for (other test runs beside, load 4-6): 40-60 ms; idle it takes 19-20 ms. The tests ran
green one at a time with two CPU-bound processes beside them on these values."""

MAX_SCALE = 4.0
"""Beyond this the machine is too busy for the suite to end in a sensible time: timers four
times as long already make a training test several minutes longer."""

TIMER_FIELDS = (
    "warmup_time",
    "cooldown_time",
    "epoch_time",
    "max_round_train_time",
    "round_witness_time",
    "waiting_for_members_extra_time",
)
"""The `CoordinatorConfig` fields that are durations in seconds."""

SCALE_ENV = "PSYCHE_TEST_TIME_SCALE"
TINY_MODEL_CONFIG = Path(__file__).resolve().parents[1] / "configs/tiny-cpu/model/config.json"


def tiny_step_seconds(samples: int = 15, gap: float = 0.05) -> float:
    """The lower quartile of `samples` forward and backward passes of the tiny model on one
    thread, `gap` seconds apart."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_dict(json.loads(TINY_MODEL_CONFIG.read_text()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
        tokens = torch.randint(0, config.vocab_size, (8, 128), generator=generator)

        def step() -> None:
            model(input_ids=tokens, labels=tokens).loss.backward()
            model.zero_grad(set_to_none=True)

        step()  # the first pass allocates
        times = []
        for _ in range(samples):
            time.sleep(gap)
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.quantiles(times, n=4)[0]
    finally:
        torch.set_num_threads(threads)


@functools.cache
def time_scale() -> float:
    """How many times slower than the tuning machine this one trains now (1 to `MAX_SCALE`)."""
    given = os.environ.get(SCALE_ENV)
    if given:
        value = float(given)
        if not value > 0:
            raise ValueError(f"{SCALE_ENV}={given}: expected a positive factor")
        return value
    return min(MAX_SCALE, max(1.0, tiny_step_seconds() / REFERENCE_STEP_SECONDS))


def scaled(seconds: float, scale: float | None = None) -> float:
    """A wait of `seconds` on the tuning machine, here."""
    return seconds * (time_scale() if scale is None else scale)


class Deadline:
    """A wait of `timeout` seconds on the tuning machine, from now: it expires `scaled(timeout)`
    seconds after it started. The scale is measured only once `timeout` itself has passed, so a
    wait that ends in time (most do) costs no calibration."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.start = time.monotonic()

    def expired(self) -> bool:
        elapsed = time.monotonic() - self.start
        return elapsed > self.timeout and elapsed > scaled(self.timeout)

    def __str__(self) -> str:
        """How long it waited, for failure messages."""
        return f"{time.monotonic() - self.start:.0f} s (the timeout {self.timeout:g} s, scaled)"


def scaled_timer(seconds: int, scale: float | None = None) -> int:
    """A coordinator timer of `seconds` on the tuning machine, here (whole seconds, rounded up)."""
    factor = time_scale() if scale is None else scale
    return math.ceil(seconds * factor - 1e-9)


def scaled_timers(config: Mapping[str, Any], scale: float | None = None) -> dict[str, Any]:
    """`config` with its timer fields (`TIMER_FIELDS`) scaled (`scaled_timer`); every other
    field as given."""
    return {
        key: scaled_timer(value, scale) if key in TIMER_FIELDS else value
        for key, value in config.items()
    }


def scale_config_timers(config: Any, scale: float | None = None) -> None:
    """Scale the timer fields of a `CoordinatorConfig` in place (in-process runs)."""
    for name in TIMER_FIELDS:
        setattr(config, name, scaled_timer(getattr(config, name), scale))


__all__ = [
    "MAX_SCALE",
    "REFERENCE_STEP_SECONDS",
    "SCALE_ENV",
    "TIMER_FIELDS",
    "Deadline",
    "scale_config_timers",
    "scaled",
    "scaled_timer",
    "scaled_timers",
    "time_scale",
    "tiny_step_seconds",
]
