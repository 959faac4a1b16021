"""Trainers of a run and one verifier in one process, as Psyche clients run them (tests and the
verification benchmark, `scripts/bench/verify.py`; no command reaches this module).

Every round each member trains its assigned batch with `Trainer.train_exact` (its own DisTrO
momentum or DiLoCo residual and lookahead, as a client), publishes `prepare_result`'s payload
(a hostile member's rewritten by `psyche.modeling.hostile`, or trained on other rows), and the
verifier, holding the run's weights of the round, decodes each payload as every client does
(`Trainer.results_from_payload`) and verifies it as `verification.verify_result` does
(`recompute`, then `compare`), each batch recomputed once and the next member's recompute its
decoy. With `shadow_from`, the verifier instead follows each member it saw from its first round
(`verification.Shadow`: the member's own optimizer state, advanced every round the member trains)
and compares its payload exactly (`verification.verify_exact`); a member that trained before the
verifier started following is compared statistically, as above. Then every trainer and the verifier
apply the round's results that the verifier did not refuse, one round late, as clients do
(`train_loop`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from psyche.core.batch_id import BatchId
from psyche.modeling.distro import DistroResult
from psyche.modeling.hostile import HostileMember, make_hostile
from psyche.modeling.serialized_distro import TransmittableDistroResult
from psyche.modeling.trainer import Batch, Trainer
from psyche.modeling.verification import (
    Domain,
    Evidence,
    Shadow,
    ShadowVerdict,
    VerificationSettings,
    VerificationVerdict,
    compare,
    domain_of,
    recompute,
    result_reader,
    verification_settings,
    verify_exact,
)


@dataclass
class VerifiedRound:
    step: int
    verdicts: dict[int, VerificationVerdict]
    """Each member's verdict of the round (after its `Evidence`)."""
    single: dict[int, VerificationVerdict]
    """Each member's verdict of the round alone."""
    train_seconds: float
    """The members' mean `train_exact` time (CPU seconds of the process: on a loaded machine
    wall time measures the neighbours)."""
    verify_seconds: float
    """The verifier's mean time per verification (its recomputes and comparisons; CPU
    seconds of the process, all its threads)."""
    domains: dict[int, Domain] = field(default_factory=dict)
    """Each verified member's recompute in the payloads' domain (its decoy: the next one's)."""
    published: dict[int, list[DistroResult]] = field(default_factory=dict)
    """Each verified member's result as the verifier decoded it."""
    exact: dict[int, ShadowVerdict] = field(default_factory=dict)
    """Each member the verifier follows (`shadow_from`): its exact verdict (the one that
    decides; its statistical one is not computed)."""


