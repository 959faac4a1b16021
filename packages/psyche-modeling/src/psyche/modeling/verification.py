"""A verifier's recompute of a trainer's result, and its comparison with what the trainer
published (the book's third duty: "recompute and compare training results").

What a verifier passes (`verify_result`):

* `trainer`: its own `Trainer` of the run (same model config, optimizer settings, micro-batch
  size and parallelism rules as every client's), its model holding the weights the round's
  trainers trained from (the run's weights of that round, before any lookahead: every client
  holds the same bits). Nothing of it changes: the weights are put back bit for bit, the
  gradients are zeroed, its DisTrO momentum, DiLoCo residual and inner AdamW state are not read
  or written.
* `batch`: the rows the trainer was assigned (`Batch`, as the data provider gives them).
* `published`: the trainer's result as every client received it, decoded and checked
  (`Trainer.results_from_payload(payload)`: one `DistroResult` per parameter).
* `decoy`: another batch of the same round that the trainer was not assigned (the verifier's
  own, another verified trainer's), or its `recompute` (shared by a round's verifications).
* `step`: the round's step (the learning rate's), `warmup_lr_between` as the trainer got it.
* `settings`: the thresholds (`verification_settings(trainer)` picks the run optimizer's).

What is exact, what is statistical:

* **Exact: the recompute** (`recompute`). The round's own contribution to the trainer's
  update is a pure function of the weights, the batch and the run's settings, and the
  verifier computes it with the trainer's own code (`Trainer.accumulate_gradients`,
  `Trainer.inner_steps`): DisTrO's `lr x` clipped gradient of the batch; DiLoCo's
  pseudo-gradient of the round's inner steps from a fresh inner AdamW. Two verifiers with the
  same device kind and dtype get the same bits (tested), and so does a verifier whose data or
  fully-sharded parallelism differs on the CPU (the ranks' gradients are reduced exactly as
  one rank's: tests/modeling/test_parallel_ranks.py).
* **Statistical: the comparison.** A trainer's payload is not a function of that alone.
  DisTrO sends the top-k DCT coefficients (1-bit signs) of its momentum, `decay x (momentum -
  what it sent last round) + lr x gradient`, whose residual is the trainer's own history, and
  its gradient was taken at the weights minus its own lookahead (`sign(momentum) x prev_lr`);
  DiLoCo's payload carries the trainer's error-feedback residual, its inner AdamW state from
  earlier rounds and its lookahead. None of these is published, so no verifier can rebuild the
  payload's bits. What it can test is whether the payload carries this batch's own gradient:
  the self-normalized agreement `t` (`screening.agreement`, the witness's statistic) of the
  payload's values, at the payload's own positions (DCT coefficients for DisTrO and sparse
  DiLoCo), with the difference of the recomputed updates of the batch and of a decoy batch of
  the same round. What all batches' gradients share cancels in that difference (a result
  trained on other data carries it too: its plain agreement with the batch's gradient is half
  an honest one's), so a result that does not carry this batch (other data, random or flipped
  signs, a fixed direction) has `t` about N(0, 4^2) or below; an honest one is well above.
  DiLoCo's dense forms add a norm check (within `max_norm_ratio` of the recompute's) and the
  cosine of the two updates (printed, and what `score` is for DiLoCo), which is much tighter
  than DisTrO's (the pseudo-gradient is mostly this round's; docs/reliability.md, "Verifiers").

Evidence over rounds (`Evidence`): a verifier keeps one per trainer and adds every verdict; the
sum of the `t`s over `n` rounds divided by `sqrt(n)` is compared with `min_window_agreement`,
so a persistent small lie that no single round shows is caught when it repeats (see the figures
in docs/reliability.md for what is and is not caught).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from psyche.core.definitions import DilocoTransmission
from psyche.modeling.adamw import LibtorchAdamW
from psyche.modeling.diloco.codec import encode
from psyche.modeling.diloco.optimizer import Diloco
from psyche.modeling.distro import Distro, DistroResult
from psyche.modeling.screening import ResultReader, _at, agreement
from psyche.modeling.sharding import full_tensor
from psyche.modeling.trainer import Batch, Trainer, TrainerError


@dataclass(frozen=True)
class VerificationSettings:
    """Thresholds of a verifier's comparison (calibrated on honest recomputations: the module
    docstring and docs/reliability.md, "Verifiers")."""

    min_agreement: float
    """A round's result is refused when its agreement `t` is below this."""
    min_cosine: float = -1.0
    """DiLoCo: refused when the cosine of the payload with the recompute is below this."""
    max_norm_ratio: float = 0.0
    """DiLoCo: refused when the payload's norm is not within this factor of the recompute's
    either way (0: no norm check; 1-bit DisTrO has no magnitude)."""
    min_window_agreement: float = 0.0
    """`Evidence`: a trainer is caught when the sum of its last `window_rounds` `t`s over
    `sqrt(n)` is below this (0: off)."""
    window_rounds: int = 3


