"""CUDA checks (skipped without a GPU): bf16 determinism, bases, training and hostile input."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import ConstantLR, Distro, LearningRateSchedule, OptimizerDefinition
from psyche.modeling.causal_lm import CausalLM, ModelOptions
from psyche.modeling.configs import llama_config_dict
from psyche.modeling.dct import TransformDCT, dct, idct
from psyche.modeling.distro import Distro as DistroOptimizer
from psyche.modeling.serialized_distro import (
    InvalidDistroResult,
    SerializableTensorData,
    distro_results_from_transmittable,
    transmittable_distro_result,
)
from psyche.modeling.trainer import Batch, Trainer

pytestmark = pytest.mark.gpu


def _definition() -> OptimizerDefinition:
    return OptimizerDefinition.Distro(
        Distro(
            clip_grad_norm=1.0,
            weight_decay=0.1,
            compression_decay=0.999,
            compression_topk=8,
            compression_chunk=64,
            quantize_1bit=True,
        )
    )


def _cuda_model(seed: int = 1337) -> CausalLM:
    config = llama_config_dict("tiny", hidden_size=128, intermediate_size=384, vocab_size=512)
    return CausalLM.from_config(
        config, ModelOptions(architecture="HfLlama", device="cuda", seed=seed)
    )


def _run(model: CausalLM, corpus: torch.Tensor, steps: int) -> tuple[list[float], list[bytes]]:
    sched = LearningRateSchedule.Constant(
        ConstantLR(base_lr=3e-3, warmup_init_lr=0.0, warmup_steps=0)
    )
    trainer = Trainer(model, sched, _definition(), micro_batch_size=4)
    prev: list = []  # type: ignore[type-arg]
    losses, payloads = [], []
    for step in range(1, steps + 1):
        out = trainer.train(
            step, Batch(corpus[(step - 1) * 8 : step * 8]), prev_self_distro_results=prev
        )
        if step > 1:
            trainer.optimize(step, distro_results=[trainer.quantize_results(prev[0])])
        sent = trainer.quantize_results(out.distro_results)  # type: ignore[arg-type]
        payloads.append(transmittable_distro_result(sent, step, 0, BatchId(step, step)).to_bytes())
        prev = [out.distro_results]
        losses.append(out.loss)
    return losses, payloads


def test_models_default_to_bf16_on_cuda() -> None:
    model = _cuda_model()
    assert model.device.type == "cuda"
    assert model.dtype == torch.bfloat16


def test_cuda_bf16_determinism(corpus: torch.Tensor) -> None:
    a, b = _cuda_model(), _cuda_model()
    la, pa = _run(a, corpus, 6)
    lb, pb = _run(b, corpus, 6)
    assert la == lb
    assert pa == pb
    for (_, x), (_, y) in zip(a.variables(), b.variables()):
        assert torch.equal(x, y)


def test_distro_reduces_loss_on_cuda(corpus: torch.Tensor) -> None:
    losses, _ = _run(_cuda_model(), corpus, 40)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5


@pytest.mark.parametrize("n", [16, 64, 29, 100])
def test_cuda_bases_are_reproducible_and_close_to_cpu(n: int) -> None:
    eye = torch.eye(n, device="cuda")
    assert torch.equal(dct(eye), dct(torch.eye(n, device="cuda")))
    torch.testing.assert_close(dct(eye).cpu(), dct(torch.eye(n)), atol=1e-6, rtol=0)
    torch.testing.assert_close(idct(eye).cpu(), idct(torch.eye(n)), atol=1e-6, rtol=0)


def test_einsum_contraction_is_reproducible_on_cuda() -> None:
    x = torch.randn(512, 768, device="cuda").bfloat16()
    t = TransformDCT([(x.shape, x.dtype, x.device)], 64)
    assert torch.equal(t.encode(x), t.encode(x.clone()))
    assert torch.equal(t.decode(t.encode(x)), t.decode(t.encode(x).clone()))


def test_out_of_range_index_never_reaches_the_gpu() -> None:
    p = torch.nn.Parameter(torch.zeros(128, 128, device="cuda", dtype=torch.bfloat16))
    distro = DistroOptimizer([("w", p)], 0.999, 64, 8)
    p.grad = torch.randn_like(p)
    results = distro.generate([], 0.0, 1e-3)
    payload = transmittable_distro_result(results, 1, 0, BatchId(0, 0))
    first = payload.distro_results[0]
    raw = bytearray(first.sparse_idx.raw_tensor_data())
    raw[0:2] = (60000).to_bytes(2, "little")
    bad_idx = dataclasses.replace(first.sparse_idx, data=SerializableTensorData.Full(bytes(raw)))
    bad = dataclasses.replace(
        payload, distro_results=[dataclasses.replace(first, sparse_idx=bad_idx)]
    )
    with pytest.raises(InvalidDistroResult, match="out of range"):
        distro_results_from_transmittable(bad, distro.layouts())
    good = distro_results_from_transmittable(payload, distro.layouts())
    distro.apply([good], 1e-3)
    torch.cuda.synchronize()
    assert torch.isfinite(p).all()


def test_checkpoint_roundtrip_from_cuda(tmp_path, corpus: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from psyche.modeling.checkpoint import save_checkpoint

    model = _cuda_model()
    save_checkpoint(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    model.model.eval()
    ids = corpus[:2].cuda()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.model(ids).logits)
