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
  update is a pure function of the weights, the rows and the run's settings, and the verifier
  computes it with the trainer's own code (`Trainer.accumulate_gradients`,
  `Trainer.inner_steps`): DisTrO's `lr x` gradient of each half of the batch; DiLoCo's
  pseudo-gradient of the round's inner steps on the batch from a fresh inner AdamW. Two
  verifiers with the same device kind and dtype get the same bits (tested), and so does a
  verifier whose data or fully-sharded parallelism differs, on the CPU (the ranks' gradients
  are reduced exactly as one rank's: tests/modeling/test_parallel_ranks.py). Another intra-op
  thread count may change the last bits; the comparison does not notice.
* **Statistical: the comparison** (`compare`). A trainer's payload is not a function of that
  alone. DisTrO sends the top-k DCT coefficients (1-bit signs) of its momentum, `decay x
  (momentum - what it sent last round) + lr x gradient`, whose residual is the trainer's own
  history, and its gradient was taken at the weights minus its own lookahead
  (`sign(momentum) x prev_lr`); DiLoCo's payload carries the trainer's inner AdamW state from
  earlier rounds, its lookahead and (int8, sparse) its error-feedback residual. None of these
  is published, so no verifier can rebuild the payload's bits (a DiLoCo trainer's first round
  it does: cosine 1.00). What it tests is whether the payload carries this batch's own
  gradient, with the witness's statistic (`screening.agreement`): the self-normalized
  agreement `t` of the payload's values, at the payload's own positions (DCT coefficients for
  DisTrO and sparse DiLoCo), with
  - *agreement*: the difference of the recomputed updates of the batch and of a decoy batch
    of the same round. What all batches' gradients share cancels (a result trained on other
    data carries it too: its plain agreement with the batch's gradient is half an honest
    one's), so a result that does not carry this batch (other data, random or flipped signs,
    a fixed direction, a replay) has `t` about N(0, 4^2) or below; an honest one is well
    above;
  - *balance* (DisTrO): the difference of the batch's two halves' updates. An honest result
    carries both alike; one trained on one half carries one (the whole batch's agreement does
    not show it: a half's gradient is the whole's direction, noisier). Its honest expectation is
    zero only while the halves' gradients are alike in size, which a few rows need not be;
  - *parts* (DisTrO): each half's update less the decoy's, the lesser `t`: an honest result
    carries both halves (well above zero), a lazy one not the half it skipped (about N(0, 3^2)).
  The halves are the micro-batches' (`split_rows`) or, with `order`, a permutation's (`recompute`):
  a permutation hides them from the trainer, but then a trainer that skips half its rows skips
  about as many in each half in most rounds (docs/reliability.md, "Verifiers").
  DiLoCo adds a *norm* check (within `max_norm_ratio` of the recompute's) and *zero*. The
  thresholds (`DISTRO_VERIFICATION`, `DILOCO_VERIFICATION`, `DILOCO_SPARSE_VERIFICATION`) were
  calibrated on honest recomputations (docs/reliability.md, "Verifiers").

Exact, for a verifier that follows the trainer (`Shadow`, `follow`, `verify_exact`): a verifier
that saw a trainer's first round in the run (its own state then zero or fresh) can keep that
state itself, advancing it every round the trainer trains with the trainer's batch and the run's
weights through the trainer's own code (`Trainer.train_exact` with the state swapped in:
`Trainer.swap_own_state`), and so rebuild the payload bit for bit; the payload is compared by its
commitment (`compare_exact`): any bit that differs is a mismatch, the 1 % bias included, from the
round the lie starts. Exact only within one determinism class: the same device kind and dtype
and, on the CPU, the same intra-op thread count (a 20M Llama's gradients differ in the last bits
between 1 and 2 threads; the tiny one's do not: docs/reliability.md, "Verifiers"). A verifier
that did not see the trainer's first round cannot start one (the state is every round's sum, and
none of it is published) and compares statistically.

