"""LR schedules and optimizer definitions (upstream definitions.rs, token_size.rs, data_shuffle.rs)."""

from __future__ import annotations

import math
import sys
import tomllib

import pytest

from psyche.core.data_shuffle import Shuffle
from psyche.core.definitions import (
    AdamW,
    ConstantLR,
    CosineLR,
    Distro,
    LearningRateSchedule,
    LinearLR,
    OptimizerDefinition,
    WarmupStableDecayLR,
)
from psyche.core.serde import from_bytes, from_obj, to_bytes, to_obj
from psyche.core.token_size import TokenSize

from ..upstream_data import UpstreamData

EPS = sys.float_info.epsilon


def assert_relative_eq(a: float, b: float, epsilon: float = EPS) -> None:
    """approx's `assert_relative_eq!` (default max_relative = f64::EPSILON)."""
    diff = abs(a - b)
    assert diff <= epsilon or diff <= EPS * max(abs(a), abs(b)), (a, b)


def test_constant_lr() -> None:
    s = ConstantLR.new(0.01, 10, 0.001)
    assert_relative_eq(s.get_lr(0), 0.001)
    assert_relative_eq(s.get_lr(5), 0.001 + (0.01 - 0.001) * 0.5)
    assert_relative_eq(s.get_lr(9), 0.001 + (0.01 - 0.001) * 0.9)
    for step in (10, 100, 1000):
        assert_relative_eq(s.get_lr(step), 0.01)


def test_linear_lr() -> None:
    s = LinearLR.new(0.01, 10, 0.001, 100, 0.0001)
    assert_relative_eq(s.get_lr(0), 0.001)
    assert_relative_eq(s.get_lr(5), 0.001 + (0.01 - 0.001) * 0.5)
    assert_relative_eq(s.get_lr(10), 0.01)
    assert_relative_eq(s.get_lr(55), 0.01 + (0.0001 - 0.01) * 0.5)
    assert_relative_eq(s.get_lr(100), 0.0001)
    assert_relative_eq(s.get_lr(200), 0.0001)


def test_cosine_lr() -> None:
    s = CosineLR.new(0.01, 10, 0.001, 110, 0.0)
    assert_relative_eq(s.get_lr(0), 0.001)
    assert_relative_eq(s.get_lr(5), 0.001 + (0.01 - 0.001) * 0.5)
    assert_relative_eq(s.get_lr(10), 0.01)
    assert_relative_eq(s.get_lr(60), 0.005)
    assert_relative_eq(s.get_lr(110), 0.0)


def test_warmup_stable_decay_lr() -> None:
    s = WarmupStableDecayLR.new(0.01, 10, 0.001, 60, 110, 0.001, 20, 0.0)
    assert_relative_eq(s.get_lr(0), 0.001)
    assert_relative_eq(s.get_lr(5), 0.001 + (0.01 - 0.001) * 0.5)
    for step in (10, 30, 69, 70):
        assert_relative_eq(s.get_lr(step), 0.01)
    assert_relative_eq(s.get_lr(125), 0.0055, epsilon=1e-4)
    assert_relative_eq(s.get_lr(179), 0.001, epsilon=1e-4)
    assert_relative_eq(s.get_lr(180), 0.001)
    assert_relative_eq(s.get_lr(190), 0.0005)
    assert_relative_eq(s.get_lr(199), 0.0001, epsilon=1e-4)
    assert_relative_eq(s.get_lr(200), 0.0)
    assert_relative_eq(s.get_lr(250), 0.0)


def test_edge_cases() -> None:
    assert_relative_eq(ConstantLR.new(0.01, 0, 0.001).get_lr(0), 0.01)
    assert_relative_eq(LinearLR.new(0.01, 10, 0.01, 100, 0.001).get_lr(5), 0.01)
    assert_relative_eq(CosineLR.new(0.01, 10, 0.001, 100, 0.01).get_lr(50), 0.01)
    assert_relative_eq(
        WarmupStableDecayLR.new(0.01, 0, 0.001, 0, 0, 0.001, 0, 0.001).get_lr(0), 0.001
    )


def test_cosine_has_no_clamp_past_total_steps() -> None:
    s = CosineLR.new(0.01, 10, 0.001, 110, 0.0)
    assert_relative_eq(s.get_lr(210), 0.01)


