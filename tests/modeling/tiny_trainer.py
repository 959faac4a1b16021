"""A `Trainer` on the tiny Llama with the DisTrO settings the client and trainer tests share (and
`diloco_trainer`, the DiLoCo one the client's DiLoCo tests share), and the constant learning rate
and AdamW settings the trainer tests build theirs from."""

from __future__ import annotations

from psyche.core.definitions import (
    AdamW,
    ConstantLR,
    DilocoTransmission,
    Distro,
    LearningRateSchedule,
    OptimizerDefinition,
)
from psyche.modeling.causal_lm import CausalLM, ModelOptions
from psyche.modeling.configs import deepseek_config_dict, llama_config_dict
from psyche.modeling.diloco import DilocoSettings
from psyche.modeling.trainer import Trainer


def constant(lr: float) -> LearningRateSchedule:
    return LearningRateSchedule.Constant(ConstantLR(base_lr=lr, warmup_init_lr=0.0, warmup_steps=0))


def adamw_def() -> OptimizerDefinition:
    return OptimizerDefinition.AdamW(
        AdamW(betas=[0.9, 0.95], weight_decay=0.0, eps=1e-8, clip_grad_norm=1.0)
    )


def distro(
    weight_decay: float = 0.0, quantize: bool = True, chunk: int = 16
) -> OptimizerDefinition:
    return OptimizerDefinition.Distro(
        Distro(
            clip_grad_norm=1.0,
            weight_decay=weight_decay,
            compression_decay=0.999,
            compression_topk=4,
            compression_chunk=chunk,
            quantize_1bit=quantize,
        )
    )


def make_trainer(
    weight_decay: float = 0.0,
    quantize: bool = True,
    device: str = "cpu",
    chunk: int = 16,
    lr: float = 1e-3,
    architecture: str = "HfLlama",
) -> Trainer:
    """Seed 1337, like every client's random init; bf16 on CUDA, as clients run there. The
    tiny Llama, or with `architecture="HfDeepseek"` the tiny DeepSeek-V3."""
    dtype = "bf16" if device == "cuda" else None
    config = deepseek_config_dict() if architecture == "HfDeepseek" else llama_config_dict("tiny")
    model = CausalLM.from_config(
        config, ModelOptions(architecture=architecture, device=device, dtype=dtype, seed=1337)
    )
    return Trainer(model, constant(lr), distro(weight_decay, quantize, chunk), micro_batch_size=2)


DILOCO_INNER_STEPS = 2


def diloco_trainer() -> Trainer:
    """The tiny Llama under DiLoCo: an outer step every `DILOCO_INNER_STEPS` steps, its sparse
    pseudo-gradients of 2-bit values."""
    settings = DilocoSettings(
        inner_steps=DILOCO_INNER_STEPS,
        transmission=DilocoTransmission.Sparse,
        value_bits=2,
        compression_chunk=16,
        compression_topk=8,
    )
    model = CausalLM.from_config(
        llama_config_dict("tiny"),
        ModelOptions(architecture="HfLlama", device="cpu", seed=1337),
    )
    return Trainer(
        model, constant(3e-3), OptimizerDefinition.DiLoCo(settings.definition()), micro_batch_size=2
    )
