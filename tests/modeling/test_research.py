"""DisTrO in plain loops and simulated peers, checked against the Trainer's client-style loop."""

from __future__ import annotations

from collections.abc import Callable

import torch

from psyche.core.definitions import ConstantLR, Distro, LearningRateSchedule, OptimizerDefinition
from psyche.modeling.research import DistroLoop, DistroSettings, PeerSimulation
from psyche.modeling.trainer import Batch, Trainer

SETTINGS = DistroSettings(
    compression_chunk=16, compression_topk=4, compression_decay=0.999, clip_grad_norm=1.0
)
LR = 3e-3


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids, use_cache=False).loss


def test_distro_loop_matches_the_trainer_bit_for_bit(
    tiny_llama: Callable, corpus: torch.Tensor
) -> None:
    a, b = tiny_llama(), tiny_llama()
    loop = DistroLoop(a.model, SETTINGS, lr=LR)
    definition = OptimizerDefinition.Distro(
        Distro(
            clip_grad_norm=1.0,
            weight_decay=0.0,
            compression_decay=0.999,
            compression_topk=4,
            compression_chunk=16,
            quantize_1bit=True,
        )
    )
    sched = LearningRateSchedule.Constant(
        ConstantLR(base_lr=LR, warmup_init_lr=0.0, warmup_steps=0)
    )
    trainer = Trainer(b, sched, definition, micro_batch_size=8)
    prev: list = []  # type: ignore[type-arg]
    for step in range(1, 6):
        ids = corpus[(step - 1) * 8 : step * 8]
        loop.zero_grad(step)
        _loss(a.model, ids).backward()
        loop.step(step)
        out = trainer.train(step, Batch(ids), prev_self_distro_results=prev)
        if step > 1:
            trainer.optimize(step, distro_results=[trainer.quantize_results(prev[0])])
        prev = [out.distro_results]
    for (n1, p1), (n2, p2) in zip(a.variables(), b.variables()):
        assert n1 == n2, n1
        assert torch.equal(p1, p2), n1


def _simulate(
    models: list, corpus: torch.Tensor, steps: int, wire: bool
) -> tuple[PeerSimulation, list[float]]:  # type: ignore[type-arg]
    sim = PeerSimulation([m.model for m in models], SETTINGS, lr=LR, through_wire=wire)
    losses = []
    per_peer = 8 // len(models)
    for step in range(1, steps + 1):
        sim.zero_grad(step)
        step_loss = 0.0
        for i, m in enumerate(sim.models):
            start = (step - 1) * 8 + i * per_peer
            loss = _loss(m, corpus[start : start + per_peer])
            loss.backward()
            step_loss += loss.item() / len(models)
        sim.step(step)
        losses.append(step_loss)
    return sim, losses


def test_simulated_peers_learn_and_the_wire_is_lossless(
    tiny_llama: Callable, corpus: torch.Tensor
) -> None:
    wired, losses = _simulate([tiny_llama() for _ in range(2)], corpus, 30, wire=True)
    direct, _ = _simulate([tiny_llama() for _ in range(2)], corpus, 30, wire=False)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8
    assert len(set(wired.last_payload_bytes)) == 1
    assert wired.last_payload_bytes[0] > 0
    for ma, mb in zip(wired.models, direct.models):
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            assert torch.equal(pa, pb)
    # replicas apply the same aggregate; only their own lookahead round trips differ
    first, second = (dict(m.named_parameters()) for m in wired.models)
    for name, p in first.items():
        torch.testing.assert_close(p, second[name], atol=1e-5, rtol=0)


def test_one_simulated_peer_is_the_plain_loop(tiny_llama: Callable, corpus: torch.Tensor) -> None:
    sim, _ = _simulate([tiny_llama()], corpus, 4, wire=True)
    model = tiny_llama()
    loop = DistroLoop(model.model, SETTINGS, lr=LR)
    for step in range(1, 5):
        loop.zero_grad(step)
        _loss(model.model, corpus[(step - 1) * 8 : step * 8]).backward()
        loop.step(step)
    for pa, pb in zip(sim.models[0].parameters(), model.model.parameters()):
        assert torch.equal(pa, pb)
