"""DisTrO outside the Psyche client: an ordinary training loop, and N simulated peers.

Both follow the timing of upstream's single-node example (and of a Psyche round): the update a
node applies after training step N is the aggregate of the results produced at step N-1, and the
forward pass of step N runs on weights shifted by the lookahead `sign(delta) * lr(N-1)`.

    loop = DistroLoop(model, lr=1e-3)
    for step, batch in enumerate(batches, start=1):
        loop.zero_grad(step)                 # zero grads + lookahead
        model(**batch).loss.backward()
        loop.step(step)                      # generate + apply the previous step's result
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from psyche.core.batch_id import BatchId
from psyche.core.numeric import to_f32
from psyche.modeling.causal_lm import clip_grad_norm_native
from psyche.modeling.distro import Distro, DistroResult, quantize_results, sorted_variables
from psyche.modeling.lr import Schedule, lr_function
from psyche.modeling.screening import (
    RoundTamper,
    ScreeningSettings,
    WitnessPanel,
    simulate_round,
)
from psyche.modeling.serialized_distro import (
    decode_transmittable,
    distro_results_from_transmittable,
    transmittable_distro_result,
)

if TYPE_CHECKING:
    from psyche.core import definitions
    from psyche.modeling.diloco.optimizer import Diloco
    from psyche.modeling.serialized_distro import TransmittableDistroResult


@dataclass(frozen=True)
class DistroSettings:
    """DisTrO hyper-parameters (the run config's `Distro` optimizer, as plain Python values).

    The float fields are rounded to f32 as in a run config, so a simulation computes exactly
    what Psyche clients configured with the same numbers compute (`1 - lr * wd` is evaluated in
    f64 and a different f64 `wd` can round to a different f32 factor).
    """

    compression_chunk: int = 64
    compression_topk: int = 8
    compression_decay: float = 0.999
    weight_decay: float = 0.0
    quantize_1bit: bool = True
    clip_grad_norm: float | None = None

    def __post_init__(self) -> None:
        for name in ("compression_decay", "weight_decay", "clip_grad_norm"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, to_f32(value))

    @classmethod
    def from_definition(cls, definition: definitions.Distro) -> DistroSettings:
        d = definition
        return cls(
            compression_chunk=int(d.compression_chunk),
            compression_topk=int(d.compression_topk),
            compression_decay=float(d.compression_decay),
            weight_decay=float(d.weight_decay or 0.0),
            quantize_1bit=bool(d.quantize_1bit),
            clip_grad_norm=d.clip_grad_norm,
        )

    def definition(self) -> definitions.Distro:
        """The run config's `Distro` optimizer with these settings (`from_definition`'s
        inverse)."""
        from psyche.core import definitions

        return definitions.Distro(
            clip_grad_norm=self.clip_grad_norm,
            weight_decay=self.weight_decay,
            compression_decay=self.compression_decay,
            compression_topk=self.compression_topk,
            compression_chunk=self.compression_chunk,
            quantize_1bit=self.quantize_1bit,
        )

    def build(self, model: nn.Module | Sequence[tuple[str, torch.Tensor]]) -> Distro:
        return Distro(
            model,
            compression_decay=self.compression_decay,
            compression_chunk=self.compression_chunk,
            compression_topk=self.compression_topk,
            weight_decay=self.weight_decay,
        )


def _prev(step: int) -> int:
    return 0 if step == 0 else step - 1


def clip_gradients(params: Sequence[torch.Tensor], max_norm: float | None) -> None:
    """Clip the gradients of `params` to `max_norm` in place (as the trainer does); nothing when
    `max_norm` is None or not positive, or no parameter has a gradient."""
    if max_norm is not None and max_norm > 0.0:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            clip_grad_norm_native(grads, max_norm)


class _Member(Protocol):
    """A simulated member as `ResultExchange` reads it: its model."""

    model: nn.Module


class ResultExchange:
    """What the DisTrO and DiLoCo peer simulations share: one round's exchange of every
    member's results (`simulate_round`: the hostile members' rewrite, the wire, the witnesses'
    verdict). With `through_wire`, every result goes through the postcard payload, its
    commitment hash and the receiver's validation (`_from_wire`), as between real peers;
    `last_payload_bytes` then holds each member's last payload size. `last_accepted`: the
    members whose results of the last exchange the run applies. `members`: the simulation's
    own list of members (each with its `model`), read again by every `models`; `optimizers`:
    theirs, in the same order."""

    def __init__(
        self,
        members: Sequence[_Member],
        optimizers: Sequence[Distro | Diloco],
        *,
        through_wire: bool,
        hostile: RoundTamper | None,
        screening: ScreeningSettings | None,
    ) -> None:
        self._members = members
        self.through_wire = through_wire
        self.last_payload_bytes: list[int] = []
        self.hostile = hostile
        self.witnesses: WitnessPanel | None = None
        if screening is not None:
            for optimizer in optimizers:
                optimizer.keep_encoded = True
            self.witnesses = WitnessPanel(optimizers[0], screening, len(optimizers), hostile)
        self.last_accepted: list[int] = []
        self._optimizers = list(optimizers)

    @property
    def models(self) -> list[nn.Module]:
        """Every member's model, in member order, as the members are now (a member the
        simulation's list gained since shows)."""
        return [member.model for member in self._members]

    def _exchange(self, sent: list[list[DistroResult]], step: int) -> list[list[DistroResult]]:
        """Every member's `sent` results of `step` as received; with screening, only those a
        quorum of witnesses vouched for (their members in `last_accepted`)."""
        received, self.last_accepted = simulate_round(
            sent,
            self._optimizers,
            lambda results, i: self._send(results, step, i),
            self.hostile,
            self.witnesses,
        )
        return [received[i] for i in self.last_accepted]

    def _send(self, results: list[DistroResult], step: int, index: int) -> list[DistroResult]:
        if not self.through_wire:
            return results
        payload = transmittable_distro_result(results, step, 0, BatchId(index, index))
        blob = payload.to_bytes()
        if len(self.last_payload_bytes) == len(self._optimizers):
            self.last_payload_bytes = []
        self.last_payload_bytes.append(len(blob))
        received = decode_transmittable(blob)
        if received.comptue_hash() != payload.comptue_hash():
            raise AssertionError("commitment hash changed on the wire")
        return self._from_wire(received)

    def _from_wire(self, received: TransmittableDistroResult) -> list[DistroResult]:
        """A received payload's results, as the receiving member validates them."""
        raise NotImplementedError


