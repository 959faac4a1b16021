"""The `DiLoCo` optimizer definition (a port extension): its postcard and TOML forms, and the
existing variants' bytes left as they were."""

from __future__ import annotations

import struct

from psyche.core.definitions import (
    AdamW,
    DiLoCo,
    DilocoTransmission,
    Distro,
    OptimizerDefinition,
)
from psyche.core.serde import from_bytes, from_obj, to_bytes, to_obj

DILOCO = DiLoCo(
    inner_steps=100,
    transmission=DilocoTransmission.Sparse,
    value_bits=2,
    compression_chunk=64,
    compression_topk=4,
    nesterov=True,
    outer_lr_follows_schedule=False,
    inner_weight_decay=0.1,
    inner_clip_grad_norm=1.0,
    outer_lr=0.7,
    outer_momentum=0.9,
    outer_clip_grad_norm=0.0,
)


def test_diloco_is_appended_after_the_upstream_variants() -> None:
    # upstream's tags 0..2 keep their bytes; DiLoCo is tag 3 (`test_diloco_postcard_bytes`)
    assert to_bytes(OptimizerDefinition.Dummy(), OptimizerDefinition) == b"\x00"
    adamw = OptimizerDefinition.AdamW(AdamW([0.9, 0.95], 0.1, 1e-8, None))
    assert to_bytes(adamw, OptimizerDefinition)[0] == 1
    distro = OptimizerDefinition.Distro(
        Distro(
            clip_grad_norm=None,
            compression_decay=0.999,
            compression_topk=8,
            compression_chunk=64,
            quantize_1bit=True,
        )
    )
    assert to_bytes(distro, OptimizerDefinition)[0] == 2


def test_diloco_postcard_bytes() -> None:
    value = OptimizerDefinition.DiLoCo(DILOCO)
    encoded = to_bytes(value, OptimizerDefinition)
    assert encoded == (
        bytes([3, 100, 2, 2, 64, 4, 1, 0])  # tag, u16 varint, enum varint, u8s, bools
        + struct.pack("<fffff", 0.1, 1.0, 0.7, 0.9, 0.0)
        + struct.pack("<f", 0.0)  # peer_clip_multiple, appended (postcard only)
    )
    assert from_bytes(encoded, OptimizerDefinition) == value


def test_diloco_toml_form() -> None:
    obj = {
        "DiLoCo": {
            "inner_steps": 100,
            "transmission": "Sparse",
            "value_bits": 2,
            "compression_chunk": 64,
            "compression_topk": 4,
            "nesterov": True,
            "outer_lr_follows_schedule": False,
            "inner_weight_decay": 0.1,
            "inner_clip_grad_norm": 1.0,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "outer_clip_grad_norm": 0.0,
        }
    }
    value = from_obj(obj, OptimizerDefinition)
    assert value == OptimizerDefinition.DiLoCo(DILOCO)
    assert from_obj(to_obj(value, OptimizerDefinition), OptimizerDefinition) == value
