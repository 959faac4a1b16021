"""Trainer on a tiny Llama built from a config: convergence, determinism, micro-batches, models."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import (
    Distro,
    OptimizerDefinition,
)
from psyche.modeling.adamw import LibtorchAdamW
from psyche.modeling.causal_lm import CausalLM, ModelLoadError, ModelOptions, clip_grad_norm_native
from psyche.modeling.configs import deepseek_config_dict
from psyche.modeling.lr import get_lr
from psyche.modeling.serialized_distro import transmittable_distro_result
from psyche.modeling.trainer import Batch, Trainer, TrainerError

from .tiny_trainer import adamw_def, constant


def distro_def(chunk: int = 64, topk: int = 8, clip: float | None = 1.0) -> OptimizerDefinition:
    return OptimizerDefinition.Distro(
        Distro(
            clip_grad_norm=clip,
            weight_decay=0.0,
            compression_decay=0.999,
            compression_topk=topk,
            compression_chunk=chunk,
            quantize_1bit=True,
        )
    )


def run_distro(trainer: Trainer, corpus: torch.Tensor, steps: int, batch: int = 8):  # type: ignore[no-untyped-def]
    """Upstream's examples/train loop with one DisTrO node; returns losses and sent payloads."""
    prev: list = []  # type: ignore[type-arg]
    losses, payloads = [], []
    for step in range(1, steps + 1):
        out = trainer.train(
            step, Batch(corpus[(step - 1) * batch : step * batch]), prev_self_distro_results=prev
        )
        if step > 1:
            trainer.optimize(step, distro_results=[trainer.quantize_results(prev[0])])
        assert out.distro_results is not None
        sent = trainer.quantize_results(out.distro_results)
        payloads.append(transmittable_distro_result(sent, step, out.nonce, BatchId(step, step)))
        prev = [out.distro_results]
        losses.append(out.loss)
    return losses, payloads


def test_distro_reduces_loss_over_50_steps(tiny_llama: Callable, corpus: torch.Tensor) -> None:
    trainer = Trainer(tiny_llama(), constant(3e-3), distro_def(), micro_batch_size=4)
    losses, _ = run_distro(trainer, corpus, 50)
    assert losses[0] == pytest.approx(math.log(256), abs=0.1)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


def test_adamw_reduces_loss(tiny_llama: Callable, corpus: torch.Tensor) -> None:
    trainer = Trainer(tiny_llama(), constant(3e-3), adamw_def(), micro_batch_size=8)
    losses = []
    for step in range(1, 31):
        losses.append(trainer.train(step, Batch(corpus[(step - 1) * 8 : step * 8])).loss)
        trainer.optimize(step)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_two_trainers_are_bit_identical(
    tiny_llama: Callable, corpus: torch.Tensor, dtype: str
) -> None:
    runs = []
    for _ in range(2):
        model = tiny_llama(dtype=dtype)
        trainer = Trainer(model, constant(3e-3), distro_def(chunk=16, topk=4), micro_batch_size=4)
        losses, payloads = run_distro(trainer, corpus, 4)
        runs.append((model, losses, [p.to_bytes() for p in payloads]))
    (m1, l1, p1), (m2, l2, p2) = runs
    assert l1 == l2
    assert p1 == p2
    for (n1, a), (n2, b) in zip(m1.variables(), m2.variables()):
        assert n1 == n2
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


