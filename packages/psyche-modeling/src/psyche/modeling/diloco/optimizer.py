"""DiLoCo's state for one model replica: the round's snapshot, the sender's error-feedback
residual, and the outer optimizer (SGD with Nesterov momentum) every client runs alike.

A round (one outer step) on a client:

* `begin_round` keeps a copy of the weights `W` (the run's weights: identical on every client)
  and, while this client's previous payload is still to be applied, shifts its own starting
  point by the outer step its own pseudo-gradient of that round would take alone (the
  lookahead);
* the trainer takes `inner_steps` inner AdamW steps on its batch (`inner_ranges` splits it);
* `end_round` forms the pseudo-gradient `start - W_local` (float32), adds the residual of what
  earlier rounds did not get across, encodes it (`codec.encode`), keeps the new residual
  (`sum - decode(sent)`), and puts `W` back: the client's weights stay the run's;
* `apply` (two rounds later, as DisTrO's apply) averages the accepted payloads and takes the
  outer step, identically on every client (see `apply`).

Outer state rules: the momentum buffer starts at zero and is reset at every epoch start
(`reset_outer_state`, which the client calls before an epoch's first apply), so a client that
joins at an epoch start (Psyche admits clients only there) holds exactly the state of those
already training; the residual and the inner AdamW state are the client's own and do not enter
anyone's weights except through its payloads.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from psyche.core.definitions import (
    DILOCO_INNER_BETAS,
    DILOCO_INNER_EPS,
    DiLoCo,
    DilocoTransmission,
)
from psyche.core.numeric import to_f32
from psyche.modeling.diloco.codec import (
    DilocoLayout,
    accumulate,
    check_payload_entries,
    decode,
    diloco_layouts,
    encode,
    entry_values,
    finish,
    new_accumulator,
)
from psyche.modeling.distro import DistroResult, check_result_lists, sorted_variables
from psyche.modeling.serialized_distro import (
    TransmittableDistroResult,
    distro_result_from_serialized,
)
from psyche.modeling.sharding import full_tensor, shard_like


@dataclass(frozen=True)
class DilocoSettings:
    """The run config's `DiLoCo` optimizer as plain Python values (floats rounded to f32, as a
    run config holds them); defaults are the DiLoCo paper's outer settings."""

    inner_steps: int = 8
    transmission: DilocoTransmission = DilocoTransmission.Sparse
    value_bits: int = 2
    compression_chunk: int = 16
    compression_topk: int = 8
    nesterov: bool = True
    outer_lr_follows_schedule: bool = False
    inner_weight_decay: float = 0.0
    inner_clip_grad_norm: float = 1.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_clip_grad_norm: float = 0.0
    peer_clip_multiple: float = 0.0
    """The bounded aggregate (0 = off): each accepted pseudo-gradient is scaled down to at most
    this multiple of the round's median payload norm before the mean (`Diloco.apply`)."""

    def __post_init__(self) -> None:
        for name in (
            "inner_weight_decay",
            "inner_clip_grad_norm",
            "outer_lr",
            "outer_momentum",
            "outer_clip_grad_norm",
            "peer_clip_multiple",
        ):
            object.__setattr__(self, name, to_f32(float(getattr(self, name))))
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {self.inner_steps}")

    @classmethod
    def from_definition(cls, d: DiLoCo) -> DilocoSettings:
        return cls(
            inner_steps=int(d.inner_steps),
            transmission=d.transmission,
            value_bits=int(d.value_bits),
            compression_chunk=int(d.compression_chunk),
            compression_topk=int(d.compression_topk),
            nesterov=bool(d.nesterov),
            outer_lr_follows_schedule=bool(d.outer_lr_follows_schedule),
            inner_weight_decay=float(d.inner_weight_decay),
            inner_clip_grad_norm=float(d.inner_clip_grad_norm),
            outer_lr=float(d.outer_lr),
            outer_momentum=float(d.outer_momentum),
            outer_clip_grad_norm=float(d.outer_clip_grad_norm),
            peer_clip_multiple=float(d.peer_clip_multiple),
        )

    def definition(self) -> DiLoCo:
        return DiLoCo(
            inner_steps=self.inner_steps,
            transmission=self.transmission,
            value_bits=self.value_bits,
            compression_chunk=self.compression_chunk,
            compression_topk=self.compression_topk,
            nesterov=self.nesterov,
            outer_lr_follows_schedule=self.outer_lr_follows_schedule,
            inner_weight_decay=self.inner_weight_decay,
            inner_clip_grad_norm=self.inner_clip_grad_norm,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            outer_clip_grad_norm=self.outer_clip_grad_norm,
            peer_clip_multiple=self.peer_clip_multiple,
        )

    @property
    def inner_betas(self) -> tuple[float, float]:
        return DILOCO_INNER_BETAS

    @property
    def inner_eps(self) -> float:
        return DILOCO_INNER_EPS


