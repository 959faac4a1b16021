"""psyche-train end to end on local token files (read by psyche.data_provider) and on
preprocessed parquet data, and its `--seed` derivation."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from psyche.cli.train.main import _open_dataset, _read_batch, main, seed_shuffle
from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.rng import ChaCha8Rng, shuffle_permutation
from psyche.core.token_size import TokenSize
from psyche.data_provider import LocalDataProvider
from psyche.modeling.causal_lm import CausalLM, ModelOptions

# `_single_thread`: the modeling tests' autouse fixture (tiny models on one intra-op thread).
from ..modeling.conftest import _single_thread, bigram_corpus  # noqa: F401


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return bigram_corpus(50 * 8)


def _write_tokens(directory: Path, corpus: torch.Tensor) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    corpus.numpy().astype("<u2").tofile(directory / "000.ds")
    (directory / "000.ds.index").write_bytes(b"ignored")


def test_seed_is_upstreams_u32_in_the_last_four_bytes() -> None:
    assert seed_shuffle(None) == Shuffle.DontShuffle()
    assert seed_shuffle(7) == Shuffle.Seeded(bytes(28) + b"\x00\x00\x00\x07")
    assert seed_shuffle(0x01020304) == Shuffle.Seeded(bytes(28) + bytes([1, 2, 3, 4]))
    for bad in ("-1", str(2**32)):
        with pytest.raises(SystemExit):
            main(["--seed", bad])


def test_batches_come_from_the_data_provider_in_its_shuffled_order(tmp_path: Path) -> None:
    np.arange(400, dtype="<u2").tofile(tmp_path / "a.ds")  # 400 tokens -> 39 sequences of 10
    args = argparse.Namespace(data_path=tmp_path, token_size=2, sequence_length=10, seed=1234)
    dataset = _open_dataset(args)
    try:
        batch = _read_batch(dataset, BatchId(4, 11))
        assert batch.input_ids.dtype == torch.int64
        assert batch.input_ids.shape == (8, 10)
        perm = shuffle_permutation(39, ChaCha8Rng(bytes(28) + (1234).to_bytes(4, "big")))
        starts = [10 * int(i) for i in perm[4:12]]
        assert batch.input_ids[:, 0].tolist() == starts
        assert batch.input_ids[0].tolist() == list(range(starts[0], starts[0] + 10))
        with LocalDataProvider.new_from_directory(
            tmp_path, TokenSize.TwoBytes, 10, seed_shuffle(1234)
        ) as same:
            assert np.array_equal(same.read_batch(BatchId(4, 11)), batch.input_ids.numpy())
    finally:
        dataset.close()


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
    if mode == "adamw":
        args += ["--seed", "42"]
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
    assert "batch: B[40, 47]" in lines[5]
    assert "tokens/s: " in lines[5]
    assert "Saved checkpoint" in out
    model = CausalLM.from_pretrained(save, ModelOptions(architecture="HfLlama", device="cpu"))
    assert model.max_context_length == 32


def test_psyche_train_argument_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["--peers", "2", "--data-path", str(tmp_path)])
    assert usage.value.code == 2
    assert "needs --distro" in capsys.readouterr().err
    assert main(["--data-path", str(tmp_path), "--init-config", "tiny"]) == 1
    assert re.search(
        r"psyche-train: error: No training data files.*preprocessed data", capsys.readouterr().err
    )


def test_psyche_train_falls_back_to_preprocessed_parquet(
    tmp_path: Path, corpus: torch.Tensor, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = corpus[:16].tolist()
    labels = [[-100, *r[1:]] for r in rows]
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"inputs": rows, "labels": labels}), data / "train-0.parquet")
    args = ["--init-config", "tiny", "--architecture", "HfLlama", "--device", "cpu"]
    args += ["--data-path", str(data), "--sequence-length", "32", "--seed", "3"]
    args += ["--micro-batch", "4", "--total-batch", "4", "--total-steps", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Trying preprocessed data provider instead" in out
    assert "Loaded preprocessed dataset with 16 samples" in out
    assert len([line for line in out.splitlines() if line.startswith("step: ")]) == 2
