"""Hostile run members, for tests and benchmarks: well-formed results that lie.

A `HostileMember` rewrites a member's honest results of a round (one `DistroResult` per
parameter, as `Distro.generate` or `Diloco.end_round` make them, 1-bit when the run quantizes)
into a payload that passes every check a receiver makes of its bytes (`serialized_distro`,
`diloco.codec.validate`): right kinds, shapes, index ranges and value bounds. What it sends:

| attack | payload |
|---|---|
| `SignFlip` | the honest update negated |
| `RandomSigns` | the honest magnitudes with random signs |
| `Scaled` | the honest update scaled up to the format's bound (65,536 for DiLoCo; 1-bit DisTrO has no magnitude to scale: the payload is the honest one, x1000 for unquantized DisTrO) |
| `Zero` | a free rider: the encoding of a zero update (for 1-bit DisTrO, the bits that encoding gives) |
| `Copy` | another member's result of the same round, tensor for tensor |
| `Replay` | what it sent `replay_lag` rounds earlier (honest results until it has sent that many) |
| `Targeted` | one fixed random direction every round, at the honest update's norm per parameter |
| `Lazy` | its honest result on `lazy_fraction` of its batch: the caller trains on `lazy_rows(n)` rows (`lazy_fraction=0.5`: the issue's "half batch") |
| `OtherData` | its honest result on a batch other than its assignment: the caller trains on `training_batch(assigned, other)` |
| `Bias` | its honest update plus `bias_fraction` (1 %) of its norm in one fixed random direction, per parameter (1-bit DisTrO: the signs of the payload's coefficients set to the direction's, those where that moves the update most first, until the update has moved that far along it) |

`HostileMembers` plays them in the research simulations (`PeerSimulation(hostile=...)`,
`DilocoPeerSimulation(hostile=...)`; the poisoning benchmark, `scripts/bench/poison.py`), and
`make_hostile(trainer, member)` turns a client's trainer into a hostile one (tests). No command
reaches this module (an import-linter contract keeps it so).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import DilocoTransmission
from psyche.modeling.compression import compress, decompress_idx
from psyche.modeling.diloco.codec import (
    MAX_ABS_VALUE,
    DilocoLayout,
    _bf16_bytes,
    _levels,
    _pack_codes,
    _unpack_codes,
    decode,
    encode,
    entry_values,
)
from psyche.modeling.diloco.optimizer import Diloco
from psyche.modeling.distro import (
    Distro,
    DistroResult,
    quantize_nozeros_tensor_to_boolean_sign,
    unpack_tensor_sign_from_boolean,
)
from psyche.modeling.serialized_distro import transmittable_distro_result
from psyche.modeling.train_loop import rows
from psyche.modeling.trainer import Batch, PreparedResult, Trainer, TrainOutput

_CPU = torch.device("cpu")


class Attack(enum.Enum):
    SignFlip = "sign-flip"
    RandomSigns = "random-signs"
    Scaled = "scaled"
    Zero = "zero"
    Copy = "copy"
    Replay = "replay"
    Targeted = "targeted"
    Lazy = "lazy"
    OtherData = "other-data"
    Bias = "bias"


# --------------------------------------------------------------------------------------------
# What a payload entry means, per format


class PayloadFormat:
    """The operations an attack needs on one run's payload entries."""

    def negate(self, r: DistroResult, i: int) -> DistroResult:
        raise NotImplementedError

    def random_signs(self, r: DistroResult, i: int, g: torch.Generator) -> DistroResult:
        raise NotImplementedError

    def at_bound(self, r: DistroResult, i: int) -> DistroResult:
        raise NotImplementedError

    def norm(self, r: DistroResult, i: int) -> float:
        """The entry's L2 norm (its decoded update's)."""
        raise NotImplementedError

    def encode_dense(self, x: torch.Tensor, i: int) -> DistroResult:
        """A dense update of parameter `i`'s shape in this format."""
        raise NotImplementedError

    def shape(self, i: int) -> tuple[int, ...]:
        raise NotImplementedError

    def biased(
        self, r: DistroResult, i: int, direction: torch.Tensor, fraction: float
    ) -> DistroResult:
        """The entry's update plus `fraction` of its norm along `direction` (a unit tensor of
        the parameter's shape)."""
        raise NotImplementedError


def _random_bool(shape: Sequence[int], g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, tuple(shape), generator=g).bool()


