"""Checkpoints in Hugging Face layout: safetensors parts (<= 5 GiB), an index, config, tokenizer.

Every file is written to a temporary name in the target directory and moved into place, so an
interrupted save never leaves a truncated file under a real name.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from psyche.modeling.causal_lm import CausalLM

MAX_SAFETENSOR_PART_SIZE = 5 * 1024 * 1024 * 1024
SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"


class SaveCheckpointError(ValueError):
    pass


def _atomic_write(path: Path, write: Callable[[str], object]) -> None:
    # The writer creates the temporary file itself, so it gets the usual permissions.
    tmp = str(path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp"))
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_part(tensors: Sequence[tuple[str, torch.Tensor]], path: Path) -> None:
    from safetensors.torch import save_file

    data = {name: t.detach().to("cpu").contiguous() for name, t in tensors}
    _atomic_write(path, lambda tmp: save_file(data, tmp, metadata={"format": "pt"}))


def save_tensors_into_safetensors(
    tensors: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    max_part_size: int = MAX_SAFETENSOR_PART_SIZE,
) -> list[Path]:
    """Write `tensors` sorted by name, greedily packed into parts of at most `max_part_size` bytes.

    One part is `model.safetensors`; more are `model-00001-of-0000N.safetensors` plus
    `model.safetensors.index.json`. A single tensor larger than a part is an error.
    """
    if not tensors:
        raise SaveCheckpointError("no tensors to save")
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[list[tuple[str, torch.Tensor]], int]] = [([], 0)]
    for name in sorted(tensors):
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        if size > max_part_size:
            raise SaveCheckpointError(f"tensor {name} has {size} bytes, over the part limit")
        if size + parts[-1][1] > max_part_size:
            parts.append(([], 0))
        items, total = parts[-1]
        items.append((name, tensor))
        parts[-1] = (items, total + size)
    if len(parts) == 1:
        path = out_dir / SINGLE_FILE_NAME
        _write_part(parts[0][0], path)
        return [path]
    count = len(parts)
    weight_map: dict[str, str] = {}
    paths = []
    for index, (items, _) in enumerate(parts):
        filename = f"model-{index + 1:05}-of-{count:05}.safetensors"
        _write_part(items, out_dir / filename)
        weight_map.update({name: filename for name, _ in items})
        paths.append(out_dir / filename)
    index_doc = {
        "metadata": {"total_size": sum(size for _, size in parts)},
        "weight_map": weight_map,
    }
    index_path = out_dir / INDEX_FILE_NAME
    _atomic_write(index_path, lambda tmp: Path(tmp).write_text(json.dumps(index_doc)))
    paths.append(index_path)
    return paths


def save_checkpoint(
    model: CausalLM,
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    extra_files: Sequence[Path] | None = None,
    max_part_size: int = MAX_SAFETENSOR_PART_SIZE,
) -> list[Path]:
    """Save `model` so that `AutoModelForCausalLM.from_pretrained(directory)` loads it back.

    `extra_files` (default: the config/tokenizer files of the checkpoint the model came from)
    are copied; a `config.json` is written from the model's config when none is copied.
    """
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = model.extract(dtype)
    paths = save_tensors_into_safetensors(tensors, out_dir, max_part_size)
    extras = list(model.checkpoint_extra_files() if extra_files is None else extra_files)
    for src in extras:
        dest = out_dir / src.name
        if src.resolve() == dest.resolve():
            continue
        _atomic_write(dest, functools.partial(shutil.copyfile, src))
        paths.append(dest)
    if not any(p.name == "config.json" for p in extras):
        config = model.config.to_dict()
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
        config_path = out_dir / "config.json"
        _atomic_write(
            config_path, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n")
        )
        paths.append(config_path)
    return paths