def test_micro_batches_and_fp32_accumulation(tiny_llama: Callable, corpus: torch.Tensor) -> None:
    batch = Batch(corpus[:6])
    grads = {}
    for mbs, fp32 in [(6, False), (4, False), (4, True), (1, True)]:
        trainer = Trainer(
            tiny_llama(), constant(1e-3), adamw_def(), micro_batch_size=mbs, grad_accum_in_fp32=fp32
        )
        out = trainer.train(1, batch)
        grads[(mbs, fp32)] = (out.loss, [p.grad.clone() for _, p in trainer.model.variables()])
    ref_loss, ref_grads = grads[(6, False)]
    for key, (loss, g) in grads.items():
        # 6 rows in 2 chunks of 3 (torch.chunk), or 6 of 1: equal-sized micro-batch means
        assert loss == pytest.approx(ref_loss, rel=1e-5), key
        for a, b in zip(g, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_distro_train_needs_previous_results(tiny_llama: Callable, corpus: torch.Tensor) -> None:
    trainer = Trainer(tiny_llama(), constant(1e-3), distro_def(), micro_batch_size=4)
    with pytest.raises(TrainerError, match="previous results"):
        trainer.train(1, Batch(corpus[:4]))
    with pytest.raises(TrainerError, match="result list"):
        trainer.optimize(1)


def test_cancelled_training_produces_no_results(tiny_llama: Callable, corpus: torch.Tensor) -> None:
    class Cancelled:
        def is_set(self) -> bool:
            return True

    trainer = Trainer(tiny_llama(), constant(1e-3), distro_def(), micro_batch_size=4)
    out = trainer.train(1, Batch(corpus[:4]), prev_self_distro_results=[], cancel=Cancelled())
    assert out.cancelled
    assert out.distro_results is None
    assert out.loss == 0.0
    assert trainer.nonce == 1


def test_get_lr_warmup_factor() -> None:
    sched = constant(0.5)
    assert get_lr(sched, 10) == 0.5
    assert get_lr(sched, 10, (10, 14)) == 0.0
    assert get_lr(sched, 11, (10, 14)) == 0.125
    assert get_lr(sched, 14, (10, 14)) == 0.5
    assert get_lr(sched, 15, (10, 14)) == 0.5


def test_native_clip_formula() -> None:
    grads = [torch.full((4,), 3.0), torch.full((2, 2), 4.0)]  # total norm sqrt(36 + 64) = 10
    total = clip_grad_norm_native(grads, 5.0)
    assert total == pytest.approx(10.0)
    scale = 5.0 / (10.0 + 1e-6)
    assert torch.equal(grads[0], torch.full((4,), 3.0).mul_(scale))
    unchanged = [torch.full((4,), 0.1)]
    clip_grad_norm_native(unchanged, 5.0)
    assert torch.equal(unchanged[0], torch.full((4,), 0.1))


def test_libtorch_adamw_matches_torch_adamw_semantics() -> None:
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(10, 10, dtype=torch.float64))
    p2 = torch.nn.Parameter(p1.detach().clone())
    ours = LibtorchAdamW([p1], betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    ref = torch.optim.AdamW([p2], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    for _ in range(5):
        g = torch.randn(10, 10, dtype=torch.float64)
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step(1e-2)
        ref.step()
    torch.testing.assert_close(p1, p2, rtol=1e-12, atol=1e-14)


def test_architecture_checks(tiny_llama: Callable) -> None:
    with pytest.raises(ModelLoadError, match="unknown architecture"):
        tiny_llama(architecture="Native")
    with pytest.raises(ModelLoadError, match="tied embeddings"):
        tiny_llama(architecture="HfLlama", tie_word_embeddings=True)
    with pytest.raises(ModelLoadError, match="deepseek"):
        tiny_llama(architecture="HfDeepseek")
    tied = tiny_llama(architecture="HfAuto", tie_word_embeddings=True)
    names = [n for n, _ in tied.variables()]
    assert "lm_head.weight" not in names
    assert "model.embed_tokens.weight" in names


def test_deepseek_trains_with_distro(corpus: torch.Tensor) -> None:
    config = deepseek_config_dict()
    model = CausalLM.from_config(config, ModelOptions(architecture="HfDeepseek", device="cpu"))
    trainer = Trainer(model, constant(1e-3), distro_def(chunk=16, topk=4), micro_batch_size=4)
    losses, payloads = run_distro(trainer, corpus, 3)
    assert all(math.isfinite(x) for x in losses)
    assert len(payloads[-1].distro_results) == len(model.variables())


def test_run_config_architecture_enum_is_accepted() -> None:
    from psyche.coordinator.model import LLMArchitecture
    from psyche.modeling.causal_lm import architecture_name

    assert architecture_name(LLMArchitecture.HfDeepseek) == "HfDeepseek"
    assert architecture_name(LLMArchitecture.Torchtitan) == "Torchtitan"