class DistroFormat(PayloadFormat):
    """DisTrO's results: top-k DCT coefficients per block, 1-bit signs when `quantize_1bit`."""

    def __init__(self, distro: Distro, quantize_1bit: bool) -> None:
        self.distro = distro
        self.quantize_1bit = quantize_1bit

    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.distro.variables[i][1].shape)

    def _with(self, r: DistroResult, val: torch.Tensor) -> DistroResult:
        return _entry(r, r.sparse_idx.clone(), val)

    def negate(self, r: DistroResult, i: int) -> DistroResult:
        v = r.sparse_val
        return self._with(r, ~v if v.dtype == torch.bool else -v)

    def random_signs(self, r: DistroResult, i: int, g: torch.Generator) -> DistroResult:
        v = r.sparse_val
        flips = _random_bool(v.shape, g)
        if v.dtype == torch.bool:
            return self._with(r, v ^ flips)
        return self._with(r, torch.where(flips, -v, v))

    def at_bound(self, r: DistroResult, i: int) -> DistroResult:
        v = r.sparse_val
        if v.dtype == torch.bool:  # every 1-bit value is already +-1: nothing to scale
            return self._with(r, v.clone())
        return self._with(r, v * 1000.0)

    def norm(self, r: DistroResult, i: int) -> float:
        v = r.sparse_val
        if v.dtype == torch.bool:
            return math.sqrt(v.numel())
        return float(torch.linalg.vector_norm(v.float()))

    def encode_dense(self, x: torch.Tensor, i: int) -> DistroResult:
        p = self.distro.variables[i][1]
        coefficients = self.distro.transform.encode(x.to(p.dtype))
        idx, val, xshape, totalk = compress(coefficients, self.distro.compression_topk)
        if self.quantize_1bit:
            val = quantize_nozeros_tensor_to_boolean_sign(val)
        return DistroResult(idx, val, xshape, totalk)

    def biased(
        self, r: DistroResult, i: int, direction: torch.Tensor, fraction: float
    ) -> DistroResult:
        # the direction in the DCT domain (orthonormal: still a unit vector), at the payload's
        # positions, block by block
        p = self.distro.variables[i][1]
        coefficients = self.distro.transform.encode(direction.to(p.dtype)).float()
        idx = decompress_idx(r.totalk, r.sparse_idx)
        along = coefficients.reshape(*idx.shape[:-1], -1).gather(-1, idx)
        v = r.sparse_val
        if v.dtype != torch.bool:
            size = float(torch.linalg.vector_norm(v.float()))
            norm = float(torch.linalg.vector_norm(along))
            shift = along * (fraction * size / norm) if norm > 0.0 else along * 0.0
            return self._with(r, (v.float() + shift).to(v.dtype))
        signs = unpack_tensor_sign_from_boolean(v, torch.float32)
        # setting a sign that disagrees with the direction moves the update 2|d_i| along it
        gain = torch.where(signs * along < 0, 2.0 * along.abs(), torch.zeros_like(along))
        order = gain.reshape(-1).argsort(descending=True)
        moved = gain.reshape(-1)[order].cumsum(0)
        count = int(torch.searchsorted(moved, fraction * math.sqrt(v.numel()))) + 1
        flat = signs.reshape(-1).clone()
        chosen = order[: min(count, int((gain > 0).sum()))]
        flat[chosen] = along.reshape(-1)[chosen].sign()
        return self._with(r, quantize_nozeros_tensor_to_boolean_sign(flat.reshape(v.shape)))


class DilocoFormat(PayloadFormat):
    """DiLoCo's pseudo-gradients in one of the three sent forms (`diloco.codec`)."""

    def __init__(self, layouts: Sequence[DilocoLayout]) -> None:
        self.layouts = list(layouts)

    def shape(self, i: int) -> tuple[int, ...]:
        return self.layouts[i].shape

    def negate(self, r: DistroResult, i: int) -> DistroResult:
        layout = self.layouts[i]
        if layout.transmission is DilocoTransmission.Sparse:
            return self._map_codes(r, layout, lambda codes, levels: levels - codes)
        return _entry(r, r.sparse_idx.clone(), -r.sparse_val)  # bf16 values, int8 codes

    def random_signs(self, r: DistroResult, i: int, g: torch.Generator) -> DistroResult:
        layout = self.layouts[i]
        if layout.transmission is DilocoTransmission.Sparse:

            def flip(codes: torch.Tensor, levels: int) -> torch.Tensor:
                return torch.where(_random_bool(codes.shape, g), levels - codes, codes)

            return self._map_codes(r, layout, flip)
        v = r.sparse_val
        return _entry(r, r.sparse_idx.clone(), torch.where(_random_bool(v.shape, g), -v, v))

    def at_bound(self, r: DistroResult, i: int) -> DistroResult:
        layout = self.layouts[i]
        match layout.transmission:
            case DilocoTransmission.Bf16:
                v = r.sparse_val.float()
                peak = float(v.abs().max()) if v.numel() else 0.0
                scaled = v * (MAX_ABS_VALUE / peak) if peak > 0 else v
                return _entry(
                    r, r.sparse_idx.clone(), scaled.clamp(-MAX_ABS_VALUE, MAX_ABS_VALUE).bfloat16()
                )
            case DilocoTransmission.Int8:
                scales = torch.full_like(r.sparse_idx, MAX_ABS_VALUE / 127.0)
                return _entry(r, scales, r.sparse_val.clone())
            case _:
                rows = r.sparse_val.reshape(-1, layout.row_bytes).clone()
                rows[:, :2] = _bf16_bytes(torch.full((rows.shape[0],), MAX_ABS_VALUE))
                return _entry(r, r.sparse_idx.clone(), rows.reshape(r.sparse_val.shape))

    def norm(self, r: DistroResult, i: int) -> float:
        return float(torch.linalg.vector_norm(entry_values(r, self.layouts[i], _CPU)))

    def encode_dense(self, x: torch.Tensor, i: int) -> DistroResult:
        return encode(x.float(), self.layouts[i])

    def biased(
        self, r: DistroResult, i: int, direction: torch.Tensor, fraction: float
    ) -> DistroResult:
        update = decode(r, self.layouts[i], _CPU)
        size = float(torch.linalg.vector_norm(update))
        return self.encode_dense(update + direction * (fraction * size), i)

    @staticmethod
    def _map_codes(
        r: DistroResult, layout: DilocoLayout, fn: Callable[[torch.Tensor, int], torch.Tensor]
    ) -> DistroResult:
        assert layout.sparse is not None
        k = layout.sparse.topk
        rows = r.sparse_val.reshape(-1, layout.row_bytes)
        codes = _unpack_codes(rows[:, 2:], layout.value_bits, k)[:, :k]
        new = fn(codes, _levels(layout.value_bits))
        packed = _pack_codes(new, layout.value_bits)
        out = torch.cat([rows[:, :2], packed], 1).reshape(r.sparse_val.shape)
        return _entry(r, r.sparse_idx.clone(), out)