def inner_ranges(samples: int, inner_steps: int) -> list[tuple[int, int]]:
    """How a round's batch of `samples` rows is split into inner steps: `min(inner_steps,
    samples)` contiguous parts, the first `samples % parts` one row longer (as the coordinator
    splits a round's data among trainers)."""
    parts = min(inner_steps, samples)
    if parts < 1:
        return []
    base, extra = divmod(samples, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def _sum_of_squares(t: torch.Tensor) -> float:
    """The sum of squares of a float32 tensor, the same float64 on every device: squares of
    float32 values are exact in float64, and the sum is a pairwise tree of elementwise adds."""
    v = t.detach().reshape(-1).to(torch.float64)
    v = v * v
    n = v.numel()
    if n == 0:
        return 0.0
    size = 1 << (n - 1).bit_length()
    if size != n:
        v = torch.cat([v, v.new_zeros(size - n)])
    while v.numel() > 1:
        half = v.numel() // 2
        v = v[:half] + v[half:]
    return float(v.item())


def deterministic_norm(tensors: Iterable[torch.Tensor]) -> float:
    """The global L2 norm of `tensors`, identical on every device (see `_sum_of_squares`; the
    per-tensor sums are added in order in Python floats)."""
    return math.sqrt(sum(_sum_of_squares(t) for t in tensors))


def payload_digest(results: Sequence[DistroResult]) -> bytes:
    """sha256 over every entry's tensor bytes: the key that orders peers in `apply`."""
    h = hashlib.sha256()
    for r in results:
        for t in (r.sparse_idx, r.sparse_val):
            c = t.detach().to("cpu").contiguous()
            h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.digest()


class OuterSGD:
    """SGD with (Nesterov) momentum on float32 state, in ops that round the same on any device.

    Per parameter, with `g` the (clipped) mean pseudo-gradient: `buf = g` at the first step,
    then `buf = buf * momentum + g`; the direction is `g + buf * momentum` (Nesterov) or `buf`;
    `p = p - direction * lr` (computed in float32, rounded once to `p`'s dtype). That is
    `torch.optim.SGD(momentum, nesterov, dampening=0)`, except that no product is fused with
    an add (torch's `add_(x, alpha=a)` may use an FMA on one device and not on another).
    """

    def __init__(self, params: Sequence[torch.Tensor], momentum: float, nesterov: bool) -> None:
        self.params = list(params)
        self.momentum = to_f32(momentum)
        self.nesterov = nesterov
        self.buffers: list[torch.Tensor] | None = None

    def reset(self) -> None:
        self.buffers = None

    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor], lr: float) -> None:
        lr = to_f32(lr)
        if self.momentum != 0.0:
            if self.buffers is None:
                self.buffers = [g.detach().clone() for g in grads]
            else:
                for buf, g in zip(self.buffers, grads):
                    buf.mul_(self.momentum).add_(g)
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if self.momentum == 0.0:
                direction = g
            elif self.nesterov:
                assert self.buffers is not None
                direction = g + self.buffers[i] * self.momentum
            else:
                assert self.buffers is not None
                direction = self.buffers[i]
            updated = p.detach().to(torch.float32) - direction * lr
            p.copy_(updated)


