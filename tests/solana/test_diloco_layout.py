"""`OptimizerDefinition::DiLoCo` (a port extension) in the Solana account: it fits the 28 bytes
of the union Distro already sizes, so the enum, `LLM`, `Model` and the account keep upstream's
size and every existing offset (the upstream tables of `test_codecs` still hold)."""

from __future__ import annotations

import dataclasses
import struct
import tomllib
from pathlib import Path

import pytest
import tomli_w

from psyche.core.definitions import DiLoCo, DilocoTransmission, OptimizerDefinition
from psyche.core.serde import from_bytes, to_bytes, to_obj
from psyche.solana.borsh import from_borsh, to_borsh
from psyche.solana.state import REPR_C

REPO = Path(__file__).resolve().parents[2]

DILOCO = DiLoCo(
    inner_steps=500,
    transmission=DilocoTransmission.Int8,
    value_bits=2,
    compression_chunk=64,
    compression_topk=4,
    nesterov=True,
    outer_lr_follows_schedule=True,
    inner_weight_decay=0.1,
    inner_clip_grad_norm=1.0,
    outer_lr=0.7,
    outer_momentum=0.9,
    outer_clip_grad_norm=2.0,
)


def test_diloco_fits_the_union() -> None:
    assert REPR_C.layout(DiLoCo).size == 28
    assert REPR_C.layout(DiLoCo).align == 4
    layout = REPR_C.layout(OptimizerDefinition)
    assert (layout.size, layout.align) == (32, 4)


def test_diloco_repr_c_bytes() -> None:
    value = OptimizerDefinition.DiLoCo(DILOCO)
    encoded = REPR_C.encode(value, OptimizerDefinition)
    assert encoded == (
        struct.pack("<I", 3)  # tag
        + struct.pack("<HBBBBBB", 500, 1, 2, 64, 4, 1, 1)
        + struct.pack("<fffff", 0.1, 1.0, 0.7, 0.9, 2.0)
    )
    assert REPR_C.decode(encoded, OptimizerDefinition) == value


def test_diloco_borsh_bytes() -> None:
    value = OptimizerDefinition.DiLoCo(DILOCO)
    encoded = to_borsh(value, OptimizerDefinition)
    assert encoded == bytes([3]) + struct.pack(
        "<HBBBBBBfffff", 500, 1, 2, 64, 4, 1, 1, 0.1, 1.0, 0.7, 0.9, 2.0
    )
    assert from_borsh(encoded, OptimizerDefinition) == value


def test_peer_clip_multiple_travels_in_postcard_only() -> None:
    """The bounded aggregate's setting is appended to DiLoCo's postcard form (the centralized
    protocol); borsh and the Solana account keep the 28 bytes (`tests/solana`), and decode it
    as 0, off."""
    bounded = OptimizerDefinition.DiLoCo(dataclasses.replace(DILOCO, peer_clip_multiple=2.0))
    encoded = to_bytes(bounded, OptimizerDefinition)
    assert encoded[-4:] == struct.pack("<f", 2.0)
    assert from_bytes(encoded, OptimizerDefinition) == bounded
    plain = OptimizerDefinition.DiLoCo(DILOCO)
    assert to_borsh(bounded, OptimizerDefinition) == to_borsh(plain, OptimizerDefinition)
    assert REPR_C.encode(bounded, OptimizerDefinition) == REPR_C.encode(plain, OptimizerDefinition)
    assert from_borsh(to_borsh(bounded, OptimizerDefinition), OptimizerDefinition) == plain
    assert to_obj(bounded, OptimizerDefinition)["DiLoCo"]["peer_clip_multiple"] == 2.0


def test_a_solana_run_config_cannot_turn_on_the_bounded_aggregate(tmp_path: Path) -> None:
    """The account has no room for `peer_clip_multiple`: a run config that sets it is refused
    with the reason, rather than uploaded without it."""
    from psyche.solana.admin import AdminError, load_config_file

    doc = tomllib.loads((REPO / "configs/tiny-cpu-diloco/state.toml").read_text())
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps({"config": doc["config"], "model": doc["model"]}))
    with pytest.raises(AdminError, match=r"peer_clip_multiple.*no room"):
        load_config_file(path)
    doc["model"]["LLM"]["optimizer"]["DiLoCo"]["peer_clip_multiple"] = 0.0
    path.write_text(tomli_w.dumps({"config": doc["config"], "model": doc["model"]}))
    _config, model = load_config_file(path)
    assert model.value.optimizer.value.peer_clip_multiple == 0.0
