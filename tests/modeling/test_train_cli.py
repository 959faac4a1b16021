"""psyche-train end to end on local token files, and the minimal token-file reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from psyche.modeling.causal_lm import CausalLM, ModelOptions
from psyche.modeling.local_data import DataError, LocalTokenDataset
from psyche.modeling.train_cli import main


def _write_tokens(directory: Path, corpus: torch.Tensor) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    corpus.numpy().astype("<u2").tofile(directory / "000.ds")
    (directory / "000.ds.index").write_bytes(b"ignored")


def test_reader_layout(tmp_path: Path) -> None:
    np.arange(40, dtype="<u2").tofile(tmp_path / "a.npy")  # exactly 4 sequences of 10 tokens
    np.array([2**32 - 1] * 10, dtype="<u4").tofile(tmp_path / "b.txt")
    ds = LocalTokenDataset(tmp_path, token_size=2, seq_len=10, seed=None)
    assert len(ds) == 3  # the end is exclusive, as upstream's range
    assert ds.get_samples(1, 2).tolist() == [list(range(10, 20)), list(range(20, 30))]
    with pytest.raises(DataError, match="out of bounds"):
        ds.get_samples(2, 3)
    shuffled = LocalTokenDataset(tmp_path, token_size=2, seq_len=10, seed=7)
    assert sorted(shuffled.get_samples(0, 2).tolist()) == ds.get_samples(0, 2).tolist()

    wide = tmp_path / "wide"
    wide.mkdir()
    np.array([2**32 - 1, 5] * 10, dtype="<u4").tofile(wide / "x.bin")
    assert LocalTokenDataset(wide, 4, 4, None).get_samples(0, 0).tolist() == [[-1, 5, -1, 5]]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no tokens here")
    with pytest.raises(DataError, match="no training data"):
        LocalTokenDataset(empty, 2, 10, None)


@pytest.mark.parametrize("mode", ["distro-peers", "adamw"])
def test_psyche_train_runs_and_saves(
    tmp_path: Path, corpus: torch.Tensor, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    data = tmp_path / "data"
    _write_tokens(data, corpus)
    save = tmp_path / "ckpt"
    args = [
        "--init-config",
        "tiny",
        "--architecture",
        "HfLlama",
        "--device",
        "cpu",
        "--data-path",
        str(data),
        "--sequence-length",
        "32",
        "--micro-batch",
        "2",
        "--total-batch",
        "8",
        "--total-steps",
        "6",
        "--warmup-steps",
        "2",
        "--learning-rate",
        "3e-3",
        "--save-path",
        str(save),
    ]
    if mode == "distro-peers":
        args += [
            "--distro",
            "--distro-quantization",
            "--peers",
            "2",
            "--compression-chunk",
            "16",
            "--compression-topk",
            "4",
        ]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step: ")]
    assert len(lines) == 6
    assert lines[0].startswith("step: 1, duration: ")
    assert "batch: B[40, 47]" in lines[5] and "tokens/s: " in lines[5]
    assert "Saved checkpoint" in out
    model = CausalLM.from_pretrained(save, ModelOptions(architecture="HfLlama", device="cpu"))
    assert model.max_context_length == 32


def test_psyche_train_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="needs --distro"):
        main(["--peers", "2", "--data-path", str(tmp_path)])
    with pytest.raises(SystemExit, match="no training data"):
        main(["--data-path", str(tmp_path), "--init-config", "tiny"])
