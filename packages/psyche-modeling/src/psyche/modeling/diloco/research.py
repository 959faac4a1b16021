"""DiLoCo outside the Psyche client: a plain training loop, and N simulated peers.

Each replica takes inner AdamW steps on its own data; every `inner_steps` calls of `step` ends a
round: each replica turns its pseudo-gradient into a payload (through the postcard wire, its
commitment hash and the receiver's checks with `through_wire`), and the outer step is taken on
every replica with the payloads that are due. With `overlap` (the default, Psyche's timing) a
round's payloads are applied after the next round has trained, as a Psyche client applies round
N - 2 at the start of round N; without it, at once (the DiLoCo paper's timing). With `overlap`
each replica starts its inner steps from the run's weights shifted by its estimate of the outer
step still pending (`lookahead`, as the client's trainer does; see `Diloco.begin_round`).

    sim = DilocoPeerSimulation([model_a, model_b, model_c], DilocoSettings(inner_steps=8), lr=1e-3)
    for step in range(1, n + 1):
        sim.zero_grad()
        for m, batch in zip(sim.models, shards(step)):
            m(**batch).loss.backward()
        sim.step(step)           # an inner step on every replica; an outer one every 8th call
    sim.flush(n)                 # apply what is still in flight

Between rounds a replica holds its inner steps' starting point (the run's weights shifted by
the lookahead); `flush` leaves every replica with the run's weights. `DilocoLoop` is the same
with one model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from psyche.modeling.adamw import LibtorchAdamW
from psyche.modeling.diloco.optimizer import Diloco, DilocoSettings
from psyche.modeling.distro import DistroResult
from psyche.modeling.lr import Schedule, lr_function
from psyche.modeling.research import ResultExchange, clip_gradients
from psyche.modeling.screening import RoundTamper, ScreeningSettings
from psyche.modeling.serialized_distro import TransmittableDistroResult


def _base_lr(lr: object) -> float | None:
    if isinstance(lr, int | float):
        return float(lr)
    value = getattr(getattr(lr, "value", lr), "base_lr", None)
    return None if value is None else float(value)


class _Replica:
    def __init__(self, model: nn.Module, settings: DilocoSettings, base_lr: float | None) -> None:
        self.model = model
        self.settings = settings
        self.diloco = Diloco(model, settings, base_lr=base_lr)
        self.inner = LibtorchAdamW(
            self.diloco.params,
            betas=settings.inner_betas,
            weight_decay=settings.inner_weight_decay,
            eps=settings.inner_eps,
        )

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def inner_step(self, lr: float) -> None:
        clip_gradients(self.diloco.params, self.settings.inner_clip_grad_norm)
        self.inner.step(lr)
        self.inner.zero_grad()


class DilocoPeerSimulation(ResultExchange):
    """N DiLoCo replicas in one process (see the module docstring).

    `last_payload_bytes` holds the size of each replica's last payload when `through_wire`.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        settings: DilocoSettings | None = None,
        *,
        lr: float | Schedule | Callable[[int], float],
        through_wire: bool = False,
        overlap: bool = True,
        lookahead: bool = True,
        hostile: RoundTamper | None = None,
        screening: ScreeningSettings | None = None,
    ) -> None:
        if not models:
            raise ValueError("at least one replica is needed")
        self.settings = settings or DilocoSettings()
        self.lr = lr_function(lr)
        self.overlap = overlap
        self.lookahead = lookahead and overlap
        self.replicas = [_Replica(m, self.settings, _base_lr(lr)) for m in models]
        self.outer_steps = 0
        self._inner = 0
        self._round = 0
        self._in_flight: list[list[list[DistroResult]]] = []
        for r in self.replicas:
            r.diloco.begin_round(self._round)
        super().__init__(
            self.replicas,
            [r.diloco for r in self.replicas],
            through_wire=through_wire,
            hostile=hostile,
            screening=screening,
        )

    def zero_grad(self, step: int | None = None) -> None:
        """Zero every replica's gradients (`step` is accepted, and unused, as in DisTrO's
        `PeerSimulation.zero_grad`)."""
        for r in self.replicas:
            r.zero_grad()

    @torch.no_grad()
    def step(self, step: int) -> bool:
        """An inner step on every replica; at the round's last one, the round ends (payloads
        out, the due outer step taken). Returns whether a round ended."""
        lr = self.lr(step)
        for r in self.replicas:
            r.inner_step(lr)
        self._inner += 1
        if self._inner < self.settings.inner_steps:
            return False
        self._inner = 0
        sent = [r.diloco.end_round(self._round) for r in self.replicas]
        self._in_flight.append(self._exchange(sent, step))
        if not self.overlap or len(self._in_flight) > 1:
            self._apply(self._in_flight.pop(0), lr)
        self._round += 1
        for r in self.replicas:
            ahead = r.diloco.outer_lr(lr) if self.lookahead else 0.0
            r.diloco.begin_round(self._round, lookahead_lr=ahead)
        return True

    @torch.no_grad()
    def flush(self, step: int) -> None:
        """Apply every round still in flight (an epoch's last rounds do this in Psyche)."""
        lr = self.lr(step)
        for r in self.replicas:
            r.diloco.abort_round()
        while self._in_flight:
            self._apply(self._in_flight.pop(0), lr)
        self._round += 2  # nothing is pending any more: no lookahead next round
        for r in self.replicas:
            r.diloco.begin_round(self._round)

    def _apply(self, payloads: list[list[DistroResult]], lr: float) -> None:
        for r in self.replicas:
            r.diloco.apply(payloads, r.diloco.outer_lr(lr))
        self.outer_steps += 1

    def _from_wire(self, received: TransmittableDistroResult) -> list[DistroResult]:
        return self.replicas[0].diloco.results_from_transmittable(received)


class DilocoLoop(DilocoPeerSimulation):
    """DiLoCo for one model in a plain loop: `zero_grad`, backward, `step(step)`."""

    def __init__(
        self,
        model: nn.Module,
        settings: DilocoSettings | None = None,
        *,
        lr: float | Schedule | Callable[[int], float],
        through_wire: bool = False,
        overlap: bool = True,
    ) -> None:
        super().__init__([model], settings, lr=lr, through_wire=through_wire, overlap=overlap)

    @property
    def diloco(self) -> Diloco:
        return self.replicas[0].diloco
