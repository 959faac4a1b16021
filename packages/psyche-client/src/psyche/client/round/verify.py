"""A verifier's and a tie-breaker's round (issue 27; `psyche.coordinator.verification` says who
verifies whom, `psyche.modeling.verification` how a result is recomputed and compared).

`plan_verification` is plain: from the coordinator state it derives this client's duties in the
round (none unless it is the round's verifier or tie-breaker in a run with
`verification_percent > 0`; a verifier's are the batches of its pool its own draw signature
draws, `psyche.coordinator.verification.draw_batches`, and the job keeps the signature for the
report) and, for each duty, a decoy batch of the same round that the
verified trainer was not assigned (the comparison reads the payload along the difference of the
two recomputed updates; `psyche.modeling.verification.verify_result`).

A tie-breaker's round is different (`psyche.coordinator.verification`: it recomputes only the
disputed batches, one round later). In its round N it recomputes nothing: right after the apply
it keeps one copy of the weights (`HeldRound`, `save_weights`; the only copy it ever holds, and
only on tie-breakers). In round N + 1, right after that round's apply, it reads round N's reports
(`ClientIO.round_reports`, waiting at most `dispute_wait` for every verifier's), and for each
disputed batch of its duties swaps the saved weights in, recomputes the batch and its decoy,
swaps them back (bit for bit) and drops the copy (`recompute_disputes`); the comparison and the
report are a verifier's (`compare_and_report`, against round N's payloads). A round without a
dispute costs it the copy and one read of the reports.

The work is in two parts, because only the first needs the round's weights:

* `recompute_duties` runs inside the round's training step (`run_round`, right after the apply
  of round N - 2, when the model holds exactly the weights the round's trainers train from): it
  fetches each batch it needs and recomputes the round's own update of it (one training step of
  the batch each; the trainer's weights, gradients and optimizer state are left as they were).
  The round's end stops it (`TrainingStep.finish`, between micro-batches): a batch not finished
  is not reported. Where verifiers train too (`CoordinatorConfig.verifiers_train`), it runs after
  the client's own training instead (`run_round(verify_last=True)`: `train_exact` leaves the
  weights the round's, and the step's weight decay waits for it), so its result goes out as early
  as any trainer's and the checks use the round's idle time (its witness phase).
* `compare_and_report` runs afterwards on its own: it waits (until `deadline`) for each verified
  trainer's payload to be downloaded and checked, compares it with the recompute, and sends one
  `VerificationReport` with every finding (a non-matching one is an accusation), logging each
  (`verification` events: who was verified, what was found).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import trio

from psyche.client.observe.logs import log_event
from psyche.client.round.apply import ApplyError, wait_for_payload
from psyche.client.round.fetch import DataFetcher
from psyche.client.round.state import RoundState
from psyche.coordinator import Coordinator
from psyche.coordinator.data_selection import verification_duties_for_state
from psyche.coordinator.verification import (
    NO_DRAW,
    Finding,
    RoundDuties,
    RoundVerification,
    VerificationDuty,
    VerificationReport,
)
from psyche.core.batch_id import BatchId
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    from psyche.client.round.train import TrainingStep
    from psyche.modeling.trainer import Trainer
    from psyche.modeling.verification import Domain, SavedWeights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyJob:
    """This client's duties in round `step`: the batches it recomputes and compares, and the
    decoy each one is read against."""

    step: int
    duties: tuple[VerificationDuty, ...]
    decoys: Mapping[BatchId, BatchId]
    tie_breaker: bool
    warmup_lr_between: tuple[int, int] | None
    round: RoundDuties | None = None
    """Everyone's duties in the round (a tie-breaker reads its disputes against them)."""
    draw: bytes = NO_DRAW
    """A verifier's draw signature (`VerificationReport.draw`): which batches of its pool."""

    def batches(self) -> list[BatchId]:
        """Every batch to recompute, each once: the duties', then the decoys not among them."""
        out = [d.batch_id for d in self.duties]
        out += [b for b in dict.fromkeys(self.decoys.values()) if b not in out]
        return out


@dataclass
class Recomputations:
    """The recomputed updates of a round's batches, in the payloads' domain (by batch)."""

    domains: dict[BatchId, Domain] = field(default_factory=dict)


def plan_verification(
    state: Coordinator, identity: NodeIdentity, sign: Callable[[bytes], bytes] | None
) -> VerifyJob | None:
    """This client's verification duties in the coordinator's current round, or None. `sign`:
    the client's p2p key's signature, its draw as a verifier (without one, a verifier whose
    pool needs a draw does not verify: the coordinator would refuse its report)."""
    if state.config.verification_percent == 0:
        return None
    duties = verification_duties_for_state(state)
    checks = duties.checks(identity, sign)
    if checks is None:
        logger.warning("no key to draw this round's checks with: not verifying")
        return None
    mine, draw = tuple(checks[0]), checks[1]
    if not mine:
        return None
    assigned = dict(duties.assigned) or duties.trainers()
    own = [d.batch_id for d in mine]
    return VerifyJob(
        step=state.progress.step,
        duties=mine,
        decoys={d.batch_id: decoy_for(d, assigned, own) for d in mine},
        tie_breaker=duties.is_tie_breaker(identity),
        warmup_lr_between=state.get_cold_start_warmup_bounds(),
        round=duties,
        draw=draw,
    )