def _entry(r: DistroResult, idx: torch.Tensor, val: torch.Tensor) -> DistroResult:
    return DistroResult(idx, val, list(r.xshape), r.totalk)


# --------------------------------------------------------------------------------------------
# The member


@dataclass
class HostileMember:
    """One hostile member's behaviour over a run (see the module docstring).

    `tamper` is called once per round with the member's honest results (in their sent form) and,
    for `Copy`, the results other members published that round; it returns what the member
    sends. Randomness comes from `seed` alone.
    """

    attack: Attack
    seed: int = 0
    start: int = 0
    """Rounds it plays honest before it starts lying."""
    replay_lag: int = 2
    lazy_fraction: float = 0.25
    bias_fraction: float = 0.01
    """`Bias`: the bias's norm as a fraction of the honest update's."""
    copy_from: int = 0
    """`Copy`: which of the other members' results to copy (an index into `others`)."""
    rounds: int = 0
    """Rounds it has sent so far."""
    lies: list[int] = field(default_factory=list)
    """The rounds (from 0) whose result was a lie."""
    _history: list[list[DistroResult]] = field(default_factory=list, repr=False)
    _direction: list[torch.Tensor] | None = field(default=None, repr=False)
    _generator: torch.Generator | None = field(default=None, repr=False)

    @property
    def lying(self) -> bool:
        """Whether its next round's result will be a lie."""
        return self.rounds >= self.start

    def lazy_rows(self, rows: int) -> int:
        """How many of its `rows` a `Lazy` member trains on (all of them otherwise)."""
        if self.attack is not Attack.Lazy or not self.lying:
            return rows
        return max(1, round(rows * self.lazy_fraction))

    def training_batch(self, assigned: Batch, other: Batch) -> Batch:
        """What it trains on when assigned `assigned`: `other` (another batch of the round that
        no one was assigned) for `OtherData`, its first `lazy_rows` rows for `Lazy`, else
        `assigned`."""
        if self.attack is Attack.OtherData and self.lying:
            return other
        return rows(assigned, 0, self.lazy_rows(len(assigned)))

    def tamper(
        self,
        results: Sequence[DistroResult],
        fmt: PayloadFormat,
        others: Sequence[Sequence[DistroResult]] = (),
    ) -> list[DistroResult]:
        honest = [_clone(r) for r in results]
        sent = self._lie(honest, fmt, others) if self.lying else None
        if sent is None:
            sent = honest
        else:
            self.lies.append(self.rounds)
        self.rounds += 1
        self._history.append([_clone(r) for r in sent])
        del self._history[: -self.replay_lag]
        return sent

    def _lie(
        self,
        honest: list[DistroResult],
        fmt: PayloadFormat,
        others: Sequence[Sequence[DistroResult]],
    ) -> list[DistroResult] | None:
        """What it sends instead of `honest`; None when this attack has nothing yet (a copier
        without others' results, a replayer without a past)."""
        g = self._rng()
        match self.attack:
            case Attack.SignFlip:
                return [fmt.negate(r, i) for i, r in enumerate(honest)]
            case Attack.RandomSigns:
                return [fmt.random_signs(r, i, g) for i, r in enumerate(honest)]
            case Attack.Scaled:
                return [fmt.at_bound(r, i) for i, r in enumerate(honest)]
            case Attack.Zero:
                return [fmt.encode_dense(torch.zeros(fmt.shape(i)), i) for i in range(len(honest))]
            case Attack.Copy:
                if not others:
                    return None
                return [_clone(r) for r in others[self.copy_from % len(others)]]
            case Attack.Replay:
                if len(self._history) < self.replay_lag:
                    return None
                return [_clone(r) for r in self._history[0]]
            case Attack.Targeted:
                direction = self._fixed_direction(fmt, len(honest))
                out = []
                for i, (r, d) in enumerate(zip(honest, direction)):
                    size = fmt.norm(r, i)
                    out.append(fmt.encode_dense(d * size, i))
                return out
            case Attack.Lazy | Attack.OtherData:
                return honest  # the lie is in the training (`lazy_rows`, `training_batch`)
            case Attack.Bias:
                direction = self._fixed_direction(fmt, len(honest))
                return [
                    fmt.biased(r, i, d, self.bias_fraction)
                    for i, (r, d) in enumerate(zip(honest, direction))
                ]
        raise ValueError(f"unknown attack {self.attack!r}")

    def _rng(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        return self._generator

    def _fixed_direction(self, fmt: PayloadFormat, count: int) -> list[torch.Tensor]:
        if self._direction is None:
            g = torch.Generator().manual_seed(self.seed + 1)
            direction = []
            for i in range(count):
                d = torch.randn(fmt.shape(i), generator=g)
                direction.append(d / max(float(torch.linalg.vector_norm(d)), 1e-12))
            self._direction = direction
        return self._direction


def _clone(r: DistroResult) -> DistroResult:
    return DistroResult(r.sparse_idx.clone(), r.sparse_val.clone(), list(r.xshape), r.totalk)


class HostileMembers:
    """The hostile members of a simulated run, by member index: what a simulation calls once a
    round with every member's sent results (`RoundTamper` in `psyche.modeling.research`)."""

    def __init__(self, members: Mapping[int, HostileMember]) -> None:
        self.members = dict(members)
        self.indices = frozenset(self.members)
        self.late = frozenset(i for i, m in self.members.items() if m.attack is Attack.Copy)
        """Members whose results arrive after the others' (a copier needs its victim's)."""
        self._format: PayloadFormat | None = None

    def lazy_rows(self, member: int, rows: int) -> int:
        hostile = self.members.get(member)
        return rows if hostile is None else hostile.lazy_rows(rows)

    def __call__(
        self, sent: Sequence[Sequence[DistroResult]], source: Distro | Diloco
    ) -> list[list[DistroResult]]:
        fmt = self._format_for(sent, source)
        honest = [i for i in range(len(sent)) if i not in self.indices]
        out = [list(r) for r in sent]
        for i, member in self.members.items():
            if i < len(sent):
                out[i] = member.tamper(sent[i], fmt, [sent[j] for j in honest])
        return out

    def _format_for(
        self, sent: Sequence[Sequence[DistroResult]], source: Distro | Diloco
    ) -> PayloadFormat:
        if self._format is None:
            if isinstance(source, Diloco):
                self._format = DilocoFormat(source.layouts())
            else:
                one_bit = bool(sent and sent[0] and sent[0][0].sparse_val.dtype == torch.bool)
                self._format = DistroFormat(source, one_bit)
        return self._format


def payload_format(trainer: Trainer) -> PayloadFormat:
    """The format of the results `trainer` sends (DisTrO's, 1-bit or not, or DiLoCo's form)."""
    if trainer.diloco is not None:
        return DilocoFormat(trainer.diloco.layouts())
    if trainer.distro is None:
        raise ValueError("the trainer's optimizer sends no results")
    return DistroFormat(trainer.distro, trainer.quantize_1bit)


def make_hostile(trainer: Trainer, member: HostileMember) -> None:
    """From now on `trainer` commits to and sends what `member` makes of its honest results (a
    hostile client: its payloads hash to their commitments and pass every check of their bytes).
    Its own error feedback stays honest (`OwnResult.original`)."""
    prepare = trainer.prepare_result
    fmt = payload_format(trainer)

    def prepare_hostile(out: TrainOutput, *, step: int, batch_id: BatchId) -> PreparedResult:
        honest = prepare(out, step=step, batch_id=batch_id)
        sent = member.tamper(honest.sent, fmt)
        payload = transmittable_distro_result(sent, step, out.nonce, batch_id)
        return PreparedResult(payload, payload.compute_hash(), sent)

    setattr(trainer, "prepare_result", prepare_hostile)  # noqa: B010 (mypy forbids method assignment)