@dataclass
class VerificationRun:
    """`trainers` (the members, all at the same weights) and `verifier` (a trainer of the same
    run at the same weights); `batch(step, i)` is member `i`'s assignment of `step`, and
    `batch(step, len(trainers))` a batch of the round no one was assigned (what an
    `OtherData` member trains on). `verifier_threads`: the verifier's torch threads (a verifier
    whose intra-op parallelism differs from the trainers')."""

    trainers: Sequence[Trainer]
    verifier: Trainer
    batch: Callable[[int, int], Batch]
    hostile: Mapping[int, HostileMember] = field(default_factory=dict)
    settings: VerificationSettings | None = None
    verifier_threads: int | None = None
    sits_out: Callable[[int, int], bool] | None = None
    """Whether member `i` sits `step` out (a round it is a verifier or tie-breaker: it trains
    nothing and applies the round as every client). As a client does
    (`psyche.client.round.train.own_results_to_subtract`), it keeps the own results of the last
    round it trained and subtracts them the next round it trains (the simulated run is one
    epoch: nothing zeroes them)."""
    split_order: Callable[[int, int], Sequence[int]] | None = None
    """The order of member `i`'s rows at `step` whose halves the recompute compares (None: the
    micro-batches' halves, `split_rows`)."""
    shadow_from: int | None = None
    """The step from which the verifier follows members with a `Shadow` and compares them
    exactly (None: never): those whose first round it sees; one that trained before it is
    compared statistically (a shadow cannot start mid-life)."""
    evidence: dict[int, Evidence] = field(default_factory=dict)
    shadows: dict[int, Shadow] = field(default_factory=dict)
    _trained: set[int] = field(default_factory=set)
    _prev: list[list[DistroResult]] = field(default_factory=list)
    _pending: list[list[DistroResult]] | None = None

    def __post_init__(self) -> None:
        for i, member in self.hostile.items():
            make_hostile(self.trainers[i], member)
        self.settings = self.settings or verification_settings(self.verifier)
        self._prev = [[] for _ in self.trainers]

    def round(self, step: int) -> VerifiedRound:
        n = len(self.trainers)
        published: list[list[DistroResult]] = []
        payloads: dict[int, TransmittableDistroResult] = {}
        train_seconds = 0.0
        other = self.batch(step, n)
        sitting = {i for i in range(n) if self.sits_out is not None and self.sits_out(step, i)}
        for i, trainer in enumerate(self.trainers):
            if i in sitting:
                published.append([])
                continue
            assigned = self.batch(step, i)
            member = self.hostile.get(i)
            rows = member.training_batch(assigned, other) if member else assigned
            cpu = time.process_time()
            out = trainer.train_exact(
                step,
                rows,
                warmup_lr_between=None,
                zero_optim=False,
                prev_self_distro_results=[self._prev[i]] if self._prev[i] else [],
            )
            train_seconds += time.process_time() - cpu
            prepared = trainer.prepare_result(out, step=step, batch_id=BatchId(i, i))
            self._prev[i] = out.distro_results or []
            payloads[i] = prepared.payload
            published.append(self.verifier.results_from_payload(prepared.payload))
        started = time.process_time()
        exact = self._follow(step, payloads)
        verdicts, single, domains = self._verify(step, published, sitting, set(exact))
        verify_seconds = (time.process_time() - started) / max(len(verdicts) + len(exact), 1)
        self._trained.update(payloads)
        for trainer in [*self.trainers, self.verifier]:
            trainer.decay_weights(step, warmup_lr_between=None)  # the step's, on every client
            if self._pending is not None:
                trainer.optimize(step, distro_results=self._pending)
        # a refused result is not applied (the protocol removes the trainer it caught)
        accepted = {i for i in verdicts if verdicts[i].matches}
        accepted |= {i for i in exact if exact[i].matches}
        self._pending = [published[i] for i in sorted(accepted)]
        trained = max(n - len(sitting), 1)
        return VerifiedRound(
            step,
            verdicts,
            single,
            train_seconds / trained,
            verify_seconds,
            domains,
            {i: list(published[i]) for i in verdicts},
            exact,
        )

    def _follow(
        self, step: int, payloads: Mapping[int, TransmittableDistroResult]
    ) -> dict[int, ShadowVerdict]:
        """The exact verdicts of the members the verifier follows; starts a shadow for each
        member whose first round this is, from `shadow_from` on."""
        if self.shadow_from is None or step < self.shadow_from:
            return {}
        with self._verifier_threads():
            out = {}
            for i, payload in payloads.items():
                if i not in self.shadows and i not in self._trained:
                    self.shadows[i] = Shadow.fresh(self.verifier)
                if i in self.shadows:
                    shadow = self.shadows[i]
                    out[i] = verify_exact(self.verifier, shadow, self.batch(step, i), payload)
            return out

    @contextmanager
    def _verifier_threads(self) -> Iterator[None]:
        before = torch.get_num_threads()
        if self.verifier_threads is not None:
            torch.set_num_threads(self.verifier_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _verify(
        self,
        step: int,
        published: Sequence[Sequence[DistroResult]],
        sitting: set[int],
        exact: set[int],
    ) -> tuple[dict[int, VerificationVerdict], dict[int, VerificationVerdict], dict[int, Domain]]:
        """The statistical verdicts of the members that trained and are not in `exact`; the
        decoys are the next trained member's recomputes, whether or not it is followed."""
        members = [i for i in range(len(self.trainers)) if i not in sitting]
        if not set(members) - exact:
            return {}, {}, {}
        with self._verifier_threads():
            verifier, settings = self.verifier, self.settings
            assert settings is not None
            reader = result_reader(verifier)
            domains = {
                i: domain_of(
                    verifier,
                    recompute(verifier, self.batch(step, i), step=step, order=self._order(step, i)),
                )
                for i in members
            }
            verdicts, single = {}, {}
            for k, i in enumerate(members):
                if i in exact:
                    continue
                decoy = domains[members[(k + 1) % len(members)]]
                verdict = compare(reader, domains[i], decoy, published[i], settings)
                single[i] = verdict
                verdicts[i] = self.evidence.setdefault(i, Evidence(settings)).add(verdict)
            return verdicts, single, domains

    def _order(self, step: int, i: int) -> Sequence[int] | None:
        return None if self.split_order is None else self.split_order(step, i)


FORMS = ("distro", "bf16", "int8", "sparse")
"""The run optimizers `tiny_trainer` builds: DisTrO 1-bit c16 k4, DiLoCo in each sent form."""


def tiny_trainer(
    form: str, *, lr: float | None = None, inner_steps: int = 2, preset: str = "tiny"
) -> Trainer:
    """A trainer of the tiny Llama (or another `configs.PRESETS` size; random init, seed 1337:
    every member the same) with `form`'s optimizer (`FORMS`), micro-batches of 2 rows; nothing
    is downloaded."""
    from psyche.core.definitions import (
        ConstantLR,
        DilocoTransmission,
        LearningRateSchedule,
        OptimizerDefinition,
    )
    from psyche.modeling.causal_lm import CausalLM, ModelOptions
    from psyche.modeling.configs import llama_config_dict
    from psyche.modeling.diloco.optimizer import DilocoSettings
    from psyche.modeling.research import DistroSettings

    model = CausalLM.from_config(
        llama_config_dict(preset), ModelOptions(architecture="HfLlama", device="cpu", seed=1337)
    )
    optimizer: OptimizerDefinition
    if form == "distro":
        settings = DistroSettings(compression_chunk=16, compression_topk=4, clip_grad_norm=1.0)
        optimizer = OptimizerDefinition.Distro(settings.definition())
        lr = 1e-3 if lr is None else lr
    else:
        transmission = {
            "bf16": DilocoTransmission.Bf16,
            "int8": DilocoTransmission.Int8,
            "sparse": DilocoTransmission.Sparse,
        }[form]
        diloco = DilocoSettings(
            inner_steps=inner_steps,
            transmission=transmission,
            value_bits=2,
            compression_chunk=64 if form == "int8" else 16,
            compression_topk=8,
            outer_lr=0.7,
            outer_momentum=0.5,
        )
        optimizer = OptimizerDefinition.DiLoCo(diloco.definition())
        lr = 3e-3 if lr is None else lr
    schedule = LearningRateSchedule.Constant(ConstantLR(lr, 0.0, 0))
    return Trainer(model, schedule, optimizer, micro_batch_size=2)
