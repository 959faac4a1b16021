"""Fixtures for the modeling tests: a tiny Llama built from a config and a learnable corpus."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

VOCAB = 256
SEQ = 32


def bigram_corpus(n: int, seq_len: int = SEQ, seed: int = 1) -> torch.Tensor:
    """Sequences from a fixed sparse bigram chain (each token has two possible successors), so a
    model can learn it quickly and its loss has a known floor near ln 2."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 2), generator=torch.Generator().manual_seed(0))
    x = torch.empty(n, seq_len, dtype=torch.int64)
    x[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, seq_len):
        choice = torch.randint(0, 2, (n,), generator=g)
        x[:, t] = successors[x[:, t - 1], choice]
    return x


@pytest.fixture(scope="session")
def corpus() -> torch.Tensor:
    return bigram_corpus(50 * 8)


@pytest.fixture
def tiny_llama() -> Callable[..., object]:
    """Factory: `tiny_llama(architecture="HfLlama", dtype="fp32", **config_overrides)`."""
    from psyche.modeling.causal_lm import CausalLM, ModelOptions
    from psyche.modeling.configs import llama_config_dict

    def build(architecture: str = "HfLlama", dtype: str = "fp32", seed: int = 1337, **overrides):  # type: ignore[no-untyped-def]
        config = llama_config_dict("tiny", **overrides)
        options = ModelOptions(architecture=architecture, device="cpu", dtype=dtype, seed=seed)
        return CausalLM.from_config(config, options)

    return build


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The evaluation tests' tokenizer: the tiny run's (`eval_support.load_tokenizer`)."""
    from .eval_support import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def model() -> Any:
    """The evaluation tests' tiny random Llama (`eval_support.tiny_model`)."""
    from .eval_support import tiny_model

    return tiny_model()


@pytest.fixture(autouse=True)
def _single_thread(single_thread: None) -> None:
    """Every modeling test on one torch thread (tests/conftest.py's `single_thread`): tiny
    models gain nothing from intra-op threads, and OpenMP spinning on a busy 2-core machine makes
    them erratic."""
