"""The `Torchtitan` architecture (`psyche.modeling.torchtitan`): torchtitan's llama3 and
deepseek_v3 model definitions trained with DisTrO on the CPU. Needs the optional `torchtitan` extra
(`./scripts/setup.sh --extra torchtitan`, plus triton on a CPU-only torch): skips, saying so,
without it.

* two clients of a Torchtitan run (llama3 or deepseek_v3 with MoE; seed 1337, each its own
  batch) train a step, exchange their
  payloads and apply both: their parameters are the same bits, and their DisTrO variables are
  torchtitan's parameter names;
* a Torchtitan model loads a Hugging Face Llama checkpoint (torchtitan's state-dict adapter)
  and computes the Hugging Face model's logits; its state dict converts back to the checkpoint's
  names and tensors;
* a config torchtitan's llama3 cannot take is one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import ConstantLR, LearningRateSchedule
from psyche.modeling import torchtitan
from psyche.modeling.causal_lm import CausalLM, ModelLoadError, ModelOptions
from psyche.modeling.configs import deepseek_config_dict, llama_config_dict
from psyche.modeling.trainer import Batch, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_trainer import distro, make_trainer

WHY_NOT = torchtitan.available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def batch(seed: int) -> Batch:
    return Batch(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(seed)))


def torchtitan_trainer(model_type: str) -> Trainer:
    if model_type == "llama":
        return make_trainer(architecture="Torchtitan")
    options = ModelOptions(architecture="Torchtitan", device="cpu", seed=1337)
    model = CausalLM.from_config(deepseek_config_dict(), options)
    schedule = LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0))
    return Trainer(model, schedule, distro(), micro_batch_size=2)


@pytest.mark.parametrize(
    ("model_type", "names"),
    [
        ("llama", ["layers.0.attention.qkv_linear.wq.weight", "tok_embeddings.weight"]),
        (
            "deepseek_v3",
            ["layers.0.attention.wkv_a.weight", "layers.1.moe.routed_experts.inner_experts.w1_EFD"],
        ),
    ],
)
def test_two_torchtitan_clients_apply_bit_identical_results(
    model_type: str, names: list[str]
) -> None:
    """torchtitan's llama3, and its deepseek_v3 (MLA attention, a dense layer, an MoE layer of
    grouped experts, shared experts and a router)."""
    a, b = torchtitan_trainer(model_type), torchtitan_trainer(model_type)
    variables = [n for n, _ in a.model.variables()]
    assert set(names) <= set(variables)
    assert variables == sorted(variables)
    kwargs = dict(warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[])
    losses = []
    for step in (1, 2, 3):
        out_a = a.train_exact(step, batch(2 * step), **kwargs)
        out_b = b.train_exact(step, batch(2 * step + 1), **kwargs)
        losses.append(out_a.loss)
        sent_a = a.prepare_result(out_a, step=step, batch_id=BatchId(step, step))
        sent_b = b.prepare_result(out_b, step=step, batch_id=BatchId(step + 100, step + 100))
        assert sent_a.payload.to_bytes() != sent_b.payload.to_bytes()  # different batches
        for trainer in (a, b):
            trainer.optimize(step, distro_results=[sent_a.sent, sent_b.sent])
        for (name, pa), (_, pb) in zip(a.model.variables(), b.model.variables()):
            assert torch.equal(pa.view(torch.uint8), pb.view(torch.uint8)), name
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_torchtitan_model_loads_and_writes_hugging_face_checkpoints(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    config = llama_config_dict("tiny")
    hf = CausalLM.from_config(config, ModelOptions(architecture="HfLlama", device="cpu", seed=7))
    save_file({k: v.contiguous() for k, v in hf.extract().items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    titan = CausalLM.from_pretrained(
        tmp_path, ModelOptions(architecture="Torchtitan", device="cpu")
    )
    tokens = batch(0).input_ids
    with torch.no_grad():
        hf_logits, hf_loss = hf.forward(tokens, labels=tokens)
        titan_logits, titan_loss = titan.forward(tokens, labels=tokens)
    torch.testing.assert_close(titan_logits, hf_logits, rtol=1e-5, atol=1e-5)
    assert titan_loss is not None
    assert hf_loss is not None
    assert float(titan_loss) == pytest.approx(float(hf_loss), rel=1e-5)
    back = torchtitan.to_hf(titan.model, titan.extract())
    expected = hf.extract()
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def test_configs_torchtitan_cannot_take_are_one_line() -> None:
    options = ModelOptions(architecture="Torchtitan", device="cpu")
    with pytest.raises(ModelLoadError, match="not 'mistral'"):
        CausalLM.from_config(llama_config_dict("tiny", model_type="mistral"), options)
    scaled = llama_config_dict("tiny", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ModelLoadError, match="RoPE scaling 'linear' is not built"):
        CausalLM.from_config(scaled, options)
