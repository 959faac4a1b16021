"""Tiny-Llama DiLoCo rounds the screening tests share: the model every member starts from
(`model`) and one honest round's results as sent (`honest_results`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from psyche.core.definitions import (
    ConstantLR,
    CosineLR,
    DilocoTransmission,
    LearningRateSchedule,
    OptimizerDefinition,
)
from psyche.modeling.causal_lm import CausalLM, ModelOptions
from psyche.modeling.configs import llama_config_dict
from psyche.modeling.diloco import Diloco, DilocoPeerSimulation, DilocoSettings
from psyche.modeling.distro import Distro
from psyche.modeling.research import DistroSettings, PeerSimulation
from psyche.modeling.screening import DISTRO_SCREENING, ResultReader, WitnessScreen
from psyche.modeling.trainer import Trainer

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


def constant(lr: float) -> LearningRateSchedule:
    return LearningRateSchedule.Constant(ConstantLR(lr, 0.0, 0))


MEMBERS = 4
HOSTILE = 3
"""A four-member DisTrO round's size and its hostile member's index (the last)."""


def distro_member() -> Trainer:
    """A member's trainer as `honest_checks.py` builds it (seed 1337, cosine LR from 1e-2)."""
    options = ModelOptions(architecture="HfLlama", device="cpu", seed=1337)
    network = CausalLM.from_config(llama_config_dict("tiny"), options)
    settings = DistroSettings(compression_chunk=16, compression_topk=4, clip_grad_norm=1.0)
    schedule = LearningRateSchedule.Cosine(
        CosineLR(base_lr=1e-2, warmup_init_lr=0.0, final_lr=1e-3, warmup_steps=0, total_steps=2)
    )
    definition = OptimizerDefinition.Distro(settings.definition())
    return Trainer(network, schedule, definition, micro_batch_size=1)


@dataclass
class WitnessSimulation:
    """Three simulated DisTrO peers (c16 k8, lr 3e-3) whose exchange keeps each round's sent
    results (`sent_by_round`), and peer 0's witness screen (shipped settings) and reader."""

    settings: DistroSettings
    sim: PeerSimulation
    sent_by_round: list[list[list]]  # type: ignore[type-arg]
    witness_distro: Distro
    reader: ResultReader
    witness: WitnessScreen


def witness_simulation() -> WitnessSimulation:
    settings = DistroSettings(compression_chunk=16, compression_topk=8, clip_grad_norm=1.0)
    sim = PeerSimulation([model() for _ in range(3)], settings, lr=constant(3e-3))
    sent_by_round: list[list[list]] = []  # type: ignore[type-arg]

    def exchange(sent: list[list], step: int) -> list[list]:  # type: ignore[type-arg]
        sent_by_round.append(sent)
        return sent

    sim._exchange = exchange  # type: ignore[method-assign]
    witness_distro = sim.peers[0].distro
    witness_distro.keep_encoded = True
    reader = ResultReader.of(witness_distro)
    witness = WitnessScreen(reader, DISTRO_SCREENING)
    return WitnessSimulation(settings, sim, sent_by_round, witness_distro, reader, witness)