def test_cosine_with_no_decay_steps_gives_nan_not_an_error() -> None:
    assert math.isnan(CosineLR.new(0.01, 10, 0.0, 10, 0.001).get_lr(10))


def test_warmup_stable_decay_asserts() -> None:
    with pytest.raises(ValueError, match="cosine_decay_final_lr <= base_lr"):
        WarmupStableDecayLR.new(0.01, 0, 0.0, 0, 0, 0.1, 0, 0.0).get_lr(0)
    with pytest.raises(ValueError, match="linear_decay_final_lr <= cosine_decay_final_lr"):
        WarmupStableDecayLR.new(0.01, 0, 0.0, 0, 0, 0.001, 0, 0.01).get_lr(0)


def test_schedule_dispatch_and_wire() -> None:
    schedule = LearningRateSchedule.Cosine(CosineLR.new(4e-4, 20, 0.0, 2000, 4e-5))
    assert schedule.get_warmup_steps() == 20
    assert schedule.get_warmup_init_lr() == 0.0
    assert schedule.get_lr(20) == 4e-4
    encoded = to_bytes(schedule, LearningRateSchedule)
    assert encoded.hex() == "022d431cebe2363a3f0000000000000000f168e388b5f8043f14d00f"
    assert from_bytes(encoded, LearningRateSchedule) == schedule
    assert to_obj(schedule, LearningRateSchedule) == {
        "Cosine": {
            "base_lr": 4e-4,
            "warmup_init_lr": 0.0,
            "final_lr": 4e-5,
            "warmup_steps": 20,
            "total_steps": 2000,
        }
    }


def test_optimizer_definitions() -> None:
    assert to_bytes(OptimizerDefinition.Dummy(), OptimizerDefinition) == b"\x00"
    adamw = OptimizerDefinition.AdamW(AdamW(betas=[0.9, 0.999], weight_decay=0.0, eps=1e-8))
    assert from_bytes(to_bytes(adamw, OptimizerDefinition), OptimizerDefinition) == adamw
    distro = from_obj(
        {
            "Distro": {
                "compression_decay": 0.999,
                "compression_topk": 16,
                "compression_chunk": 4,
                "quantize_1bit": False,
            }
        },
        OptimizerDefinition,
    )
    assert distro.value == Distro(
        compression_decay=0.999, compression_topk=16, compression_chunk=4, quantize_1bit=False
    )
    # f32 values are held as f32 (0.999 is not representable)
    assert distro.value.compression_decay == 0.9990000128746033
    encoded = to_bytes(distro, OptimizerDefinition)
    assert encoded[:3] == bytes([2, 0, 0])  # variant 2, clip_grad_norm None, weight_decay None
    assert from_bytes(encoded, OptimizerDefinition) == distro


def test_token_size_and_shuffle() -> None:
    assert TokenSize.from_num_bytes(2) is TokenSize.TwoBytes
    assert TokenSize.FourBytes.num_bytes == 4
    with pytest.raises(ValueError, match="Unsupported token bytes length 3"):
        TokenSize.from_num_bytes(3)
    assert to_bytes(Shuffle.DontShuffle(), Shuffle) == b"\x00"
    seeded = Shuffle.Seeded(bytes(range(1, 33)))
    assert to_bytes(seeded, Shuffle) == b"\x01" + bytes(range(1, 33))
    assert to_obj(seeded, Shuffle) == {"Seeded": list(range(1, 33))}


def test_upstream_configs_schedules_and_optimizers(upstream_data: UpstreamData) -> None:
    loaded = 0
    for path in upstream_data.glob("config", "*/*.toml"):
        doc = tomllib.loads(path.read_text())
        llm = doc.get("model", {}).get("LLM")
        if llm is None:
            continue
        schedule = from_obj(llm["lr_schedule"], LearningRateSchedule, source=str(path))
        assert schedule.get_lr(schedule.get_warmup_steps()) > 0
        optimizer = from_obj(llm["optimizer"], OptimizerDefinition, source=str(path))
        assert to_obj(optimizer, OptimizerDefinition) is not None
        loaded += 1
    assert loaded >= 7
