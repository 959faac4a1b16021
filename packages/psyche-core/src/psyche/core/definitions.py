"""Learning-rate schedules and optimizer definitions, as configured in a run's `[model.LLM]`.

LR formulas are upstream's, in f64, including its lack of a clamp past `total_steps` for the cosine
schedule: every client must compute the same LR for a step, so the quirks are kept.
Steps are `u32`; differences of steps use Rust's (release-build) wrapping arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Self

from psyche.core.numeric import f64_div, wrapping_u32
from psyche.core.serde import F32, F64, U8, U16, U32, Array, DataEnum, RustEnum, struct, variant


def _warmup_lr(warmup_init_lr: float, base_lr: float, step: int, warmup_steps: int) -> float:
    return warmup_init_lr + (base_lr - warmup_init_lr) * (step / warmup_steps)


@struct(frozen=True)
class ConstantLR:
    base_lr: F64
    warmup_init_lr: F64
    warmup_steps: U32

    @classmethod
    def new(cls, base_lr: float, warmup_steps: int, warmup_init_lr: float) -> ConstantLR:
        """Upstream's constructor, whose argument order differs from the field order."""
        return cls(base_lr=base_lr, warmup_init_lr=warmup_init_lr, warmup_steps=warmup_steps)

    def get_lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup_lr(self.warmup_init_lr, self.base_lr, step, self.warmup_steps)
        return self.base_lr


@struct(frozen=True)
class _DecayingLR:
    """What the linear and cosine schedules share: a warmup ramp to `base_lr`, then a decay to
    `final_lr` at `total_steps` (the fields in upstream's order, and its constructor)."""

    base_lr: F64
    warmup_init_lr: F64
    final_lr: F64
    warmup_steps: U32
    total_steps: U32

    @classmethod
    def new(
        cls,
        base_lr: float,
        warmup_steps: int,
        warmup_init_lr: float,
        total_steps: int,
        final_lr: float,
    ) -> Self:
        return cls(base_lr, warmup_init_lr, final_lr, warmup_steps, total_steps)


@struct(frozen=True)
class LinearLR(_DecayingLR):
    def get_lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup_lr(self.warmup_init_lr, self.base_lr, step, self.warmup_steps)
        if step < self.total_steps:
            progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
            return self.base_lr + (self.final_lr - self.base_lr) * progress
        return self.final_lr


@struct(frozen=True)
class CosineLR(_DecayingLR):
    def get_lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup_lr(self.warmup_init_lr, self.base_lr, step, self.warmup_steps)
        # Upstream quirk kept: no clamp past total_steps (the cosine rises again), and
        # total == warmup divides by zero (NaN/inf, no error).
        progress = f64_div(
            float(step - self.warmup_steps),
            float(wrapping_u32(self.total_steps - self.warmup_steps)),
        )
        cosine_decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.final_lr + (self.base_lr - self.final_lr) * cosine_decay


@struct(frozen=True)
class WarmupStableDecayLR:
    base_lr: F64
    warmup_init_lr: F64
    cosine_decay_final_lr: F64
    linear_decay_final_lr: F64
    warmup_steps: U32
    stable_steps: U32
    cosine_decay_steps: U32
    linear_decay_steps: U32

    @classmethod
    def new(
        cls,
        base_lr: float,
        warmup_steps: int,
        warmup_init_lr: float,
        stable_steps: int,
        cosine_decay_steps: int,
        cosine_decay_final_lr: float,
        linear_decay_steps: int,
        linear_decay_final_lr: float,
    ) -> WarmupStableDecayLR:
        return cls(
            base_lr=base_lr,
            warmup_init_lr=warmup_init_lr,
            cosine_decay_final_lr=cosine_decay_final_lr,
            linear_decay_final_lr=linear_decay_final_lr,
            warmup_steps=warmup_steps,
            stable_steps=stable_steps,
            cosine_decay_steps=cosine_decay_steps,
            linear_decay_steps=linear_decay_steps,
        )

    def get_lr(self, step: int) -> float:
        # Upstream asserts these on every call (a panic there); here they raise ValueError.
        if not self.cosine_decay_final_lr <= self.base_lr:
            raise ValueError("WarmupStableDecay needs cosine_decay_final_lr <= base_lr")
        if not self.linear_decay_final_lr <= self.cosine_decay_final_lr:
            raise ValueError(
                "WarmupStableDecay needs linear_decay_final_lr <= cosine_decay_final_lr"
            )
        stable_end = wrapping_u32(self.stable_steps + self.warmup_steps)
        cosine_end = wrapping_u32(stable_end + self.cosine_decay_steps)
        linear_end = wrapping_u32(cosine_end + self.linear_decay_steps)
        if step < self.warmup_steps:
            return _warmup_lr(self.warmup_init_lr, self.base_lr, step, self.warmup_steps)
        if step < stable_end:
            return self.base_lr
        if step < cosine_end:
            progress = wrapping_u32(step - stable_end) / self.cosine_decay_steps
            cosine_decay = 0.5 * (1.0 + math.cos(math.pi * progress))
            return (
                self.cosine_decay_final_lr
                + (self.base_lr - self.cosine_decay_final_lr) * cosine_decay
            )
        if step < linear_end:
            progress = wrapping_u32(step - cosine_end) / self.linear_decay_steps
            return (
                self.cosine_decay_final_lr
                - (self.cosine_decay_final_lr - self.linear_decay_final_lr) * progress
            )
        return self.linear_decay_final_lr


