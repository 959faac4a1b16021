"""The `Torchtitan` architecture (`psyche.modeling.torchtitan`): torchtitan's llama3 and
deepseek_v3 model definitions trained with DisTrO on the CPU. Needs the `torchtitan` extra, which
`./scripts/setup.sh` installs (with triton, which torchtitan imports): skips, saying so, where it
cannot be installed (triton has no wheel for macOS or Windows).

* two clients of a Torchtitan run (llama3 or deepseek_v3 with MoE; seed 1337, each its own
  batch) train a step, exchange their
  payloads and apply both: their parameters are the same bits, and their DisTrO variables are
  torchtitan's parameter names;
* a Torchtitan model loads a Hugging Face Llama checkpoint (torchtitan's state-dict adapter)
  and computes the Hugging Face model's logits; what it extracts (checkpoints, P2P sharing) is the
  checkpoint's names and tensors;
* a Torchtitan model's cooldown checkpoint (bf16, `save_checkpoint` of what it extracts) is a
  Hugging Face checkpoint: transformers loads it with no tensor missing or left over and computes
  the Torchtitan model's logits (llama, whose tensors are the same bits, and deepseek_v3 with
  MoE, whose per-expert tensors transformers fuses as it loads), and a joiner of the run rebuilds the Torchtitan model from
  it (`build_from_parameters`) with the same parameter bits;
* two clients of a DiLoCo run on a Torchtitan model (llama3 and deepseek_v3, whose grouped
  experts are 3-D, with sparse or dense payloads) keep the same parameter bits;
* a config torchtitan's llama3 cannot take is one line (TP with FSDP is
  tests/modeling/test_torchtitan_2d.py's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import ConstantLR, LearningRateSchedule, OptimizerDefinition
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


def torchtitan_trainer(model_type: str, optimizer: OptimizerDefinition | None = None) -> Trainer:
    if model_type == "llama" and optimizer is None:
        return make_trainer(architecture="Torchtitan")
    config = llama_config_dict("tiny") if model_type == "llama" else deepseek_config_dict()
    options = ModelOptions(architecture="Torchtitan", device="cpu", seed=1337)
    model = CausalLM.from_config(config, options)
    schedule = LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0))
    return Trainer(model, schedule, optimizer or distro(), micro_batch_size=2)


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
    back = titan.extract()
    expected = hf.extract()
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_a_torchtitan_cooldown_checkpoint_is_a_hugging_face_checkpoint(
    tmp_path: Path, model_type: str
) -> None:
    from transformers import AutoModelForCausalLM

    from psyche.client.setup.model_loading import build_from_parameters
    from psyche.modeling.checkpoint import save_checkpoint

    trainer = torchtitan_trainer(model_type)
    out = trainer.train_exact(
        1, batch(1), prev_self_distro_results=[], warmup_lr_between=None, zero_optim=False
    )
    sent = trainer.prepare_result(out, step=1, batch_id=BatchId(1, 1))
    trainer.optimize(1, distro_results=[sent.sent])  # trained weights, not the init's
    titan = trainer.model
    titan.truncate_bf16()
    save_checkpoint(titan, tmp_path, dtype=torch.bfloat16)
    hf, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    written = titan.extract(torch.bfloat16)
    if model_type == "llama":  # the same names (transformers fuses deepseek's experts on load)
        for name, tensor in hf.state_dict().items():
            assert torch.equal(tensor, written[name].float()), name
    tokens = batch(5).input_ids
    with torch.no_grad():
        expected = titan.forward(tokens)[0]
        got = hf(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    config_json = (tmp_path / "config.json").read_text()
    joined = build_from_parameters(config_json, "", written, "Torchtitan", torch.device("cpu"))
    mine = dict(titan.variables())
    for name, p in joined.model.variables():
        assert torch.equal(p, mine[name]), name


@pytest.mark.parametrize(
    ("model_type", "transmission"),
    [("llama", "Sparse"), ("llama", "Bf16"), ("deepseek_v3", "Sparse"), ("deepseek_v3", "Bf16")],
)
def test_two_torchtitan_clients_of_a_diloco_run_apply_bit_identical_results(
    model_type: str, transmission: str
) -> None:
    """DiLoCo (two inner steps a round; sparse DCT or dense bf16 payloads) on torchtitan's
    parameters: two clients, each its own batch, exchange payloads for three rounds (a round's
    results applied at the next, as clients do) and keep the same parameter bits, which moved.
    (deepseek_v3's grouped experts are 3-D parameters: the sparse form blocks their last two
    dimensions, as DisTrO does.)"""
    from psyche.core.definitions import DilocoTransmission
    from psyche.modeling.diloco import DilocoSettings

    settings = DilocoSettings(
        transmission=DilocoTransmission[transmission],
        inner_steps=2,
        compression_chunk=16,
        compression_topk=8,
    )
    definition = OptimizerDefinition.DiLoCo(settings.definition())
    a, b = (torchtitan_trainer(model_type, definition) for _ in range(2))
    start = {n: p.detach().clone() for n, p in a.model.variables()}
    pending = None
    for step in range(1, 4):
        sent = []
        for i, trainer in enumerate((a, b)):
            out = trainer.train_exact(
                step,
                batch(step * 10 + i),
                prev_self_distro_results=[],
                warmup_lr_between=None,
                zero_optim=False,
            )
            assert torch.isfinite(torch.tensor(out.loss))
            sent.append(trainer.prepare_result(out, step=step, batch_id=BatchId(i, i)).payload)
        if pending is not None:
            for trainer in (a, b):
                results = [trainer.results_from_payload(p) for p in pending]
                trainer.optimize(step, distro_results=results)
        pending = sent
    for (name, pa), (_, pb) in zip(a.model.variables(), b.model.variables()):
        assert torch.equal(pa.view(torch.uint8), pb.view(torch.uint8)), name
    moved = {n for n, p in a.model.variables() if not torch.equal(p, start[n])}
    assert moved
    if model_type == "deepseek_v3":  # the grouped experts too (3-D)
        assert {n for n, p in a.model.variables() if p.dim() == 3} <= moved


def test_configs_torchtitan_cannot_take_are_one_line() -> None:
    options = ModelOptions(architecture="Torchtitan", device="cpu")
    with pytest.raises(ModelLoadError, match="not 'mistral'"):
        CausalLM.from_config(llama_config_dict("tiny", model_type="mistral"), options)
    scaled = llama_config_dict("tiny", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ModelLoadError, match="RoPE scaling 'linear' is not built"):
        CausalLM.from_config(scaled, options)