DISTRO_VERIFICATION = VerificationSettings(min_agreement=3.0)
DILOCO_VERIFICATION = VerificationSettings(min_agreement=3.0, min_cosine=0.3, max_norm_ratio=2.0)


def verification_settings(trainer: Trainer) -> VerificationSettings:
    """The thresholds for the run's optimizer."""
    if trainer.diloco is not None:
        return DILOCO_VERIFICATION
    return DISTRO_VERIFICATION


@dataclass(frozen=True)
class VerificationVerdict:
    """What a verifier found of one trainer's result of one round."""

    matches: bool
    """Whether the result is what the trainer's batch gives (within the thresholds)."""
    score: float
    """The statistic of the check that decided (the failed one, or the agreement `t`)."""
    threshold: float
    """The threshold that `score` was held against."""
    check: str | None
    """The check that failed ("agreement", "cosine", "norm", "zero"); None when it matches."""
    detail: str
    """In words, for logs and the status page."""
    agreement: float = 0.0
    """The agreement `t` (every verdict has one: `Evidence` sums them)."""
    cosine: float | None = None
    """DiLoCo: the cosine of the payload with the recompute at the payload's positions."""


@dataclass(frozen=True)
class Recomputed:
    """The round's own contribution to a trainer's update, as the verifier recomputed it: one
    float32 tensor per parameter (whole tensors, in DisTrO's variable order). DisTrO: `lr x`
    the clipped gradient; DiLoCo: the pseudo-gradient (weights before minus after the inner
    steps, from a fresh inner AdamW)."""

    update: list[torch.Tensor]
    loss: float


def recompute(
    trainer: Trainer,
    batch: Batch,
    *,
    step: int,
    warmup_lr_between: tuple[int, int] | None = None,
) -> Recomputed:
    """The exact part of a verification (see the module docstring); `trainer` is left as it
    was (weights bit for bit, gradients zero, optimizer state untouched). Every rank of a
    several-rank verifier calls it (collectives inside)."""
    lr = trainer.get_lr(step, warmup_lr_between)
    optimizer = _optimizer(trainer)
    params = [p for _, p in optimizer.variables]
    if trainer.diloco is not None:
        return _recompute_diloco(trainer, batch, lr, params)
    loss, _ = trainer.accumulate_gradients(batch)
    try:
        if trainer.clip_grad_norm is not None and trainer.clip_grad_norm > 0.0:
            trainer.model.clip_grad_norm(trainer.clip_grad_norm)
        update = []
        with torch.no_grad():
            for p in params:
                grad = full_tensor(p.grad) if p.grad is not None else torch.zeros_like(p)
                update.append(grad.to(torch.float32) * lr)
    finally:
        _zero_grads(params)
    return Recomputed(update, loss)


def _optimizer(trainer: Trainer) -> Distro | Diloco:
    optimizer = trainer.distro or trainer.diloco
    if optimizer is None:
        raise TrainerError("the run's optimizer sends no results to verify")
    return optimizer