class _Peer:
    def __init__(self, model: nn.Module, settings: DistroSettings) -> None:
        self.model = model
        self.distro = settings.build(model)
        self.params = [p for _, p in sorted_variables(model)]
        self.prev_results: list[DistroResult] | None = None

    def zero_grad(self, prev_lr: float) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()
        self.distro.error_correction(prev_lr)

    def generate(self, settings: DistroSettings, prev_lr: float, lr: float) -> list[DistroResult]:
        clip_gradients(self.params, settings.clip_grad_norm)
        prev = [self.prev_results] if self.prev_results is not None else []
        return self.distro.generate(prev, prev_lr, lr)


class DistroLoop:
    """DisTrO for one model in a plain loop (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        settings: DistroSettings | None = None,
        *,
        lr: float | Schedule | Callable[[int], float],
    ) -> None:
        self.settings = settings or DistroSettings()
        self.lr = lr_function(lr)
        self._peer = _Peer(model, self.settings)

    @property
    def distro(self) -> Distro:
        return self._peer.distro

    def zero_grad(self, step: int) -> None:
        """Zero the gradients and apply the lookahead; call before the forward pass."""
        self._peer.zero_grad(self.lr(_prev(step)))

    def step(self, step: int) -> list[DistroResult]:
        """Compress this step's momentum, then apply the previous step's result."""
        lr = self.lr(step)
        results = self._peer.generate(self.settings, self.lr(_prev(step)), lr)
        previous = self._peer.prev_results
        if previous is not None:
            sent = quantize_results(previous) if self.settings.quantize_1bit else previous
            self._peer.distro.apply([sent], lr)
        self._peer.prev_results = results
        return results


class PeerSimulation(ResultExchange):
    """N DisTrO peers in one process, each with its own replica, exchanging results.

    Each peer trains on its own data between `zero_grad` and `step`. With `through_wire`, every
    exchanged result goes through the postcard payload, its commitment hash and the receiver's
    validation, as between real peers; `last_payload_bytes` then holds each payload's size.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        settings: DistroSettings | None = None,
        *,
        lr: float | Schedule | Callable[[int], float],
        through_wire: bool = False,
        hostile: RoundTamper | None = None,
        screening: ScreeningSettings | None = None,
    ) -> None:
        if not models:
            raise ValueError("at least one peer is needed")
        self.settings = settings or DistroSettings()
        self.lr = lr_function(lr)
        self.peers = [_Peer(m, self.settings) for m in models]
        self._outbox: list[list[DistroResult]] | None = None
        super().__init__(
            self.peers,
            [peer.distro for peer in self.peers],
            through_wire=through_wire,
            hostile=hostile,
            screening=screening,
        )

    def zero_grad(self, step: int) -> None:
        for peer in self.peers:
            peer.zero_grad(self.lr(_prev(step)))

    def step(self, step: int) -> None:
        """Every peer compresses its momentum; then every peer applies all peers' previous
        results (the per-coefficient mean over the peers that picked each coefficient)."""
        lr = self.lr(step)
        prev_lr = self.lr(_prev(step))
        fresh = [peer.generate(self.settings, prev_lr, lr) for peer in self.peers]
        sent = [quantize_results(r) if self.settings.quantize_1bit else r for r in fresh]
        if self._outbox is not None:
            for peer in self.peers:
                peer.distro.apply(self._outbox, lr)
        for peer, results in zip(self.peers, fresh):
            peer.prev_results = results
        self._outbox = self._exchange(sent, step)

    def _from_wire(self, received: TransmittableDistroResult) -> list[DistroResult]:
        layouts = self.peers[0].distro.layouts()
        return distro_results_from_transmittable(
            received, layouts, require_1bit=self.settings.quantize_1bit
        )
