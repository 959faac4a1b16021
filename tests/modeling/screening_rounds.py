"""Tiny-Llama DiLoCo rounds the screening tests share: the model every member starts from
(`model`) and one honest round's results as sent (`honest_results`)."""

from __future__ import annotations

import torch

from psyche.core.definitions import DilocoTransmission
from psyche.modeling.causal_lm import CausalLM, ModelOptions
from psyche.modeling.configs import llama_config_dict
from psyche.modeling.diloco import Diloco, DilocoPeerSimulation, DilocoSettings

from .conftest import SEQ, bigram_corpus

ROWS = 2  # per member per step


def model() -> torch.nn.Module:
    """The tiny Llama every member starts from (the same random init)."""
    options = ModelOptions(architecture="HfLlama", device="cpu", seed=1337)
    return CausalLM.from_config(llama_config_dict("tiny"), options).model


def honest_results(form: str, members: int = 4, seed: int = 2) -> tuple[Diloco, list[list]]:  # type: ignore[type-arg]
    """One DiLoCo round of `members` replicas on their own rows (`seed`'s), as sent."""
    transmission = {
        "bf16": DilocoTransmission.Bf16,
        "int8": DilocoTransmission.Int8,
        "sparse": DilocoTransmission.Sparse,
    }[form]
    settings = DilocoSettings(inner_steps=2, transmission=transmission, compression_topk=8)
    sim = DilocoPeerSimulation([model() for _ in range(members)], settings, lr=3e-3)
    data = bigram_corpus(2 * members * ROWS, SEQ, seed=seed)
    for step in (1, 2):
        for i, (m, r) in enumerate(zip(sim.models, sim.replicas)):
            start = ((step - 1) * members + i) * ROWS
            ids = data[start : start + ROWS]
            m(ids, labels=ids, use_cache=False).loss.backward()
            r.inner_step(3e-3)
    for r in sim.replicas:
        r.diloco.keep_encoded = True  # a witness's reference
    sent = [r.diloco.end_round(0) for r in sim.replicas]
    return sim.replicas[0].diloco, sent
