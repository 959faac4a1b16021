"""A follower's round (issue 27, exact verification: `psyche.coordinator.following` says who
follows whom and who loses, `psyche.modeling.verification.Shadow` / `follow` how a trainer's
payload is rebuilt bit for bit).

In a run with `exact_verification_threads > 0` (and `verification_percent > 0`):

* every member starts each epoch from a fresh own optimizer state (`reset_own_state`, at the
  epoch's first round, before anything trains), and computes with the run's CPU intra-op thread
  count (`use_run_threads`): the determinism class its followers rebuild it in;
* at the epoch's first round a member makes a fresh `Shadow` of each trainer it follows
  (`Following.start_epoch`); a member that did not see that round (it cannot know the state)
  follows nobody this epoch, nor does one whose model is not on the CPU;
* each round a followed trainer trains, after the client's own training (the model then holds
  the round's weights: `train_exact` restores them, and the step's weight decay waits), it
  fetches the trainer's batch, advances the shadow (`follow_round`: one training step of the
  batch) and keeps the commitment an honest trainer sends (`compute_hash` of the payload);
* `compare_and_report` waits (until the round's deadline) for the trainer's announced
  commitment, compares the two hashes and sends one follower report (`FOLLOW_DRAW`) with a
  finding per followed batch (`score`: 0 equal, 1 different); it logs each (`following`
  events). A shadow whose round was not followed to the end (the batch not fetched, the round
  cut) or whose trainer announced nothing (by the start of the next round: a trainer cut by the
  round's end may have moved its state or not) is dropped: the trainer's state is unknown from
  then on, and this epoch it is verified statistically only. Dropping is always safe (no
  finding); a stale shadow would accuse an honest trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import trio

from psyche.client.observe.logs import log_event
from psyche.client.round.fetch import DataFetcher
from psyche.client.round.state import RoundState
from psyche.coordinator import Coordinator
from psyche.coordinator.data_selection import verification_duties_for_state
from psyche.coordinator.following import (
    EXACT_DEVICE_TYPE,
    FOLLOW_DRAW,
    exact_class_problem,
    exact_verification_on,
    follow_duties,
    followers_for_state,
)
from psyche.coordinator.verification import Finding, VerificationDuty, VerificationReport
from psyche.core.batch_id import BatchId
from psyche.core.cli import UserError
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    from psyche.client.round.train import TrainingStep
    from psyche.modeling.trainer import Trainer
    from psyche.modeling.verification import Shadow

logger = logging.getLogger(__name__)


def use_run_threads(state: Coordinator) -> None:
    """Compute with the run's intra-op thread count when it verifies exactly (the class)."""
    threads = state.config.exact_verification_threads
    if exact_verification_on(state) and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        logger.info("exact verification: computing with %d CPU intra-op threads", threads)


class OutsideExactClass(UserError):
    """This client cannot compute in the run's exact-verification class (`exact_class_problem`):
    its followers would convict it though honest, so it leaves the run, in one line."""


def check_exact_class(state: Coordinator, trainer: Trainer) -> None:
    """Raise `OutsideExactClass` when the run verifies exactly and this trainer's model is not
    on the CPU (`setup.init` refuses such a client before it loads the model: this holds even
    when the run's setting arrives after that)."""
    devices = {p.device.type for _, p in trainer.model.variables()}
    outside = sorted(devices - {EXACT_DEVICE_TYPE})
    problem = exact_class_problem(state, outside[0] if outside else EXACT_DEVICE_TYPE)
    if problem is not None:
        raise OutsideExactClass(problem)


def reset_own_state(trainer: Trainer) -> None:
    """An epoch's start in a run that verifies exactly: the trainer's own optimizer state fresh
    (what its followers' shadows start from)."""
    trainer.swap_own_state(trainer.fresh_own_state())


@dataclass(frozen=True)
class FollowJob:
    """The batches this client follows in round `step` (a duty per followed trainer's batch)."""

    step: int
    duties: tuple[VerificationDuty, ...]
    warmup_lr_between: tuple[int, int] | None
    zero_optim: bool


@dataclass
class Following:
    """This client's shadows of the trainers it follows in epoch `epoch`."""

    epoch: int | None = None
    shadows: dict[NodeIdentity, Shadow] = field(default_factory=dict)
    unconfirmed: dict[NodeIdentity, int] = field(default_factory=dict)
    """Trainers whose last followed round's commitment has not been seen yet, and that round:
    a shadow advanced by a round its trainer did not finish (cut by the round's end, its result
    never announced) is not the trainer's state, so it is dropped before the next round."""

    def start_epoch(self, state: Coordinator, identity: NodeIdentity, trainer: Trainer) -> None:
        """At an epoch's first round: a fresh shadow of each trainer this client follows. A
        client first here later in an epoch follows nobody in it (it missed the start)."""
        from psyche.modeling.verification import Shadow

        round_ = state.current_round()
        epoch = int(state.progress.epoch)
        if self.epoch == epoch:
            return
        self.epoch, self.shadows, self.unconfirmed = epoch, {}, {}
        if round_ is None or round_.height != 0 or not _on_cpu(trainer):
            return
        following = followers_for_state(state)
        self.shadows = {
            followed: Shadow.fresh(trainer)
            for followed, mine in following.items()
            if identity in mine and followed != identity
        }
        if self.shadows:
            log_event(
                logger,
                "following",
                quiet=True,
                epoch=epoch,
                trainers=[str(t) for t in self.shadows],
            )

    def plan(self, state: Coordinator, identity: NodeIdentity) -> FollowJob | None:
        """The duties of the current round for the trainers this client still shadows."""
        if state.epoch_state.last_step_set():
            return None
        round_ = state.current_round()
        assert round_ is not None
        assigned = dict(verification_duties_for_state(state).assigned)
        duties = [
            d for d in follow_duties(followers_for_state(state), assigned) if d.verifier == identity
        ]
        warmup = state.get_cold_start_warmup_bounds()
        zero_optim = warmup is not None and round_.height == 0
        return self.plan_duties(int(state.progress.step), duties, warmup, zero_optim)

    def plan_duties(
        self,
        step: int,
        duties: Sequence[VerificationDuty],
        warmup_lr_between: tuple[int, int] | None = None,
        zero_optim: bool = False,
    ) -> FollowJob | None:
        """Round `step`'s job from this client's follower `duties` (the trainers' batches): a
        shadow whose last round is unconfirmed is dropped first, a trainer without one skipped."""
        for trainer, last in list(self.unconfirmed.items()):
            self.drop(trainer, f"its commitment of step {last} was not seen before the next round")
        mine = tuple(d for d in duties if d.trainer in self.shadows)
        if not mine:
            return None
        return FollowJob(step, mine, warmup_lr_between, zero_optim)

    def drop(self, trainer: NodeIdentity, why: str) -> None:
        self.unconfirmed.pop(trainer, None)
        if self.shadows.pop(trainer, None) is not None:
            logger.warning("exact verification: no longer following %s (%s)", trainer, why)


