"""Checkpoints in Hugging Face layout: transformers loads them back with identical logits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from psyche.modeling.causal_lm import CausalLM, ModelLoadError, ModelOptions
from psyche.modeling.checkpoint import (
    SaveCheckpointError,
    save_checkpoint,
    save_tensors_into_safetensors,
)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("max_part", [None, 70_000])
def test_save_load_roundtrip_identical_logits(
    tiny_llama: Callable, corpus: torch.Tensor, tmp_path: Path, max_part: int | None
) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    kwargs = {} if max_part is None else {"max_part_size": max_part}
    paths = save_checkpoint(model, tmp_path, **kwargs)
    names = sorted(p.name for p in paths)
    if max_part is None:
        assert names == ["config.json", "model.safetensors"]
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        parts = sorted({v for v in index["weight_map"].values()})
        assert len(parts) > 1
        assert parts[0] == f"model-00001-of-{len(parts):05}.safetensors"
        assert set(index["weight_map"]) == {n for n, _ in model.variables()}
        total = sum(p.numel() * p.element_size() for _, p in model.variables())
        assert index["metadata"]["total_size"] == total
    for part in tmp_path.glob("*.safetensors"):
        with safe_open(str(part), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert not list(tmp_path.glob(".*tmp"))

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = corpus[:2]
    assert torch.equal(_logits(loaded, ids), _logits(model.model, ids))

    again = CausalLM.from_pretrained(tmp_path, ModelOptions(architecture="HfLlama", device="cpu"))
    for (n1, a), (n2, b) in zip(again.variables(), model.variables()):
        assert n1 == n2
        assert torch.equal(a, b)


def test_parts_are_sorted_and_greedy(tmp_path: Path) -> None:
    tensors = {name: torch.zeros(25, dtype=torch.float32) for name in ["c", "a", "b", "d"]}
    paths = save_tensors_into_safetensors(tensors, tmp_path, max_part_size=200)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
        "d": "model-00002-of-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == 400
    assert [p.name for p in paths][-1] == "model.safetensors.index.json"
    assert set(load_file(tmp_path / "model-00002-of-00002.safetensors")) == {"c", "d"}
    with pytest.raises(SaveCheckpointError, match="over the part limit"):
        save_tensors_into_safetensors({"big": torch.zeros(100)}, tmp_path, max_part_size=200)
    with pytest.raises(SaveCheckpointError, match="no tensors"):
        save_tensors_into_safetensors({}, tmp_path)


def test_bf16_checkpoint_and_extra_files(tiny_llama: Callable, tmp_path: Path) -> None:
    source = tmp_path / "source"
    save_checkpoint(tiny_llama(), source)
    (source / "tokenizer.json").write_text('{"fake": true}')
    (source / "notes.txt").write_text("not copied")
    model = CausalLM.from_pretrained(source, ModelOptions(architecture="HfAuto", device="cpu"))
    out = tmp_path / "out"
    save_checkpoint(model, out, dtype=torch.bfloat16)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    tensors = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_missing_parameters_are_an_error(tiny_llama: Callable, tmp_path: Path) -> None:
    save_checkpoint(tiny_llama(), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks 1 parameters"):
        CausalLM.from_pretrained(tmp_path, ModelOptions(device="cpu"))


def test_non_pytorch_safetensors_are_refused(tiny_llama: Callable, tmp_path: Path) -> None:
    save_checkpoint(tiny_llama(), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "tf"})
    with pytest.raises(ModelLoadError, match="not a PyTorch"):
        CausalLM.from_pretrained(tmp_path, ModelOptions(device="cpu"))


def test_directory_without_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        CausalLM.from_pretrained(tmp_path, ModelOptions(device="cpu"))