@dataclass
class HeldRound:
    """What a tie-breaker of round `job.step` keeps for the next round: its duties, the round's
    state (the payloads it will compare) and the weights the round trained from."""

    job: VerifyJob
    round_state: RoundState
    weights: SavedWeights


DISPUTE_WAIT_SECONDS = 3.0
"""The longest a tie-breaker waits, at the start of the next round, for the verifiers' reports of
its round (or the round's witness time, if longer): they normally arrive during the round's
witness phase; one later than this is not arbitrated (nobody is punished on one word)."""


async def hold_round(
    trainer: Trainer, job: VerifyJob, round_state: RoundState, reuse: SavedWeights | None
) -> HeldRound:
    """A tie-breaker's round: the weights it trains from saved (into `reuse`'s tensors, the
    last round's copy, when there is one), for the next round's disputes."""
    from psyche.modeling.verification import save_weights

    weights = await trio.to_thread.run_sync(save_weights, trainer, reuse)
    log_event(logger, "verification_held", quiet=True, step=job.step)
    return HeldRound(job, round_state, weights)


def disputes(job: VerifyJob, reports: Mapping[NodeIdentity, VerificationReport]) -> VerifyJob:
    """The part of a tie-breaker's `job` that the round's `reports` (accepted by the
    coordinator, and checked again here against the client's own derivation of the round:
    `RoundVerification.heard`) disputed, each duty with its decoy among the disputed first."""
    assert job.round is not None
    record, refused = RoundVerification.heard(job.round, reports)
    for sender, problem in refused:  # at most one per member of the round
        logger.warning(
            "step %d: a verification report of %s not heard: %s", job.step, sender, problem
        )
    disputed = set(record.disputed())
    duties = tuple(d for d in job.duties if d.batch_id in disputed)
    assigned = dict(job.round.assigned) or job.round.trainers()
    own = [d.batch_id for d in duties]
    return replace(
        job, duties=duties, decoys={d.batch_id: decoy_for(d, assigned, own) for d in duties}
    )


async def round_reports_when_settled(
    job: VerifyJob,
    read: Callable[[int], Awaitable[Mapping[NodeIdentity, VerificationReport]]],
    until: float,
    poll: float = 0.25,
) -> Mapping[NodeIdentity, VerificationReport]:
    """Round `job.step`'s accepted reports, once every verifier of the round has reported or
    at `until` (trio clock), whichever is first."""
    assert job.round is not None
    started = trio.current_time()
    while True:
        reports = await read(job.step)
        record = RoundVerification(job.round, dict(reports))
        if not record.awaited() or trio.current_time() >= until:
            log_event(
                logger,
                "verification_settled",
                quiet=True,
                step=job.step,
                waited=round(trio.current_time() - started, 3),
                missing=len(record.awaited()),
                disputed=len(record.disputed()),
            )
            return reports
        await trio.sleep(min(poll, max(0.0, until - trio.current_time())))


async def recompute_disputes(
    handle: TrainingStep,
    trainer: Trainer,
    held: HeldRound,
    reports: Mapping[NodeIdentity, VerificationReport],
    fetcher: DataFetcher,
    out: Recomputations,
) -> VerifyJob | None:
    """A tie-breaker's work in the round after `held`'s: the disputed part of its duties
    (`disputes`) recomputed into `out` from the saved weights (swapped in and back: the model
    is left bit for bit as it was). The job to compare and report, or None without a dispute."""
    from psyche.modeling.verification import swap_weights

    job = disputes(held.job, reports)
    if not job.duties:
        return None
    log_event(
        logger,
        "verification_disputes",
        step=job.step,
        text=f"tie-breaker, step {job.step}: recomputing {len(job.duties)} disputed "
        f"result(s) from the saved weights",
        batches=[str(d.batch_id) for d in job.duties],
    )
    await trio.to_thread.run_sync(swap_weights, trainer, held.weights)
    try:
        await recompute_duties(handle, trainer, job, fetcher, out, beside=True)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(swap_weights, trainer, held.weights)
    return job


def decoy_for(
    duty: VerificationDuty,
    trainers: Mapping[BatchId, NodeIdentity],
    own: Sequence[BatchId] = (),
) -> BatchId:
    """The decoy of a duty: the next batch (ascending, wrapping) that another trainer trained,
    among the verifier's own duties `own` first (recomputed anyway: two duties are each other's
    decoy), then among the round's batches (`trainers`: every batch and its trainer); with a
    single trainer, as many indices right after the round's data (a batch nobody trained this
    round)."""
    for candidates in (sorted(own), sorted(trainers)):
        start = candidates.index(duty.batch_id) if duty.batch_id in candidates else 0
        for batch in candidates[start + 1 :] + candidates[:start]:
            if trainers.get(batch, duty.trainer) != duty.trainer:
                return batch
    batches = sorted(trainers)
    last = batches[-1].end if batches else duty.batch_id.end
    size = duty.batch_id.end - duty.batch_id.start
    return BatchId(last + 1, last + 1 + size)