def _on_cpu(trainer: Trainer) -> bool:
    return all(p.device.type == "cpu" for _, p in trainer.model.variables())


async def follow_round(
    handle: TrainingStep,
    trainer: Trainer,
    job: FollowJob,
    following: Following,
    fetcher: DataFetcher,
) -> dict[BatchId, bytes]:
    """Advance every shadow `job` names by its trainer's batch (the model holding the round's
    weights); the commitment each honest trainer sends, by batch. A shadow not advanced (its
    batch not fetched in the round, the round cut, an error) is dropped."""
    from psyche.modeling.verification import RecomputeCancelled, follow

    rebuilt: dict[BatchId, bytes] = {}
    todo = {d.batch_id: d for d in job.duties}
    incoming = fetcher.fetch_beside(list(reversed(todo)))  # the fetcher pops from the end
    try:
        async with incoming:
            while todo and (item := await handle.next_batch(incoming)) is not None:
                batch_id, batch = item
                duty = todo.pop(batch_id, None)
                shadow = following.shadows.get(duty.trainer) if duty else None
                if duty is None or shadow is None:
                    continue

                def advance(
                    batch: Any = batch, batch_id: BatchId = batch_id, shadow: Shadow = shadow
                ) -> bytes:
                    payload = follow(
                        trainer,
                        shadow,
                        batch,
                        step=job.step,
                        batch_id=batch_id,
                        warmup_lr_between=job.warmup_lr_between,
                        zero_optim=job.zero_optim,
                        cancel=handle.cancel,
                    )
                    return payload.compute_hash()

                try:
                    rebuilt[batch_id] = await trio.to_thread.run_sync(advance)
                    following.unconfirmed[duty.trainer] = job.step
                except RecomputeCancelled:
                    following.drop(duty.trainer, f"step {job.step} ended before its rebuild")
                except Exception:
                    logger.exception("rebuilding %s's step %d failed", duty.trainer, job.step)
                    following.drop(duty.trainer, "its rebuild failed")
    except Exception:
        logger.exception("following in step %d failed", job.step)
    for duty in todo.values():
        following.drop(duty.trainer, f"its batch of step {job.step} was not fetched in time")
    return rebuilt


def _announced(round_state: RoundState, duty: VerificationDuty) -> bytes | None:
    """The commitment `duty.trainer` announced for its batch (its first), or None."""
    for entry in round_state.results.get(duty.batch_id, []):
        if entry.from_ == duty.trainer:
            return bytes(entry.commitment.data_hash)
    return None


async def compare_and_report(
    job: FollowJob,
    rebuilt: dict[BatchId, bytes],
    following: Following,
    round_state: RoundState,
    deadline: float,
    send: Callable[[VerificationReport], None],
) -> VerificationReport | None:
    """Compare each rebuilt commitment with the one its trainer announced (waiting until
    `deadline`, trio clock), log each finding and `send` the round's follower report."""
    findings: list[Finding] = []
    for duty in job.duties:
        mine = rebuilt.get(duty.batch_id)
        if mine is None:
            continue
        announced = None
        with trio.move_on_at(deadline):
            while (announced := _announced(round_state, duty)) is None:
                await round_state.results_announced.wait()
        if announced is None:
            following.drop(duty.trainer, f"it announced nothing for step {job.step}")
            continue
        if following.unconfirmed.get(duty.trainer) == job.step:
            del following.unconfirmed[duty.trainer]
        matches = announced == mine
        findings.append(Finding(duty.batch_id, matches, 0.0 if matches else 1.0))
        found = "is" if matches else "is NOT"
        log_event(
            logger,
            "followed",
            logging.INFO if matches else logging.WARNING,
            text=f"follower, step {job.step}: {duty.trainer}'s commitment for {duty.batch_id} "
            f"{found} the shadow's, bit for bit",
            step=job.step,
            trainer=str(duty.trainer),
            batch_id=str(duty.batch_id),
            matches=matches,
        )
    if not findings:
        return None
    report = VerificationReport(job.step, findings, FOLLOW_DRAW)
    send(report)
    return report