Evidence over rounds (`Evidence`): a verifier may keep one per trainer and add every verdict;
the sum of the trainer's last `window_rounds` `t`s over `sqrt(n)` is compared with
`min_window_agreement`. It is off in every shipped setting: the lie it would be for (a bias of
1 % of the update's norm in a fixed direction) moves an honest result's `t` less than honest
results vary, and an honest trainer's own momentum is itself a persistent direction
(docs/reliability.md has the measured detection rates).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import DilocoTransmission
from psyche.modeling.adamw import LibtorchAdamW
from psyche.modeling.diloco.codec import encode
from psyche.modeling.diloco.optimizer import Diloco
from psyche.modeling.distro import Distro, DistroResult
from psyche.modeling.screening import ResultReader, _at, agreement
from psyche.modeling.serialized_distro import TransmittableDistroResult
from psyche.modeling.sharding import full_tensor
from psyche.modeling.train_loop import rows
from psyche.modeling.trainer import Batch, CancelToken, OwnState, Trainer, TrainerError


@dataclass(frozen=True)
class VerificationSettings:
    """Thresholds of a verifier's comparison (calibrated on honest recomputations: the module
    docstring and docs/reliability.md, "Verifiers")."""

    min_agreement: float
    """A round's result is refused when its agreement `t` is below this."""
    max_balance: float = 0.0
    """Refused when the agreement along the difference of the batch's two parts is beyond
    this either way (a trainer that trained one part only; 0: no balance check)."""
    min_part_agreement: float = 0.0
    """Refused when the agreement along the difference of either part's update and the decoy's
    is below this (a trainer that skipped that part's rows; 0: no parts check)."""
    max_norm_ratio: float = 0.0
    """DiLoCo: refused when the payload's norm is not within this factor of the recompute's
    either way (0: no norm check; 1-bit DisTrO has no magnitude)."""
    min_window_agreement: float = 0.0
    """`Evidence`: a trainer is caught when the sum of its last `window_rounds` `t`s over
    `sqrt(n)` is below this (0: off)."""
    window_rounds: int = 3


DISTRO_VERIFICATION = VerificationSettings(min_agreement=10.0, min_part_agreement=8.0)
"""DisTrO 1-bit (tiny run, c16 k4, 4 rows a trainer; docs/reliability.md, "Verifiers"): an honest
result's agreement is 16 to 30 (none below 10 in 500 verifications over 125 rounds, nor in 520
with trainers switching roles, 15.7 and up), one trained on other data's about N(0, 4^2). The
parts check (each half's agreement along its update less the decoy's) catches a half-batch
trainer: with trainers switching roles and a verifier on 2 threads, an honest half's was 10.3
and up (median 17.5, 1,040 verifications, two seeds), the half a lazy trainer skipped -6.0 to
7.3 (50 lying rounds, every one refused); 8 is nearer the lazy side, since a lazy round missed
is caught the next and an honest one refused is a ban. No balance check by default: in the
benchmark an honest result's balance was about N(0, 3.6^2) and a half batch's 20 to 28, but a
real run (the e2e test, a trainer's first round after two rounds as a verifier) gave an honest
balance of 17.3, and the tie-breaker convicted it: its honest expectation is zero only while
the halves' gradients are alike in size. `DISTRO_BALANCE_CHECK` keeps it for research."""
DISTRO_BALANCE_CHECK = VerificationSettings(
    min_agreement=10.0, max_balance=15.0, min_part_agreement=8.0
)
"""DisTrO with the half-batch balance check (|t| <= 15) too: not safe for honest members (above)."""
DILOCO_VERIFICATION = VerificationSettings(min_agreement=20.0, max_norm_ratio=64.0)
"""DiLoCo's dense forms: an honest pseudo-gradient's agreement is 40 to 200, another batch's
below 10. No balance check: the inner AdamW weighs a round's first rows more than its last, so
an honest result's balance is itself 10 to 110 and a half batch's overlaps it."""
DILOCO_SPARSE_VERIFICATION = VerificationSettings(min_agreement=-6.0, max_norm_ratio=64.0)
"""DiLoCo's sparse form: an honest result's agreement falls to 2 to 15 after the first rounds
(its error feedback carries earlier rounds), another batch's is about N(0, 4^2); one round
alone refuses only an opposed result."""


def verification_settings(trainer: Trainer) -> VerificationSettings:
    """The thresholds for the run's optimizer."""
    if trainer.diloco is None:
        return DISTRO_VERIFICATION
    if any(lay.transmission is DilocoTransmission.Sparse for lay in trainer.diloco.layouts()):
        return DILOCO_SPARSE_VERIFICATION
    return DILOCO_VERIFICATION


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
    """The check that failed ("zero", "norm", "agreement", "balance", or `Evidence`'s
    "window"); None when it matches."""
    detail: str
    """In words, for logs and the status page."""
    measures: Measures
    """Every statistic of the comparison."""

    @property
    def agreement(self) -> float:
        return self.measures.agreement


@dataclass(frozen=True)
class Recomputed:
    """A batch's update as the verifier recomputed it, one float32 tensor per parameter (whole
    tensors, in DisTrO's variable order) for each part of the batch. DisTrO: two parts, the
    batch's first rows (whole micro-batches, about half; `split_rows`) and the rest, each `lr x`
    the mean gradient of its rows (a batch of one row: one part); DiLoCo: one part, the
    pseudo-gradient of the round's inner steps on the whole batch from the round's weights and
    a fresh inner AdamW."""

    parts: list[list[torch.Tensor]]
    rows: list[int]
    loss: float

    @property
    def update(self) -> list[torch.Tensor]:
        """The whole batch's update: the parts' mean weighted by their rows (a global scale
        and the order of the sums aside, the trainer's own: the statistics ignore both)."""
        total = sum(self.rows)
        out = [x * (self.rows[0] / total) for x in self.parts[0]]
        for part, n in zip(self.parts[1:], self.rows[1:]):
            for acc, x in zip(out, part):
                acc.add_(x * (n / total))
        return out


def split_rows(rows: int, micro_batch_size: int) -> list[int]:
    """How `recompute` parts a batch of `rows`: the first half of its micro-batches (rounded
    up) and the rest; one part for a single micro-batch of one row."""
    if rows < 2:
        return [rows]
    micro = -(-rows // micro_batch_size)
    first = min(rows - 1, micro_batch_size * -(-micro // 2)) if micro > 1 else rows // 2
    return [first, rows - first]


def recompute(
    trainer: Trainer,
    batch: Batch,
    *,
    step: int,
    warmup_lr_between: tuple[int, int] | None = None,
    order: Sequence[int] | None = None,
    cancel: CancelToken | None = None,
) -> Recomputed:
    """The exact part of a verification (see the module docstring): a pure function of the
    weights `trainer` holds, `batch` and the run's settings, computed by the trainer's own code
    (`Trainer.accumulate_gradients`, `Trainer.inner_steps`) on each part of `split_rows`, or
    with `order` (a permutation of the batch's rows, e.g. drawn from the round's seed) on its
    first `ceil(rows / 2)` rows and the rest (gradient accumulation sums over rows: the whole is
    the same sum, up to the float rounding of its order).
    `trainer` is left as it was (weights bit for bit, gradients zero, optimizer state
    untouched). Every rank of a several-rank verifier calls it (collectives inside).
    `cancel` (the round's end) stops it between micro-batches: `RecomputeCancelled`, the trainer
    left as it was."""
    lr = trainer.get_lr(step, warmup_lr_between)
    params = [p for _, p in _optimizer(trainer).variables]
    # DiLoCo: one part (no balance check: see DILOCO_VERIFICATION), the trainer's own rounds
    if order is not None:
        if sorted(order) != list(range(len(batch))):
            raise TrainerError(f"the split order {list(order)} is no permutation of the batch")
        sizes = [len(batch) - len(batch) // 2, len(batch) // 2] if len(batch) > 1 else [1]
    else:
        sizes = split_rows(len(batch), trainer.micro_batch_size)
    if trainer.distro is None:
        sizes = [len(batch)]
    parts, losses = [], []
    start = 0
    for size in sizes:
        if order is not None and len(sizes) > 1:
            part = take_rows(batch, order[start : start + size])
        else:
            part = rows(batch, start, start + size)
        start += size
        if trainer.diloco is not None:
            update, loss = _recompute_diloco(trainer, part, lr, params, cancel)
        else:
            update, loss = _recompute_distro(trainer, part, lr, params, cancel)
        parts.append(update)
        losses.append(loss * size)
    return Recomputed(parts, sizes, sum(losses) / len(batch))


def take_rows(batch: Batch, indices: Sequence[int]) -> Batch:
    """The rows `indices` of `batch`, in that order (every field)."""
    index = torch.tensor(list(indices), dtype=torch.long)

    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index.to(t.device))

    return Batch(
        batch.input_ids.index_select(0, index.to(batch.input_ids.device)),
        part(batch.labels),
        part(batch.position_ids),
    )


class RecomputeCancelled(Exception):
    """A recompute stopped by its `cancel` (the round ended first): it has no result."""


def _recompute_distro(
    trainer: Trainer,
    batch: Batch,
    lr: float,
    params: list[torch.Tensor],
    cancel: CancelToken | None = None,
) -> tuple[list[torch.Tensor], float]:
    try:
        loss, cancelled = trainer.accumulate_gradients(batch, cancel=cancel)
        if cancelled:
            raise RecomputeCancelled
        with torch.no_grad():
            update = [
                full_tensor(p.grad).to(torch.float32) * lr
                if p.grad is not None
                else torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                for p in params
            ]
    finally:
        _zero_grads(params)
    return update, loss


def _optimizer(trainer: Trainer) -> Distro | Diloco:
    optimizer = trainer.distro or trainer.diloco
    if optimizer is None:
        raise TrainerError("the run's optimizer sends no results to verify")
    return optimizer


@dataclass
class SavedWeights:
    """One copy of the weights a round trained from, kept by that round's tie-breaker until it
    knows the round's disputes (`psyche.coordinator.verification`: it recomputes them in the
    next round, when its model holds newer weights). One parameter list, on the parameters'
    own devices and shardings."""

    tensors: list[torch.Tensor]


def _weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p for _, p in _optimizer(trainer).variables]


def save_weights(trainer: Trainer, into: SavedWeights | None = None) -> SavedWeights:
    """A copy of `trainer`'s weights, bit for bit; into `into`'s tensors when they fit (so a
    tie-breaker of consecutive rounds holds one copy, never two)."""
    params = _weights(trainer)
    with torch.no_grad():
        if into is not None and [t.shape for t in into.tensors] == [p.shape for p in params]:
            for saved, p in zip(into.tensors, params, strict=True):
                saved.copy_(p.detach())
            return into
        return SavedWeights([p.detach().clone() for p in params])


def swap_weights(trainer: Trainer, saved: SavedWeights) -> None:
    """Exchange `trainer`'s weights with `saved`, bit for bit, one parameter at a time (the
    memory it takes beyond the copy is the largest parameter's); twice puts both back."""
    params = _weights(trainer)
    if [t.shape for t in saved.tensors] != [p.shape for p in params]:
        raise TrainerError("the saved weights are not this model's")
    with torch.no_grad():
        for p, other in zip(params, saved.tensors, strict=True):
            held = p.detach().clone()
            p.copy_(other)
            other.copy_(held)


def result_reader(trainer: Trainer) -> ResultReader:
    """How the run's payloads read (`compare`'s first argument)."""
    return ResultReader.of(_optimizer(trainer))


def _zero_grads(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.zero_()


def _recompute_diloco(
    trainer: Trainer,
    batch: Batch,
    lr: float,
    params: list[torch.Tensor],
    cancel: CancelToken | None = None,
) -> tuple[list[torch.Tensor], float]:
    own = trainer.adamw
    assert own is not None
    saved = [p.detach().clone() for p in params]
    fresh = LibtorchAdamW(params, (own.beta1, own.beta2), own.weight_decay, own.eps)
    try:
        losses = trainer.inner_steps(batch, fresh, lr, cancel=cancel)
        if losses is None:
            raise RecomputeCancelled
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
    return update, sum(losses) / len(losses)


def recomputed_domain(trainer: Trainer, update: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """An update (one float32 tensor per parameter) in the payloads' domain, flat float32 on
    the host, one per parameter: DisTrO's DCT coefficients, DiLoCo's sparse form's, the values
    for its dense forms."""
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


@dataclass(frozen=True)
class Domain:
    """A `Recomputed` read in the payloads' domain (`domain_of`): each part's update, kept as
    it is (one flat float32 tensor per parameter), and the parts' shares of the batch's rows.
    What the comparison reads of it (`at`) is taken at the payload's positions only: the whole
    update (`shares[0] x first + shares[1] x second`) and the difference of the parts (`first -
    second`) are formed there, never over whole tensors (a payload holds a few entries of each
    DCT block)."""

    parts: list[list[torch.Tensor]]
    shares: tuple[float, float] = (0.5, 0.5)

    @property
    def halved(self) -> bool:
        """Whether the batch has two parts (a one-row batch, or DiLoCo, has one)."""
        return len(self.parts) > 1

    def at(
        self, i: int, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole update and the parts' difference (None: one part) of parameter `i` at
        `positions`, fresh tensors: each part is gathered once, then combined element by element
        (the same bits as combining whole tensors and gathering: the operations are
        elementwise)."""
        if not self.halved:
            return _at(self.parts[0][i], positions), None
        x, y = _at(self.parts[0][i], positions), _at(self.parts[1][i], positions)
        a, b = self.shares
        return x * a + y * b, x - y

    def norm(self) -> float:
        """The whole update's norm (DiLoCo's dense forms: one part)."""
        wholes = (
            self.parts[0]
            if not self.halved
            else [self.at(i, None)[0] for i in range(len(self.parts[0]))]
        )
        return math.sqrt(sum(float(x.dot(x)) for x in wholes))


def domain_of(trainer: Trainer, recomputed: Recomputed) -> Domain:
    """`recomputed` in the payloads' domain, each part transformed once (the whole update is
    the parts' weighted mean there too: the transforms are linear)."""
    parts = [recomputed_domain(trainer, part) for part in recomputed.parts]
    if len(parts) < 2:
        return Domain(parts, (1.0, 0.0))
    total = sum(recomputed.rows)
    a, b = (n / total for n in recomputed.rows)
    return Domain(parts, (a, b))


@dataclass(frozen=True)
class _Read:
    """A comparison's recomputes at one parameter's payload positions, each gathered once:
    the batch's whole update and its parts' difference, the decoy's whole update."""

    whole: torch.Tensor
    halves: torch.Tensor | None
    decoy: torch.Tensor

    def part(self, k: int, shares: tuple[float, float]) -> torch.Tensor:
        """Part `k`'s update less the decoy's whole update: what only that part's rows give (an
        honest result carries both parts; one trained on the other part only does not carry
        this one: its `t` along this is about N(0, 3^2))."""
        assert self.halves is not None
        sign = shares[1] if k == 0 else -shares[0]
        return self.whole.clone().add_(self.halves, alpha=sign).sub_(self.decoy)


def _reads(
    flat_parts: Sequence[tuple[torch.Tensor | None, torch.Tensor]], own: Domain, decoy: Domain
) -> list[_Read]:
    out = []
    for i, (positions, _) in enumerate(flat_parts):
        whole, halves = own.at(i, positions)
        out.append(_Read(whole, halves, decoy.at(i, positions)[0]))
    return out


def _agreement_of(
    flat_parts: Sequence[tuple[torch.Tensor | None, torch.Tensor]],
    directions: Iterable[torch.Tensor],
) -> float:
    """`t` of the payload's values along `directions` (one per parameter, overwritten)."""
    return agreement(zip(directions, (values for _, values in flat_parts), strict=True))


@dataclass(frozen=True)
class Measures:
    """Every statistic of one comparison (whichever decided)."""

    agreement: float
    """`t` along the difference of the batch's and the decoy's updates."""
    balance: float | None
    """`t` along the difference of the batch's two parts (None: one part)."""
    cosine: float
    """The cosine of the payload with the recompute at the payload's positions."""
    norm_ratio: float | None
    """DiLoCo: the payload's norm over the recompute's."""
    parts: float | None = None
    """The lesser `t` of the two parts, each along its difference with the decoy (None: one
    part)."""

    def __str__(self) -> str:
        words = [f"agreement t = {self.agreement:.2f}"]
        if self.balance is not None:
            words.append(f"balance t = {self.balance:.2f}")
        if self.parts is not None:
            words.append(f"parts t >= {self.parts:.2f}")
        words.append(f"cosine {self.cosine:.3f}")
        if self.norm_ratio is not None:
            words.append(f"norm {self.norm_ratio:.3g}x")
        return ", ".join(words)


def compare(
    reader: ResultReader,
    own: Domain,
    decoy: Domain,
    published: Sequence[DistroResult],
    settings: VerificationSettings,
) -> VerificationVerdict:
    """The statistical part: `published` against the recompute of its batch (`own`) and of a
    decoy batch (`domain_of`); checks in order zero and norm (DiLoCo), agreement along the
    difference of the two batches' updates, balance of the batch's two parts."""
    flat = reader.flat(published)
    reads = _reads(flat.parts, own, decoy)
    t = _agreement_of(flat.parts, (r.whole - r.decoy for r in reads))
    balance = parts = None
    if own.halved:
        balance = _agreement_of(
            flat.parts, (r.halves.clone() for r in reads if r.halves is not None)
        )
        parts = min(
            _agreement_of(flat.parts, (r.part(k, own.shares) for r in reads)) for k in (0, 1)
        )
    norm = float(torch.linalg.vector_norm(flat.values))
    at = torch.cat([r.whole for r in reads])
    reference = float(torch.linalg.vector_norm(at))
    cosine = float(torch.dot(at, flat.values)) / (reference * norm) if reference * norm else 0.0
    measures = Measures(t, balance, cosine, None, parts)
    if reader.layouts is not None:
        if norm == 0.0:
            return _refused("zero", 0.0, 0.0, "the update is zero", measures)
        sparse = any(lay.transmission is DilocoTransmission.Sparse for lay in reader.layouts)
        # the sparse form's payload is the top-k of its update: its norm is compared with the
        # recompute's at the same positions; a dense form's with the whole recompute's
        expected = reference if sparse else own.norm()
        ratio = norm / expected if expected > 0.0 else math.inf
        measures = Measures(t, balance, cosine, ratio, parts)
        bound = settings.max_norm_ratio
        if bound > 0.0 and not 1.0 / bound <= ratio <= bound:
            return _refused(
                "norm",
                ratio,
                bound,
                f"norm {norm:.4g} is {ratio:.3g}x the recompute's ({expected:.4g}); at most "
                f"{bound:g}x either way",
                measures,
            )
    if t < settings.min_agreement:
        return _refused(
            "agreement",
            t,
            settings.min_agreement,
            f"agreement with this batch's own update t = {t:.2f}, below {settings.min_agreement:g}",
            measures,
        )
    if (
        parts is not None
        and settings.min_part_agreement > 0.0
        and parts < settings.min_part_agreement
    ):
        return _refused(
            "parts",
            parts,
            settings.min_part_agreement,
            f"one half of the batch is not carried (t = {parts:.2f} along that half's update "
            f"less the decoy's; at least {settings.min_part_agreement:g})",
            measures,
        )
    if balance is not None and settings.max_balance > 0.0 and abs(balance) > settings.max_balance:
        return _refused(
            "balance",
            balance,
            settings.max_balance,
            f"the batch's two halves are not carried alike (t = {balance:.2f} along their "
            f"difference; at most {settings.max_balance:g} either way)",
            measures,
        )
    return VerificationVerdict(True, t, settings.min_agreement, None, str(measures), measures)


def _refused(
    check: str, score: float, threshold: float, detail: str, measures: Measures
) -> VerificationVerdict:
    return VerificationVerdict(False, score, threshold, check, detail, measures)


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
    reader = result_reader(trainer)
    own = recompute(trainer, batch, step=step, warmup_lr_between=warmup_lr_between)
    if isinstance(decoy, Batch):
        decoy = recompute(trainer, decoy, step=step, warmup_lr_between=warmup_lr_between)
    return compare(reader, domain_of(trainer, own), domain_of(trainer, decoy), published, settings)


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
                verdict.measures,
            )
        return verdict


# --------------------------------------------------------------------------------------------
# Exact shadow verification


@dataclass
class Shadow:
    """A verifier's shadow of one trainer it follows from the trainer's first round in the run
    (its own state then known: `Trainer.fresh_own_state`): the trainer's own optimizer state as
    the trainer holds it (`OwnState`: DisTrO's momentum; DiLoCo's residual, pending own update
    and inner AdamW) and, for DisTrO, the unquantized results of the last round it trained (what
    its next training round subtracts from the momentum, as a client does:
    `psyche.client.round.train.own_results_to_subtract`). `follow` advances it every round the
    trainer trains, with the trainer's batch and the run's weights of the round, through the
    trainer's own code (`Trainer.train_exact` on the verifier's `Trainer` with this state
    swapped in), so that it rebuilds the trainer's payload bit for bit when the trainer is
    honest and the verifier computes in the same determinism class (device kind, dtype).

    A shadow cannot start mid-life: a trainer's state is the sum of every round it trained, and
    none of it is published (1-bit DisTrO sends signs of the momentum's top-k, not its values);
    a verifier that did not see a trainer's first round compares statistically (`verify_result`).
    Its cost: one training step of the trainer's batch per followed trainer per round (whether
    or not that round is verified) and one optimizer's own state in memory per followed trainer
    (DisTrO: one copy of the weights; DiLoCo: four float32 copies: residual, pending update, the
    inner AdamW's two moments). The determinism class: the same device kind and dtype and, on the
    CPU, the same intra-op thread count as the trainer (see the module docstring)."""

    state: OwnState
    owed: list[list[DistroResult]] = field(default_factory=list)
    followed: int | None = None
    """The last step it followed (None: none yet)."""

    @classmethod
    def fresh(cls, verifier: Trainer) -> Shadow:
        """A shadow of a trainer at its first round in the run (nothing trained yet)."""
        _optimizer(verifier)
        return cls(verifier.fresh_own_state())


@dataclass(frozen=True)
class ShadowVerdict:
    """What an exact comparison found: the trainer's payload against the shadow's."""

    matches: bool
    """Whether the payload's results are the shadow's, bit for bit (its commitment's hash)."""
    differing: int
    """How many of the payload's entries (one per parameter) differ in any bit."""
    entries: int
    differing_bits: int
    """How many bits of the results' tensor data (indices and values) differ (a measure of how
    far, for research: any one is a mismatch)."""
    bits: int
    detail: str


def follow(
    verifier: Trainer,
    shadow: Shadow,
    batch: Batch,
    *,
    step: int,
    batch_id: BatchId,
    warmup_lr_between: tuple[int, int] | None = None,
    zero_optim: bool = False,
    cancel: CancelToken | None = None,
) -> TransmittableDistroResult:
    """Advance `shadow` by the trainer's round `step` on `batch` and return the payload an
    honest trainer publishes for it (the trainer's own `train_exact` and `prepare_result` on
    `verifier`, the shadow's state swapped in: `verifier`'s model must hold the run's weights of
    the round, as every trainer's does). `verifier` is left as it was: weights bit for bit
    (`train_exact` restores them), gradients zero, its own optimizer state and nonce back.
    A round the trainer trained must be followed, every one, in order; a round it sat out is
    not (its state does not move: the owed results wait for its next training round). A
    cancelled step (`cancel`) raises `RecomputeCancelled` and leaves the shadow unusable (a
    missed round cannot be rebuilt): the caller drops it. So does a caller whose DiLoCo trainer
    was assigned a batch and published nothing (stopped between inner steps, its inner AdamW
    moved without a payload); a DisTrO trainer stopped so keeps its momentum."""
    if shadow.followed is not None and step <= shadow.followed:
        raise TrainerError(f"the shadow followed step {shadow.followed}; {step} is not after it")
    owed = [] if zero_optim else shadow.owed
    nonce = verifier.nonce
    verifier.swap_own_state(shadow.state)
    try:
        out = verifier.train_exact(
            step,
            batch,
            warmup_lr_between=warmup_lr_between,
            zero_optim=zero_optim,
            prev_self_distro_results=owed,
            cancel=cancel,
        )
    finally:
        verifier.swap_own_state(shadow.state)
        verifier.nonce = nonce
        _zero_grads(_weights(verifier))
    if out.cancelled:
        raise RecomputeCancelled
    shadow.followed = step
    shadow.owed = [out.distro_results] if verifier.distro is not None and out.distro_results else []
    return verifier.prepare_result(out, step=step, batch_id=batch_id).payload


def compare_exact(
    shadow: TransmittableDistroResult, published: TransmittableDistroResult
) -> ShadowVerdict:
    """The exact comparison: `published` against the payload `follow` rebuilt, by their
    commitments (`compute_hash`: the step, the batch and every result's bytes; not the nonce).
    Any bit that differs is a mismatch."""
    entries = len(published.distro_results)
    differing = abs(len(shadow.distro_results) - entries)
    differing_bits = bits = 0
    for a, b in zip(shadow.distro_results, published.distro_results):
        diff = sum(
            _bit_difference(x.raw_tensor_data(), y.raw_tensor_data())
            for x, y in ((a.sparse_idx, b.sparse_idx), (a.sparse_val, b.sparse_val))
        )
        differing += 1 if diff or a != b else 0
        differing_bits += diff
        bits += 8 * (len(b.sparse_idx.raw_tensor_data()) + len(b.sparse_val.raw_tensor_data()))
    if shadow.compute_hash() == published.compute_hash():
        detail = "the payload is the shadow's, bit for bit"
        return ShadowVerdict(True, 0, entries, 0, bits, detail)
    return ShadowVerdict(
        False,
        differing,
        entries,
        differing_bits,
        bits,
        f"the payload is not what this trainer's batch gives ({differing} of {entries} "
        f"entries, {differing_bits} of {bits} bits differ from the shadow's)",
    )


def _bit_difference(a: bytes, b: bytes) -> int:
    """How many bits differ between `a` and `b` (the longer one's extra bytes all count)."""
    n = min(len(a), len(b))
    x = np.frombuffer(a[:n], np.uint8) ^ np.frombuffer(b[:n], np.uint8)
    return int(np.unpackbits(x).sum()) + 8 * abs(len(a) - len(b))


def verify_exact(
    verifier: Trainer,
    shadow: Shadow,
    batch: Batch,
    published: TransmittableDistroResult,
    *,
    warmup_lr_between: tuple[int, int] | None = None,
    zero_optim: bool = False,
) -> ShadowVerdict:
    """`follow` the trainer's round (the published payload's step and batch) and compare."""
    rebuilt = follow(
        verifier,
        shadow,
        batch,
        step=published.step,
        batch_id=published.batch_id,
        warmup_lr_between=warmup_lr_between,
        zero_optim=zero_optim,
    )
    return compare_exact(rebuilt, published)