async def recompute_duties(
    handle: TrainingStep,
    trainer: Trainer,
    job: VerifyJob,
    fetcher: DataFetcher,
    out: Recomputations,
    *,
    beside: bool = False,
) -> None:
    """Recompute every batch `job` needs into `out` (see the module docstring); stops when the
    round's training step is finished. A failure ends this round's verification (logged), never
    the training step: the client's own duties go on. `beside`: its batches are fetched beside
    the round's own (a tie-breaker's disputes of the last round, in a round it may train)."""
    if trainer.distro is None and trainer.diloco is None:
        logger.warning("the run's optimizer sends no results to verify: not verifying")
        return
    fetch = fetcher.fetch_beside if beside else fetcher.fetch
    incoming = fetch(list(reversed(job.batches())))  # the fetcher pops from the end
    try:
        async with incoming:
            while (item := await handle.next_batch(incoming)) is not None:
                batch_id, batch = item

                def recompute_one(batch: Any = batch) -> Domain:
                    from psyche.modeling.verification import domain_of, recompute

                    recomputed = recompute(
                        trainer,
                        batch,
                        step=job.step,
                        warmup_lr_between=job.warmup_lr_between,
                        cancel=handle.cancel,
                    )
                    return domain_of(trainer, recomputed)

                out.domains[batch_id] = await trio.to_thread.run_sync(recompute_one)
                log_event(
                    logger, "verification_recomputed", quiet=True, step=job.step, batch_id=batch_id
                )
    except Exception as e:
        from psyche.modeling.verification import RecomputeCancelled

        if isinstance(e, RecomputeCancelled):  # the round ended first: nothing half-done counts
            # once a round at most; an operator sees that this verifier's checks do not fit
            logger.warning(
                "the round of step %d ended before its checks were recomputed: not verified",
                job.step,
            )
            return
        logger.exception("verification of step %d failed; this round is not verified", job.step)


def _published(round_state: RoundState, duty: VerificationDuty) -> bytes | None:
    """The blob hash of the result `duty.trainer` announced for its batch (its first)."""
    for entry in round_state.results.get(duty.batch_id, []):
        if entry.from_ == duty.trainer:
            return entry.result.ticket.hash
    return None


async def compare_and_report(
    trainer: Trainer,
    job: VerifyJob,
    recomputed: Recomputations,
    round_state: RoundState,
    deadline: float,
    send: Callable[[VerificationReport], None],
) -> VerificationReport:
    """Compare each recomputed duty with the trainer's payload (waiting until `deadline`, trio
    clock, for it to arrive), log each finding and `send` the round's report."""
    from psyche.modeling.verification import compare, result_reader, verification_settings

    reader = result_reader(trainer)
    settings = verification_settings(trainer)
    findings: list[Finding] = []
    for duty in job.duties:
        own = recomputed.domains.get(duty.batch_id)
        decoy = recomputed.domains.get(job.decoys[duty.batch_id])
        if own is None or decoy is None:
            continue  # not recomputed before the round ended: nothing to say
        blob_hash = None
        with trio.move_on_at(deadline):
            while (blob_hash := _published(round_state, duty)) is None:
                await round_state.results_announced.wait()
        if blob_hash is None:
            continue  # never announced: the witnesses' health checks deal with it
        try:
            handle = await wait_for_payload(round_state, blob_hash, deadline)
            published = handle.outcome().results
        except ApplyError:
            continue  # not downloaded in time: no finding
        except Exception as e:  # it does not decode: what it published is no result of it
            findings.append(Finding(duty.batch_id, False, 0.0))
            _log_finding(job, duty, False, 0.0, f"its payload does not decode: {e}")
            continue
        try:
            verdict = await trio.to_thread.run_sync(
                lambda: compare(reader, own, decoy, published, settings)  # noqa: B023
            )
        except Exception:
            logger.exception("comparing %s's result for %s failed", duty.trainer, duty.batch_id)
            continue
        findings.append(Finding(duty.batch_id, verdict.matches, float(verdict.score)))
        _log_finding(job, duty, verdict.matches, verdict.score, verdict.detail)
    report = VerificationReport(job.step, findings, job.draw)
    if findings or not job.tie_breaker:
        # a verifier reports even finding nothing: the tie-breaker waits for every verifier
        send(report)
    return report


def _log_finding(
    job: VerifyJob, duty: VerificationDuty, matches: bool, score: float, detail: str
) -> None:
    role = "tie-breaker" if job.tie_breaker else "verifier"
    found = "matches" if matches else "does NOT match"
    log_event(
        logger,
        "verification",
        logging.INFO if matches else logging.WARNING,
        text=f"{role}, step {job.step}: {duty.trainer}'s result for {duty.batch_id} {found} "
        f"the recompute ({detail})",
        step=job.step,
        role=role,
        trainer=str(duty.trainer),
        batch_id=str(duty.batch_id),
        matches=matches,
        score=round(float(score), 4),
    )
