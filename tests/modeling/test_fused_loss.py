"""The fused linear + cross-entropy option (`psyche.modeling.fused_loss`, `ModelOptions.fused_loss`):

* the chunked loss (torch, no [tokens x vocab] tensor held) is the model's own loss bit for bit on
  the CPU, whatever the chunk size; its gradients are the model's to rounding (the lm_head weight's
  is a sum over chunks, which rounds differently in the last bits);
* on the CPU every choice takes the model's own loss (the fallback): a trainer's payload bytes
  with the option on are those with it off; forcing the chunked loss there would change them
  (checked, so the comparison can fail);
* the option's choices resolve as documented; a bad one or a missing Liger says so in one line;
* on CUDA (`gpu`): the chunked loss, and Liger's when installed, train the tiny model's bf16 step
  to the model's loss and gradients within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from psyche.core.batch_id import BatchId
from psyche.modeling import fused_loss
from psyche.modeling.causal_lm import CausalLM, ModelLoadError, ModelOptions
from psyche.modeling.configs import llama_config_dict
from psyche.modeling.trainer import Batch

from .tiny_trainer import make_trainer

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def tokens(rows: int = 4, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (rows, 16), generator=torch.Generator().manual_seed(seed))


def grads(model: CausalLM) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.variables() if p.grad is not None}
    model.model.zero_grad()
    return out


@pytest.mark.parametrize("chunk_rows", [1, 7, 16, 64])
def test_the_chunked_loss_is_the_model_loss_bit_for_bit_on_the_cpu(chunk_rows: int) -> None:
    model = make_trainer().model
    ids = tokens()
    ids[1, 5:] = -100  # ignored labels (the loss of a padded row) count as the model counts them
    labels = ids.clone()
    ids = ids.clamp(min=0)
    _, loss = model.forward(ids, labels=labels)
    assert loss is not None
    loss.backward()
    expected = grads(model)
    inner = model.model
    hidden = inner.model(ids).last_hidden_state  # type: ignore[operator]
    weight = inner.get_output_embeddings().weight  # type: ignore[operator]
    fused = fused_loss.chunked_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, fused_loss.shifted_labels(labels), chunk_rows
    )
    assert torch.equal(fused.detach(), loss.detach())
    fused.backward()
    for name, g in grads(model).items():
        torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-7)


def payload(choice: str) -> bytes:
    trainer = make_trainer(quantize=False)
    trainer.model.fused_loss = choice
    batch = Batch(tokens())
    kwargs = dict(warmup_lr_between=None, zero_optim=False)
    out = trainer.train_exact(1, batch, prev_self_distro_results=[], **kwargs)
    return trainer.prepare_result(out, step=1, batch_id=BatchId(1, 1)).payload.to_bytes()


def test_on_the_cpu_the_option_leaves_the_payload_bits_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fused_loss, "CHUNK_ROWS", 8)  # several chunks per micro-batch
    today = payload("off")
    for choice in ("auto", "chunked", "liger"):
        assert payload(choice) == today, choice
    # what the fallback guards against: the chunked loss on the CPU moves the lm_head's bits
    monkeypatch.setattr(fused_loss, "resolve", lambda choice, device: "chunked")
    assert payload("chunked") != today


def test_the_choices_resolve_as_documented() -> None:
    for choice in fused_loss.FUSED_LOSS_CHOICES:
        assert fused_loss.resolve(choice, CPU) == "model"
    assert fused_loss.resolve("off", CUDA) == "model"
    assert fused_loss.resolve("chunked", CUDA) == "chunked"
    expected = "liger" if fused_loss.liger_available() else "chunked"
    assert fused_loss.resolve("auto", CUDA) == expected
    if not fused_loss.liger_available():
        with pytest.raises(fused_loss.FusedLossError, match="needs the liger-kernel package"):
            fused_loss.resolve("liger", CUDA)
    with pytest.raises(ModelLoadError, match="fused loss 'fast': expected one of off, auto"):
        CausalLM.from_config(
            llama_config_dict("tiny"), ModelOptions("HfLlama", device="cpu", fused_loss="fast")
        )
    built = CausalLM.from_config(
        llama_config_dict("tiny"), ModelOptions("HfLlama", device="cpu", fused_loss="auto")
    )
    assert built.fused_loss == "auto"
    logits, _ = built.forward(tokens(), labels=tokens())
    assert logits.shape == (4, 16, 256)  # the CPU's fallback: the model's own forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("choice", ["chunked", "auto"])
def test_the_fused_loss_trains_the_cuda_step_as_the_model_loss(choice: str) -> None:
    trainer = make_trainer(device="cuda")
    model = trainer.model
    ids = tokens().to("cuda")
    _, loss = model.forward(ids, labels=ids)
    assert loss is not None
    loss.backward()
    expected = grads(model)
    model.fused_loss = choice
    logits, fused = model.forward(ids, labels=ids)
    assert logits.numel() == 0  # no logits made
    assert fused is not None
    torch.testing.assert_close(fused.float(), loss.float(), rtol=2e-2, atol=2e-2)
    fused.backward()
    for name, g in grads(model).items():
        torch.testing.assert_close(g.float(), expected[name].float(), rtol=5e-2, atol=5e-3)