def _zero_grads(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.zero_()


def _recompute_diloco(
    trainer: Trainer, batch: Batch, lr: float, params: list[torch.Tensor]
) -> Recomputed:
    diloco, own = trainer.diloco, trainer.adamw
    assert diloco is not None and own is not None
    saved = [p.detach().clone() for p in params]
    fresh = LibtorchAdamW(params, (own.beta1, own.beta2), own.weight_decay, own.eps)
    try:
        losses = trainer.inner_steps(batch, fresh, lr)
        assert losses is not None
        with torch.no_grad():
            update = [
                full_tensor(s).to(torch.float32) - full_tensor(p.detach()).to(torch.float32)
                for s, p in zip(saved, params)
            ]
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        _zero_grads(params)
    return Recomputed(update, sum(losses) / len(losses))


def recomputed_domain(trainer: Trainer, recomputed: Recomputed) -> list[torch.Tensor]:
    """The recompute in the payloads' domain, flat float32 on the host, one per parameter:
    DisTrO's DCT coefficients, DiLoCo's sparse form's, the values for its dense forms."""
    update = recomputed.update
    out: list[torch.Tensor] = []
    if trainer.diloco is not None:
        for x, layout in zip(update, trainer.diloco.layouts()):
            domain: list[torch.Tensor] = []
            encode(x, layout, domain)
            out.append(domain[0])
    else:
        distro = trainer.distro
        assert distro is not None
        for x, (_, p) in zip(update, distro.variables):
            out.append(distro.transform.encode(x.to(p.dtype)))
    return [t.detach().reshape(-1).to("cpu", torch.float32) for t in out]


def compare(
    reader: ResultReader,
    domain: Sequence[torch.Tensor],
    decoy: Sequence[torch.Tensor],
    published: Sequence[DistroResult],
    settings: VerificationSettings,
) -> VerificationVerdict:
    """The statistical part: `published` against the recompute of its batch and of the decoy
    batch, both in the payloads' domain (`recomputed_domain`); checks in order zero, norm
    (DiLoCo), agreement along the difference, cosine with the recompute (DiLoCo)."""
    flat = reader.flat(published)
    t = agreement(
        (_at(d, positions).sub_(_at(e, positions)), values)
        for d, e, (positions, values) in zip(domain, decoy, flat.parts)
    )
    cosine = None
    norm = float(torch.linalg.vector_norm(flat.values))
    if reader.layouts is not None:
        at = torch.cat([_at(d, positions) for d, (positions, _) in zip(domain, flat.parts)])
        reference = float(torch.linalg.vector_norm(at))
        whole = math.sqrt(sum(float(torch.dot(d, d)) for d in domain))
        cosine = float(torch.dot(at, flat.values)) / (reference * norm) if reference * norm else 0.0
        if norm == 0.0:
            return _refused("zero", 0.0, 0.0, "the update is zero", t, cosine)
        if settings.max_norm_ratio > 0.0 and whole > 0.0:
            dense = all(lay.transmission is not DilocoTransmission.Sparse for lay in reader.layouts)
            expected = whole if dense else reference
            ratio = norm / expected
            bound = settings.max_norm_ratio
            if not 1.0 / bound <= ratio <= bound:
                return _refused(
                    "norm",
                    ratio,
                    bound,
                    f"norm {norm:.4g} is {ratio:.3g}x the recompute's ({expected:.4g}); at most "
                    f"{bound:g}x either way",
                    t,
                    cosine,
                )
    if t < settings.min_agreement:
        return _refused(
            "agreement",
            t,
            settings.min_agreement,
            f"agreement with the recomputed update t = {t:.2f}, below {settings.min_agreement:g}",
            t,
            cosine,
        )
    if cosine is not None and cosine < settings.min_cosine:
        return _refused(
            "cosine",
            cosine,
            settings.min_cosine,
            f"cosine with the recomputed update {cosine:.3f}, below {settings.min_cosine:g}",
            t,
            cosine,
        )
    words = f"agreement t = {t:.2f}" + ("" if cosine is None else f", cosine {cosine:.3f}")
    score, threshold = (
        (t, settings.min_agreement) if cosine is None else (cosine, settings.min_cosine)
    )
    return VerificationVerdict(True, score, threshold, None, words, t, cosine)


def _refused(
    check: str, score: float, threshold: float, detail: str, t: float, cosine: float | None
) -> VerificationVerdict:
    return VerificationVerdict(False, score, threshold, check, detail, t, cosine)


def verify_result(
    trainer: Trainer,
    batch: Batch,
    published: Sequence[DistroResult],
    *,
    step: int,
    decoy: Batch | Recomputed,
    warmup_lr_between: tuple[int, int] | None = None,
    settings: VerificationSettings | None = None,
) -> VerificationVerdict:
    """Recompute a trainer's update of `batch` from the round's weights held by `trainer` and
    compare it with `published` (see the module docstring for what each argument must be, what
    is exact and what is statistical).

    `decoy` is another batch of the same round that this trainer was not assigned (the
    verifier's own, or another verified trainer's), or its `recompute`: the comparison reads
    the payload along the difference of the two updates, so that what every batch's gradient
    shares (which a result trained on other data carries too) cancels, and only what is this
    batch's own counts. A verifier checking several trainers of a round recomputes each batch
    once and passes the `Recomputed` of one as the others' decoy.

    Costs one training step of `batch` (DiLoCo: its inner steps; plus one for a `Batch` decoy)
    and a DCT of the update; `trainer` is left as it was."""
    settings = settings or verification_settings(trainer)
    reader = ResultReader.of(_optimizer(trainer))
    own = recompute(trainer, batch, step=step, warmup_lr_between=warmup_lr_between)
    if isinstance(decoy, Batch):
        decoy = recompute(trainer, decoy, step=step, warmup_lr_between=warmup_lr_between)
    return compare(
        reader,
        recomputed_domain(trainer, own),
        recomputed_domain(trainer, decoy),
        published,
        settings,
    )


@dataclass
class Evidence:
    """A verifier's memory of one trainer's verdicts: a lie too small for one round is caught
    when it repeats (`add` returns a refusing verdict once the window's agreement is too low)."""

    settings: VerificationSettings
    agreements: list[float] = field(default_factory=list)

    def add(self, verdict: VerificationVerdict) -> VerificationVerdict:
        """Remember `verdict`; returns it, or a refusal ("window") when the trainer's last
        `window_rounds` agreements sum to less than `min_window_agreement x sqrt(n)`."""
        self.agreements.append(verdict.agreement)
        del self.agreements[: -self.settings.window_rounds]
        if not verdict.matches or self.settings.min_window_agreement <= 0.0:
            return verdict
        n = len(self.agreements)
        z = sum(self.agreements) / math.sqrt(n)
        if n >= self.settings.window_rounds and z < self.settings.min_window_agreement:
            return _refused(
                "window",
                z,
                self.settings.min_window_agreement,
                f"agreement over the last {n} rounds sums to {z:.2f} x sqrt({n}), below "
                f"{self.settings.min_window_agreement:g}",
                verdict.agreement,
                verdict.cosine,
            )
        return verdict