class Diloco:
    """DiLoCo for one model replica (see the module docstring).

    `variables` are a module or `(name, parameter)` pairs; they are put in DisTrO's order
    (sorted by name), which is the order of every payload's entries. `base_lr` is the run
    schedule's peak (for `outer_lr_follows_schedule`).
    """

    def __init__(
        self,
        variables: nn.Module | Iterable[tuple[str, torch.Tensor]],
        settings: DilocoSettings,
        *,
        base_lr: float | None = None,
    ) -> None:
        self.settings = settings
        self.variables = sorted_variables(variables)
        if not self.variables:
            raise ValueError("DiLoCo needs at least one parameter")
        self.params = [p for _, p in self.variables]
        self._layouts = diloco_layouts(
            [(name, tuple(p.shape)) for name, p in self.variables],
            settings.transmission,
            chunk=settings.compression_chunk,
            topk=settings.compression_topk,
            value_bits=settings.value_bits,
        )
        self.base_lr = base_lr
        self.outer = OuterSGD(self.params, settings.outer_momentum, settings.nesterov)
        self.residuals: list[torch.Tensor] | None = None
        self._snapshot: list[torch.Tensor] | None = None
        self._lookahead: list[torch.Tensor] | None = None
        # this replica's last measured pseudo-gradient (before compression) and its round: the
        # lookahead's input
        self._own_update: list[torch.Tensor] | None = None
        self._own_round: int | None = None
        self.keep_encoded = False
        """Keep what `end_round` compressed (`encoded`: the pseudo-gradient plus the residual, as
        the payloads' domain reads it): a witness's reference (`psyche.modeling.screening`)."""
        self.encoded: list[torch.Tensor] | None = None
        self.outer_steps = 0

    @classmethod
    def from_definition(
        cls,
        variables: nn.Module | Iterable[tuple[str, torch.Tensor]],
        definition: DiLoCo,
        *,
        base_lr: float | None = None,
    ) -> Diloco:
        return cls(variables, DilocoSettings.from_definition(definition), base_lr=base_lr)

    def layouts(self) -> list[DilocoLayout]:
        return list(self._layouts)

    # ---- the round on this client ------------------------------------------------------

    @torch.no_grad()
    def begin_round(self, round_index: int | None = None, lookahead_lr: float = 0.0) -> None:
        """Keep the run's weights; the inner steps may now change the model.

        With `lookahead_lr` > 0, when this replica's payload of round `round_index - 1` is
        still to be applied (Psyche's one-round overlap), the inner steps start from the run's
        weights minus an estimate of that pending outer step: the step `OuterSGD` would take
        with this replica's own pseudo-gradient of that round as the mean, the (run-wide)
        momentum included, at `lookahead_lr` (as DisTrO's lookahead stands in for a node's own
        pending contribution). The pseudo-gradient is the one measured, before compression: the
        run's mean averages every peer's, so it is a closer estimate than this replica's sparse
        payload alone (on the tiny run, sparse 2-bit c16 k8: +4.9 % of AdamW's loss instead of
        +8.3 %; docs/benchmarks.md). The estimate moves only this replica's starting point: it is not part
        of its pseudo-gradient (measured from the shifted start) and never touches the run's
        weights, which `end_round` puts back.
        """
        self._snapshot = [p.detach().clone() for p in self.params]
        self._lookahead = None
        own = self._own_update
        if (
            lookahead_lr <= 0.0
            or own is None
            or round_index is None
            or self._own_round is None
            or self._own_round != round_index - 1
        ):
            return
        lookahead = []
        momentum = self.outer.momentum
        buffers = self.outer.buffers
        for i, (p, g) in enumerate(zip(self.params, own)):
            if momentum == 0.0:
                direction = g
            else:
                buf = g if buffers is None else buffers[i] * momentum + g
                direction = g + buf * momentum if self.outer.nesterov else buf
            shift = direction * to_f32(lookahead_lr)
            p.copy_(p.detach().to(torch.float32) - shift)
            lookahead.append(shift)
        self._lookahead = lookahead

    @torch.no_grad()
    def abort_round(self) -> None:
        """Put the run's weights back without producing anything (a cancelled round)."""
        if self._snapshot is not None:
            for p, saved in zip(self.params, self._snapshot):
                p.copy_(saved)
        self._snapshot = None
        self._lookahead = None

    @torch.no_grad()
    def end_round(self, round_index: int | None = None) -> list[DistroResult]:
        """The round's pseudo-gradient in its sent form (one entry per parameter); the weights
        are the run's again afterwards."""
        if self._snapshot is None:
            raise RuntimeError("end_round without begin_round")
        if self.residuals is None:
            self.residuals = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        out, own = [], []
        encoded: list[torch.Tensor] | None = [] if self.keep_encoded else None
        for i, (p, saved, residual, layout) in enumerate(
            zip(self.params, self._snapshot, self.residuals, self._layouts)
        ):
            delta = saved.to(torch.float32) - p.detach().to(torch.float32)
            if self._lookahead is not None:
                delta = delta - self._lookahead[i]  # measured from the shifted start
            residual.add_(delta)
            # A sharded residual (FSDP) is gathered first, as DisTrO's momentum is: the payload
            # is computed on the full tensor, the same bits as on a one-rank client; each rank
            # keeps its slice of what remains (elementwise: the same bits per element).
            full = full_tensor(residual)
            sent = encode(full, layout, encoded)
            residual.sub_(shard_like(decode(sent, layout, full.device), residual))
            out.append(sent)
            own.append(delta)
            p.copy_(saved)
        self._snapshot = None
        self._lookahead = None
        self._own_update, self._own_round = own, round_index
        self.encoded = encoded
        return out

    # ---- the outer step, on every client -----------------------------------------------

    def outer_lr(self, schedule_lr: float) -> float:
        """The outer lr at a step whose schedule lr is `schedule_lr`."""
        if not self.settings.outer_lr_follows_schedule:
            return self.settings.outer_lr
        if not self.base_lr:
            raise ValueError("outer_lr_follows_schedule needs the schedule's base_lr")
        return self.settings.outer_lr * (schedule_lr / self.base_lr)

    def reset_outer_state(self) -> None:
        """Zero the outer momentum (every client at every epoch start: the run's rule)."""
        self.outer.reset()

    def mean_pseudo_gradient(self, results: Sequence[Sequence[DistroResult]]) -> list[torch.Tensor]:
        """The float32 mean of the payloads, the same bits whatever their order and device:
        peers are taken in ascending `payload_digest` order, each payload decoded into float32
        accumulators by elementwise ops (`codec.accumulate`), the sum divided by the count.
        With `peer_clip_multiple`, each payload is first scaled by `peer_scales`."""
        check_result_lists(results, len(self.params), "payload")
        ordered = sorted(results, key=payload_digest)
        scales = self.peer_scales(ordered)
        means = []
        for index, (p, layout) in enumerate(zip(self.params, self._layouts)):
            acc = new_accumulator(layout, p.device)
            for entries, scale in zip(ordered, scales):
                accumulate(acc, entries[index], layout, scale)
            # The count as a tensor on the accumulator's device, not a Python scalar: CUDA
            # divides by a host scalar as a multiplication by its reciprocal, which rounds
            # differently from the CPU's true division (seen on an H200: no CPU/CUDA agreement).
            count = torch.tensor(float(len(ordered)), dtype=torch.float32, device=acc.device)
            means.append(finish(acc, layout).div_(count))
        return means

    def payload_norm(self, entries: Sequence[DistroResult]) -> float:
        """A payload's L2 norm (its decoded pseudo-gradient's), the same float on every device
        (`deterministic_norm` of `codec.entry_values`)."""
        device = self.params[0].device
        return deterministic_norm(
            entry_values(r, layout, device) for r, layout in zip(entries, self._layouts)
        )

    def peer_scales(self, results: Sequence[Sequence[DistroResult]]) -> list[float]:
        """The bounded aggregate: the factor (float32, at most 1) each payload is multiplied by
        so that its norm is at most `peer_clip_multiple` x the round's median payload norm (the
        lower median: with one payload in two inflated, the bound is still an honest one's). All
        ones when the setting is 0, or for a lone payload."""
        multiple = self.settings.peer_clip_multiple
        if multiple <= 0.0 or len(results) < 2:
            return [1.0] * len(results)
        norms = [self.payload_norm(r) for r in results]
        bound = multiple * statistics.median_low(norms)
        return [to_f32(bound / n) if n > bound else 1.0 for n in norms]

    @torch.no_grad()
    def apply(self, results: Sequence[Sequence[DistroResult]], lr: float) -> None:
        """The outer step on the mean of `results` (one result list per accepted payload).

        An empty `results` is a no-op. The mean is clipped to `outer_clip_grad_norm` (if set)
        by a norm taken with `deterministic_norm`; then `OuterSGD.step`.
        """
        if not results:
            return
        means = self.mean_pseudo_gradient(results)
        max_norm = self.settings.outer_clip_grad_norm
        if max_norm > 0.0:
            total = deterministic_norm(means)
            if total > max_norm:
                scale = to_f32(max_norm / (total + 1e-6))
                for g in means:
                    g.mul_(scale)
        # a sharded parameter (FSDP) steps on its slice of the mean (elementwise, same bits)
        self.outer.step([shard_like(g, p) for g, p in zip(means, self.params)], lr)
        self.outer_steps += 1

    # ---- payloads ---------------------------------------------------------------------------

    def results_from_transmittable(self, payload: TransmittableDistroResult) -> list[DistroResult]:
        """A peer's payload checked against this model (`codec.validate`), then as tensors."""
        check_payload_entries(payload.distro_results, self._layouts)
        return [distro_result_from_serialized(r) for r in payload.distro_results]