class LearningRateSchedule(DataEnum):
    Constant = variant(ConstantLR)
    Linear = variant(LinearLR)
    Cosine = variant(CosineLR)
    WarmupStableDecay = variant(WarmupStableDecayLR)

    def get_lr(self, step: int) -> float:
        return float(self.value.get_lr(step))

    def get_warmup_steps(self) -> int:
        return int(self.value.warmup_steps)

    def get_warmup_init_lr(self) -> float:
        return float(self.value.warmup_init_lr)


@struct(frozen=True)
class AdamW:
    betas: Annotated[list[F32], Array(2)]
    weight_decay: F32
    eps: F32
    clip_grad_norm: F32 | None = None


@struct(frozen=True, kw_only=True)
class Distro:
    clip_grad_norm: F32 | None = None
    weight_decay: F32 | None = None
    compression_decay: F32
    compression_topk: U16
    compression_chunk: U16
    quantize_1bit: bool


class DilocoTransmission(RustEnum):
    """How a DiLoCo client sends its pseudo-gradient (a port extension, see `DiLoCo`)."""

    # Every value rounded to bf16: 2 bytes per parameter.
    Bf16 = 0
    # int8 codes with one f32 scale per group of `compression_chunk**2` values: about 1 byte
    # per parameter.
    Int8 = 1
    # DisTrO's block DCT, top-k per block, `value_bits` bits per kept value and a bf16 scale per
    # block, with an error-feedback residual kept by the sender (SparseLoCo).
    Sparse = 2


# Inner AdamW settings that do not fit the 28 bytes a variant has in the Solana account (see
# `DiLoCo`): the values the DiLoCo papers and Psyche's AdamW configs use.
DILOCO_INNER_BETAS = (0.9, 0.95)
DILOCO_INNER_EPS = 1e-8


@struct(frozen=True, kw_only=True)
class DiLoCo:
    """DiLoCo: `inner_steps` local AdamW steps per round, then an outer step (SGD, Nesterov
    momentum) on the mean pseudo-gradient (weights before minus weights after the inner steps).

    A port extension, not in upstream. The fields are laid out so that the variant takes
    exactly the 28 bytes the Solana account's `OptimizerDefinition` union has (Distro's size),
    so appending it changes no existing byte of the account; for that, the inner AdamW's betas
    and eps are fixed (`DILOCO_INNER_BETAS`, `DILOCO_INNER_EPS`). A clip of 0 means none. The
    inner learning rate is the run's `lr_schedule` at the round's step; the outer one is
    `outer_lr`, times `lr_schedule(step) / lr_schedule`'s peak when `outer_lr_follows_schedule`.
    `peer_clip_multiple` > 0 turns on the bounded aggregate (each accepted pseudo-gradient
    scaled down to at most that multiple of the round's median payload norm before the mean;
    0 = off, upstream's plain mean).
    """

    inner_steps: U16
    transmission: DilocoTransmission
    value_bits: U8
    compression_chunk: U8
    compression_topk: U8
    nesterov: bool
    outer_lr_follows_schedule: bool
    inner_weight_decay: F32
    inner_clip_grad_norm: F32
    outer_lr: F32
    outer_momentum: F32
    outer_clip_grad_norm: F32
    # Appended after the 28 bytes: in TOML and postcard (the centralized protocol), not in borsh
    # or the Solana account, which has no room for it (a Solana run cannot turn it on).
    peer_clip_multiple: F32 = dataclasses.field(default=0.0, metadata={"wire": "postcard"})


# `Distro` by another name, for the class body below, where `Distro` is the variant.
_DistroSettings = Distro


class OptimizerDefinition(DataEnum):
    Dummy = variant()
    AdamW = variant(AdamW)
    Distro = variant(Distro)
    # Port extension, appended so that the existing variants keep their tags.
    DiLoCo = variant(DiLoCo)
    # Port extension (tag 4): DisTrO with the sparse apply route. The same settings and the same
    # 28 bytes as `Distro` (only the tag differs, in postcard, borsh and the Solana account), the
    # same payloads on the wire; every client of the run decodes 1-bit results with the exact
    # integer synthesis from the kept coefficients (`psyche.modeling.dct.SparseSynthesis`)
    # instead of upstream's dense inverse DCT. Its update bits differ from upstream's (a few
    # coordinates in 10^4), which is why it is the run's setting, never a client's: a route
    # mixed within one run would fork the clients' models. Upstream cannot decode the tag.
    DistroSparse = variant(_DistroSettings)

    def distro(self) -> tuple[_DistroSettings, bool] | None:
        """A DisTrO optimizer's settings and whether its run takes the sparse apply route
        (`DistroSparse`); None for any other optimizer."""
        match self:
            case OptimizerDefinition.Distro(value):
                return value, False
            case OptimizerDefinition.DistroSparse(value):
                return value, True
        return None
