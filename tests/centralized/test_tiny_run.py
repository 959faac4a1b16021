"""The tiny CPU run's assets: the committed model config and tokenizer, the generated dataset."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from psyche.centralized.tiny_run import END_OF_TEXT, write_tiny_dataset
from psyche.coordinator.run_config import load_run_config
from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.token_size import TokenSize
from psyche.data_provider import DataServerInfo, LocalDataProvider

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu"
TOKENIZER = TINY / "model" / "tokenizer.json"


def test_model_config_and_tokenizer_agree() -> None:
    config = json.loads((TINY / "model" / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is False  # HfLlama refuses tied embeddings
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    assert tokenizer.token_to_id(END_OF_TEXT) == config["eos_token_id"]
    assert tokenizer.decode(tokenizer.encode("The if statement").ids) == "The if statement"
    assert not list((TINY / "model").glob("*.safetensors"))  # weights are never committed
    run = load_run_config(TINY / "state.toml")
    data = DataServerInfo.load(TINY / "data.toml")
    assert data.seq_len == run.llm.max_seq_len <= config["max_position_embeddings"]
    assert run.llm.checkpoint.value.repo_id == "configs/tiny-cpu/model"  # type: ignore[attr-defined]


def test_dataset_is_whole_sequences_of_known_tokens_and_deterministic(tmp_path: Path) -> None:
    path = write_tiny_dataset(
        tmp_path / "a", tokenizer_path=TOKENIZER, seq_len=64, min_sequences=300
    )
    again = write_tiny_dataset(
        tmp_path / "b", tokenizer_path=TOKENIZER, seq_len=64, min_sequences=300
    )
    assert path.read_bytes() == again.read_bytes()
    tokens = np.frombuffer(path.read_bytes(), dtype="<u2")
    assert tokens.size % 64 == 0
    assert int(tokens.max()) < 512
    provider = LocalDataProvider.new_from_directory(
        tmp_path / "a", TokenSize.TwoBytes, 64, Shuffle.Seeded(bytes(32))
    )
    assert provider.num_sequences() >= 300
    batch = provider.read_batch(BatchId(0, 7))
    assert batch.shape == (8, 64)
    text = Tokenizer.from_file(str(TOKENIZER)).decode(tokens[:2000].tolist())
    assert "statement" in text or "object" in text  # English from the Python docs


def test_the_configured_dataset_covers_the_whole_run() -> None:
    with open(TINY / "state.toml", "rb") as f:
        state = tomllib.load(f)
    needed = state["config"]["total_steps"] * state["config"]["global_batch_size_end"]
    from psyche.centralized.tiny_run import DEFAULT_MIN_SEQUENCES

    assert needed <= DEFAULT_MIN_SEQUENCES
