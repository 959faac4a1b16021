"""Checks of a run's `DiLoCo` optimizer against the rest of its configuration (a port extension).

A DiLoCo round is one outer step: each trainer takes its round's batch (the coordinator's usual
assignment), splits it into `inner_steps` contiguous parts and takes one inner AdamW step on
each, then publishes its pseudo-gradient. So the round's batch must hold at least one sample per
inner step for every client of an epoch's first round, and the round must be long enough for the
inner steps: the round closes at `max_round_train_time` whether or not they are done, and a
client that has not finished by then publishes nothing for its batch (the batch goes untrained).
"""

from __future__ import annotations

import math

from psyche.coordinator.config import CoordinatorConfig
from psyche.core.definitions import DiLoCo, DilocoTransmission, LearningRateSchedule

# The shortest time an inner step can be given: no language model this port trains takes a
# forward and backward pass, an optimizer step and its share of the data fetch faster.
DILOCO_MIN_SECONDS_PER_INNER_STEP = 0.1
DILOCO_VALUE_BITS = (1, 2, 4, 8)


def diloco_problems(
    config: CoordinatorConfig,
    definition: DiLoCo,
    lr_schedule: LearningRateSchedule,
    where: str = "model.LLM.optimizer.DiLoCo",
) -> list[tuple[str, str]]:
    """Every reason `definition` cannot run with `config`, as (TOML path, message) pairs."""
    d = definition
    problems: list[tuple[str, str]] = []

    def bad(field: str, message: str) -> None:
        problems.append((f"{where}.{field}", message))

    if d.inner_steps < 1:
        bad("inner_steps", f"must be at least 1, found {d.inner_steps}")
    for name in ("inner_weight_decay", "inner_clip_grad_norm", "outer_clip_grad_norm"):
        value = getattr(d, name)
        if not (math.isfinite(value) and value >= 0.0):
            bad(name, f"must be a finite number >= 0 (0 = none), found {value}")
    if not (
        math.isfinite(d.peer_clip_multiple)
        and (d.peer_clip_multiple in (0.0, 1.0) or d.peer_clip_multiple > 1.0)
    ):
        bad(
            "peer_clip_multiple",
            "must be 0 (off) or a finite number >= 1 (a payload's norm bound in multiples of "
            f"the round's median; 2 to 3 leaves honest payloads untouched), found "
            f"{d.peer_clip_multiple}",
        )
    if not (math.isfinite(d.outer_lr) and d.outer_lr > 0.0):
        bad("outer_lr", f"must be a finite number > 0 (DiLoCo uses about 0.7), found {d.outer_lr}")
    if not (math.isfinite(d.outer_momentum) and 0.0 <= d.outer_momentum < 1.0):
        bad("outer_momentum", f"must be in [0, 1), found {d.outer_momentum}")
    elif d.nesterov and d.outer_momentum == 0.0:
        bad("nesterov", "Nesterov momentum needs outer_momentum > 0 (DiLoCo uses 0.9)")
    if d.transmission is DilocoTransmission.Sparse:
        if d.value_bits not in DILOCO_VALUE_BITS:
            bad("value_bits", f"must be one of {list(DILOCO_VALUE_BITS)}, found {d.value_bits}")
        if d.compression_topk < 1:
            bad("compression_topk", "must be at least 1 (values kept per DCT block)")
    if d.transmission is not DilocoTransmission.Bf16 and d.compression_chunk < 1:
        bad("compression_chunk", f"must be at least 1 for {d.transmission.name}")
    if d.outer_lr_follows_schedule and not lr_schedule.value.base_lr > 0.0:
        bad(
            "outer_lr_follows_schedule",
            "the outer lr follows lr_schedule / lr_schedule.base_lr, so base_lr must be > 0",
        )

    if d.inner_steps >= 1:
        need = d.inner_steps * config.init_min_clients
        for name in ("global_batch_size_start", "global_batch_size_end"):
            size = getattr(config, name)
            if size < need:
                problems.append(
                    (
                        f"config.{name}",
                        f"{name} ({size}) must be at least inner_steps ({d.inner_steps}) x "
                        f"init_min_clients ({config.init_min_clients}) = {need}: a DiLoCo round "
                        "splits each client's share of the batch into one part per inner step",
                    )
                )
        per_step = config.max_round_train_time / d.inner_steps
        if per_step < DILOCO_MIN_SECONDS_PER_INNER_STEP:
            problems.append(
                (
                    "config.max_round_train_time",
                    f"max_round_train_time ({config.max_round_train_time} s) leaves "
                    f"{per_step:.3g} s per inner step for inner_steps = {d.inner_steps}; each "
                    f"needs at least {DILOCO_MIN_SECONDS_PER_INNER_STEP} s (a round closes at "
                    "max_round_train_time, and a client whose inner steps are not done by then "
                    "publishes nothing): raise max_round_train_time to at least "
                    f"{math.ceil(d.inner_steps * DILOCO_MIN_SECONDS_PER_INNER_STEP)} or lower "
                    "inner_steps",
                )
            )
    return problems
