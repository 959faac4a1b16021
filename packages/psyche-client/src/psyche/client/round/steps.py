"""The per-epoch state machine of a running client (upstream `state/steps.rs`).

`StepStateMachine` follows the coordinator's run state, Warmup -> Training -> Witness ->
Training ... -> Cooldown -> Warmup, and on each transition ends the step it was in and starts the
one the new state calls for: a round's training step (`train`, which first applies round N - 2
through `apply`), the witness (`witness`), the cooldown (`checkpoints.cooldown`), warmup
(`warmup`). The transitions are a table, `TRANSITIONS`, keyed by (the step it is in, the new run
state), each a small method; a pair the table leaves out is a desync. Gossip and payloads go to
the round states through `payloads`, peers' results through this client's witness checks
(`screening`). It owns the trainer and the round
states and talks to the outside only through a `ClientIO`, whose methods queue work for the
client's main loop. Every method is called from that loop, one at a time, as upstream's
`select!` does; the work it starts runs in the background on `tasks`.

A `Finished` run state is not applied like the others (upstream desyncs on it): the client
calls `finish_run`, which completes the last epoch's cooldown and waits for its checkpoint.

Each round is measured once into a `telemetry.RoundReport` (the progress line is formatted from
it) and handed to `MachineSettings.on_round` once the round is over. With `MachineSettings.evals`
the evaluations run while the trainer is idle: they start when a round's training step ends and
are stopped before the next one starts (or the epoch's cooldown), as upstream's.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from psyche.client.background import Background
from psyche.client.checkpoints.cooldown import CheckpointFiles, Cooldown
from psyche.client.checkpoints.store import CheckpointConfig, RunInstance
from psyche.client.observe.eval_worker import EvalWorker
from psyche.client.observe.evals import split_scores
from psyche.client.observe.logs import log_event
from psyche.client.observe.stats import RunProgress, StatsLogger, progress_text
from psyche.client.observe.telemetry import RoundClock, RoundReport, complete_report
from psyche.client.observe.verification import VerificationTally
from psyche.client.round import follow, payloads, screening, verify, witness
from psyche.client.round.apply import (
    ApplyError,
    ApplyJob,
    agreed_but_unapplied,
    needs_apply,
    plan_apply,
)
from psyche.client.round.broadcast import Broadcast, BroadcastType
from psyche.client.round.fetch import DataFetcher
from psyche.client.round.screening import WitnessScreening
from psyche.client.round.state import Downloading, RoundState
from psyche.client.round.train import (
    BloomFactory,
    FinishedTraining,
    OwnResult,
    RoundPlan,
    TrainingStep,
    TrainJob,
    log_round_start,
    own_results_to_subtract,
    run_round,
    start_round,
)
from psyche.client.round.warmup import WarmupProgress, opportunistic_warmup_action
from psyche.coordinator import Coordinator, RunState
from psyche.coordinator.backend import HealthCheck, OpportunisticData
from psyche.coordinator.following import exact_verification_on
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.verification import VerificationReport
from psyche.core.batch_id import BatchId
from psyche.core.bloom import WitnessBloom
from psyche.core.log_markers import IntegrationTestLogMarker
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    import torch

    from psyche.modeling.distro import DistroResult
    from psyche.modeling.serialized_distro import TransmittableDistroResult
    from psyche.modeling.trainer import Trainer

logger = logging.getLogger(__name__)

EARLY_BROADCASTS_PER_SENDER = 8
"""How many broadcasts for the next round one client may have waiting here (its result and its
Finished, and re-sent copies); more are dropped until that round starts."""


class ClientIO(Protocol):
    """What the state machine asks of the client loop; every call only queues the work."""

    def send_witness(self, data: OpportunisticData) -> None: ...

    def send_health_check(self, checks: list[HealthCheck]) -> None: ...

    def send_checkpoint(self, checkpoint: Checkpoint) -> None: ...

    def send_verification(self, report: VerificationReport) -> None: ...

    async def round_reports(self, step: int) -> dict[NodeIdentity, VerificationReport]:
        """The verification reports the coordinator accepted for round `step` (read now)."""
        ...

    def broadcast_finished(self, action: witness.SendFinished) -> None: ...

    def publish_result(self, result: OwnResult) -> None: ...

    def request_download(self, request: payloads.DownloadRequest) -> None: ...

    def share_model(self, parameters: dict[str, torch.Tensor], version: int) -> None: ...


class ActiveStep(enum.Enum):
    Warmup = "Warmup"
    Training = "Training"
    Witness = "Witness"
    Cooldown = "Cooldown"


_BETWEEN_EPOCHS = (RunState.WaitingForMembers, RunState.Warmup, RunState.Paused)
_ROUND_STATES = (RunState.RoundTrain, RunState.RoundWitness)


class StepDesync(RuntimeError):
    """The coordinator moved to a state this client cannot follow from where it is."""


class FinalCheckpointError(RuntimeError):
    """The run finished but this client's final checkpoint could not be written."""


@dataclass(frozen=True)
class MachineSettings:
    identity: NodeIdentity
    write_gradients_dir: Path | None = None
    checkpoint: CheckpointConfig | None = None
    run: RunInstance = field(default_factory=lambda: RunInstance("", ""))
    """Whose checkpoints this machine writes (needed with `checkpoint`; the default owns
    nothing)."""
    files: CheckpointFiles = field(default_factory=CheckpointFiles)
    on_round: Callable[[RoundReport], None] | None = None
    """Hears every finished round (trackers, the dashboard, the events file)."""
    evals: EvalWorker | None = None
    """Evaluations run while the trainer is idle."""
    sign: Callable[[bytes], bytes] | None = None
    """The p2p key's signature (a verifier's draw, `round.verify.plan_verification`); without
    it the machine verifies only pools small enough to be checked whole."""
    screen_results: bool = True
    """Witness checks (`psyche.modeling.screening`): a peer's result enters this client's
    blooms only if it passes them. Off, every result whose bytes check out is attested, as
    upstream does."""


def client_index(state: Coordinator, identity: NodeIdentity) -> int | None:
    for index, client in enumerate(state.epoch_state.clients):
        if client.id == identity:
            return index
    return None


class StepStateMachine:
    def __init__(
        self,
        settings: MachineSettings,
        trainer: Trainer,
        fetcher: DataFetcher | None,
        coordinator_state: Coordinator,
        io: ClientIO,
        nursery: trio.Nursery,
        *,
        stats: StatsLogger | None = None,
        new_bloom: BloomFactory = WitnessBloom.random,
    ) -> None:
        self.settings = settings
        self.identity = settings.identity
        self.trainer = trainer
        self.fetcher = fetcher
        self.coordinator_state = coordinator_state
        self.io = io
        self.tasks = Background(nursery)
        self.stats = stats or StatsLogger()
        self._new_bloom = new_bloom
        self.active = ActiveStep.Warmup
        self.current = RoundState()
        self.previous = RoundState()
        # The round being applied at the start of a training step, until its payloads are used.
        self.applying: RoundState | None = None
        self.last_apply: ApplyJob | None = None
        """The last apply planned: a result of its round arriving later is checked against it
        (`agreed_but_unapplied`)."""
        self.missed_result: str | None = None
        """Why this machine's model left the run's (a result the run agreed on arrived after its
        apply was planned); the next state stops it (`left_run`)."""
        self.verification = VerificationTally()
        """This client's findings as a verifier or tie-breaker, until a progress line says them."""
        self.own_results_to_subtract: list[list[DistroResult]] = []
        self.following = follow.Following()
        """The trainers this client follows in the epoch (`round.follow`: exact verification)."""
        self._fresh_epoch: int | None = None
        """The epoch whose start reset this trainer's own state (exact verification)."""
        self.held: verify.HeldRound | None = None
        """A tie-breaker's saved round (`round.verify`): its disputes are recomputed next round."""
        """What this client last sent (unquantized) and its DisTrO momentum has not yet had taken
        out: the next round it trains subtracts it (`train_job`), however many rounds it sat out
        in between as a verifier, a tie-breaker or without a batch."""
        self.warmup = WarmupProgress()
        self.training: TrainingStep | None = None
        self.cooldown = Cooldown(
            trainer,
            self.identity,
            settings.run,
            settings.checkpoint,
            settings.files,
            io.share_model,
            io.send_checkpoint,
            nursery,
        )
        self.step_finish_time: float | None = None
        self.progress = RunProgress()
        self._late_warned: tuple[int, int] | None = None
        self.round_clock = RoundClock()
        self._pending_report: RoundReport | None = None
        self.left_run = False
        """Set once the run trained a round without this machine: its model is behind."""
        # Broadcasts for the round after the current one, by sender: a peer that saw the next
        # round start a moment before this client did sends its result before this client can
        # place it (upstream drops it; its rebroadcast comes a round-robin cycle later, often
        # after the round it belongs to).
        self._early: dict[NodeIdentity, list[Broadcast]] = {}
        """Set once the run went on without this machine: its model is behind from then on."""
        self.evals = settings.evals
        if self.evals is not None:
            self.stats.evals = self.evals
        self.screening = WitnessScreening(trainer, settings.screen_results)
        """This client's witness checks of its peers' results."""
        self.momentum_rounds = 0
        """Rounds this machine's trainer has trained (its DisTrO momentum's age)."""
        self.joined_trained_model: bool | None = witness.loaded_trained_model(coordinator_state)
        """Whether it loaded a model the run had trained before (a P2P checkpoint: it joined a
        running run, or came back to it), known from the start: a joiner that is a verifier
        in its first round, or whose first training was cut, is young too."""

    async def wait_idle(self) -> None:
        """Return once no work this machine started is running: the round's training step has
        ended, every payload it was handed is checked, the cooldown is done (checkpoint writes
        aside). A simulation driving the coordinator's clock waits for this so that computing
        takes no simulated time."""
        await self.tasks.wait_idle()

    # ---- coordinator states ------------------------------------------------------------------

    async def apply_state(self, state: Coordinator) -> None:
        if self.evals is not None and state.run_state not in _ROUND_STATES:
            await self.evals.stop()  # the cooldown (or leaving) needs the model
        if self.left_run:
            return  # the client drops this machine and joins again
        if self.missed_result is not None:
            with contextlib.suppress(ApplyError):  # its model is dropped either way
                await self._stop_step(state)
            self.left_run = True
            self._start_warmup()
            return
        index = client_index(state, self.identity)
        if index is None:
            if state.run_state in _ROUND_STATES or (
                state.run_state is RunState.Cooldown and state.epoch_state.clients
            ):
                # The run trains without this machine, or its cooldown applies the epoch's last
                # round without it (a health check dropped it at that round's end; the clients
                # listed hold the run's model): its model falls behind from here. An empty
                # list holds nobody's newer model: the model is kept.
                self.left_run = True
            await self._leave_run(state)
            return
        active = self.active
        step = state.progress.step
        try:
            await self._transition(state, index, active)
        except ApplyError as e:
            self._apply_failed(state, e)
            return
        if self.active is not active:
            log_event(
                logger,
                "step_change",
                quiet=True,
                old=active.value,
                new=self.active.value,
                epoch=state.progress.epoch,
                step=step,
            )
        self.coordinator_state = state
        if self.active is not ActiveStep.Witness:
            self._emit_report()

    async def _transition(self, state: Coordinator, index: int, active: ActiveStep) -> None:
        """Move from the step this machine is in (`active`) to the one `state` calls for: the
        transition `TRANSITIONS` names for the pair; a pair it does not name is a desync."""
        transition = TRANSITIONS.get((active, state.run_state))
        if transition is None:
            raise StepDesync(
                f"Desync: we're in step {active.value} but next RunState is {state.run_state}"
            )
        await transition(self, state, index)

    # ---- the transitions (`TRANSITIONS`), one per (step, run state) ------------------------

    async def _stay(self, state: Coordinator, index: int) -> None:
        """The run is still in the state this step belongs to."""

    async def _join_first_round(self, state: Coordinator, index: int) -> None:
        """Warmup -> RoundTrain: train, if this is the epoch's first round."""
        if self._can_join_round(state):
            self.warmup = WarmupProgress()
            self.step_finish_time = None
            self._start_training(state, index)

    async def _wait_for_next_epoch(self, state: Coordinator, index: int) -> None:
        """Warmup -> a later round or the cooldown: too late for this epoch (it warns)."""
        self._can_join_round(state)

    async def _next_round(self, state: Coordinator, index: int) -> None:
        """Training -> RoundTrain: a new round (its witness phase went by unseen)."""
        if state.progress.step != self.current.step:
            self._check_next_step(state.progress.step)
            await self._finish_training(state)
            self._start_training(state, index)

    async def _train_to_witness(self, state: Coordinator, index: int) -> None:
        """Training -> RoundWitness: finish training and witness (of the next round, when its
        training phase went by unseen: that round is trained first)."""
        if state.progress.step != self.current.step:
            await self._next_round(state, index)
        await self._finish_training(state)
        await self._start_witness(state)

    async def _train_to_cooldown(self, state: Coordinator, index: int) -> None:
        await self._finish_training(state)
        if not self._missed_last_round(state):
            self._start_cooldown(state)

    async def _witness_to_train(self, state: Coordinator, index: int) -> None:
        self._check_next_step(state.progress.step)
        self._start_training(state, index)

    async def _next_witness(self, state: Coordinator, index: int) -> None:
        """Witness -> RoundWitness: the next round's witness phase (its training phase went by
        unseen: that round is trained first)."""
        if state.progress.step != self.current.step:
            await self._witness_to_train(state, index)
            await self._finish_training(state)
            await self._start_witness(state)

    async def _witness_to_cooldown(self, state: Coordinator, index: int) -> None:
        if not self._missed_last_round(state):
            self._start_cooldown(state)

    async def _cooldown_to_warmup(self, state: Coordinator, index: int) -> None:
        await self.cooldown.finish()
        self._start_warmup()

    async def _round_abandoned(self, state: Coordinator, index: int) -> None:
        """A round -> between epochs: the epoch stopped without a cooldown (a server restarted
        from saved state, a pause). Upstream desyncs here; the model is kept and the next epoch
        starts."""
        logger.warning(
            "the round was abandoned (%s, epoch %d step %d); waiting for the next epoch",
            state.run_state,
            state.progress.epoch,
            state.progress.step,
        )
        if self.active is ActiveStep.Training:
            await self._finish_training(state, log_loss=False)
        self._start_warmup()

    def _apply_failed(self, state: Coordinator, e: ApplyError) -> None:
        """A result the run agreed on never arrived (or never finished checking): applying the
        others would give this client weights no other client has. Its model is stale
        (`left_run`) from here, as if the run had gone on without it."""
        step = state.progress.step
        log_event(
            logger,
            "apply_failed",
            logging.WARNING,
            text=f"could not apply the results the run agreed on (epoch "
            f"{state.progress.epoch}, step {step}): {e}; this client's model would leave "
            "the run's, so it stops training, joins again and loads the model at the next "
            "epoch it is in",
            epoch=state.progress.epoch,
            step=step,
            error=str(e),
        )
        self.left_run = True
        self._start_warmup()

    def _missed_last_round(self, state: Coordinator) -> bool:
        """Whether the epoch ended (`state`, the Cooldown) more than one step after the round
        this client is in: the epoch's last round (or rounds) went by unseen while it was busy
        (the backend hands over only the newest state), so the run applied results this client
        never applied. Its model is behind: freezing it would hash, share and checkpoint weights
        no other client has, under the step the others' carry. It is stale (`left_run`) from
        here instead, as after a failed apply: the client joins again and loads the run's
        model."""
        if state.progress.step == self.current.step + 1:
            return False
        log_event(
            logger,
            "missed_round",
            logging.WARNING,
            text=f"the epoch ended at step {state.progress.step} but this client last saw step "
            f"{self.current.step}: it missed the results applied since, so its model is "
            "behind the run's; it stops, joins again and loads the model at the next epoch "
            "it is in",
            epoch=state.progress.epoch,
            step=state.progress.step,
            last_seen=self.current.step,
        )
        self.left_run = True
        self._start_warmup()
        return True

    def _check_next_step(self, step: int) -> None:
        if step != self.current.step + 1:
            raise StepDesync(
                f"Desync: the coordinator is at step {step} but this client last saw step "
                f"{self.current.step}; rounds in between were missed"
            )

    def _can_join_round(self, state: Coordinator) -> bool:
        """A client can only start training in an epoch's first round: later ones apply results
        it never saw (upstream would desync). Otherwise it sits out until the next epoch."""
        round_ = state.current_round()
        if state.run_state is RunState.RoundTrain and round_ is not None and round_.height == 0:
            return True
        key = (state.progress.epoch, state.progress.step)
        if self._late_warned != key:
            self._late_warned = key
            logger.warning(
                "ready after the epoch's first round started (epoch %d step %d, %s); waiting "
                "for the next epoch",
                state.progress.epoch,
                state.progress.step,
                state.run_state,
            )
        return False

    async def _leave_run(self, state: Coordinator) -> None:
        """Not (or no longer) among the run's clients: stop what we do and wait in warmup.

        Between epochs (an epoch ended with every client withdrawn, a restarted server) the
        model is still the run's and is kept. Once the run trains a round without this machine
        (`left_run`, set by `apply_state`) its model falls behind: the client drops it and loads
        the model afresh when it is in an epoch again (training on stale weights would end with
        a model no other client has)."""
        await self._stop_step(state)
        if self.active is not ActiveStep.Warmup:
            logger.warning(
                "this client is not among the run's clients (epoch %d step %d); back to warmup",
                state.progress.epoch,
                state.progress.step,
            )
            self._start_warmup()

    async def _stop_step(self, state: Coordinator) -> None:
        """End the training step or the cooldown this machine is in (it is leaving the run)."""
        if self.active is ActiveStep.Training:
            await self._finish_training(state, log_loss=False)
        elif self.active is ActiveStep.Cooldown:
            await self.cooldown.finish()

    def _start_warmup(self) -> None:
        self._early.clear()
        for round_state in (self.current, self.previous):
            round_state.reference_ready.set()  # checks still waiting end (their round is gone)
        # the trainer and its DisTrO momentum go on into the next epoch: what this client sent
        # last is taken out the next round it trains, as after a round sat out (before, the
        # epoch's first result re-sent it: about twice the agreement of the rounds around it,
        # whose median then refused an honest result, `psyche.modeling.screening`)
        last_sent = self.current.self_distro_results
        self.own_results_to_subtract = list(last_sent) or self.own_results_to_subtract
        self.current = RoundState()
        self.previous = RoundState()
        self.held = None
        self.applying = None
        self.last_apply = None
        self.training = None
        self.active = ActiveStep.Warmup

    # ---- training ------------------------------------------------------------------------------

    def _start_training(self, state: Coordinator, index: int) -> None:
        """Round N starts: plan the apply of round N - 2, send the health checks of round N - 1
        (as its witness), plan round N, and start the training step in the background."""
        apply_job = None
        if needs_apply(self.current):
            apply_job = ApplyJob(
                plan_apply(self.previous, state),
                self.previous,
                state,
                state.get_cold_start_warmup_bounds(),
                trio.current_time() + max(1, state.config.max_round_train_time),
                self.identity,
            )
            self.applying = self.previous
        self.last_apply = apply_job
        checks = witness.health_checks(self.current, state)
        if checks:
            log_event(
                logger,
                "health_check",
                logging.WARNING,
                marker=IntegrationTestLogMarker.HealthCheck,
                step=state.progress.step,
                unhealthy=[str(node) for node, _ in checks],
            )
            self.io.send_health_check(checks)
        screening.close_round(self.previous, self.tasks)
        self.previous = self.current
        self.round_clock.start(state.progress.step)
        plan = start_round(state, self.identity, index, new_bloom=self._new_bloom)
        self.current = plan.state
        self.current.screen = self.screening.open_round()
        if state.config.verification_percent != 0 and not plan.assigned_batches:
            # A verifier or tie-breaker trains nothing: no own update will be the witness
            # checks' reference, so they start now instead of at the round's end (which held
            # its witness, and with it the round, until the round's timeout).
            self.current.reference_ready.set()
        log_round_start(state, self.identity, index, plan)
        # a round without training (an epoch's last two) keeps what is owed, as one without a
        # batch does: before, its own results of the round before were lost
        owed = self._own_results_for_training(plan)
        fresh, follow_job = self._plan_following(state)
        if fresh:  # an epoch's start in an exactly verified run: nothing owed, a fresh state
            owed, self.own_results_to_subtract = [], []
        train_job = None
        if plan.have_training:
            self.momentum_rounds += 1
            info = plan.state.committee_info
            assert info is not None
            train_job = TrainJob(
                step=state.progress.step,
                proof=info.committee_proof,
                assigned_batches=plan.assigned_batches,
                warmup_lr_between=plan.warmup_lr_between,
                zero_optim=plan.zero_optim,
                prev_self_results=owed,
                identity=self.identity,
                write_gradients_dir=self.settings.write_gradients_dir,
            )
        handle = TrainingStep()
        self.training = handle
        self.active = ActiveStep.Training
        self._replay_early()
        verify_job = (
            verify.plan_verification(state, self.identity, self.settings.sign)
            if plan.have_training
            else None
        )
        # a tie-breaker of the last round recomputes its disputes in this one (one copy held)
        held, self.held = self.held, None
        if held is not None and held.job.step != state.progress.step - 1:
            held = None
        self.tasks.start_soon(
            self._run_round, handle, apply_job, train_job, verify_job, held, follow_job, fresh
        )

    def _plan_following(self, state: Coordinator) -> tuple[bool, follow.FollowJob | None]:
        """Exact verification (`round.follow`): whether this round starts this client's epoch
        (its own state is reset), and which trainers' batches it follows this round."""
        if not exact_verification_on(state):
            return False, None
        follow.check_exact_class(state, self.trainer)  # its init checked it: a late config too
        follow.use_run_threads(state)
        epoch = int(state.progress.epoch)
        fresh = self._fresh_epoch != epoch
        self._fresh_epoch = epoch
        self.following.start_epoch(state, self.identity, self.trainer)
        if state.epoch_state.last_step_set():
            return fresh, None
        return fresh, self.following.plan(state, self.identity)

    async def _compare_and_report(
        self,
        job: verify.VerifyJob,
        recomputed: verify.Recomputations,
        round_state: RoundState,
        deadline: float,
    ) -> None:
        """Compare and report this round's duties (`verify.compare_and_report`), and keep the
        findings for the progress line."""
        report = await verify.compare_and_report(
            self.trainer, job, recomputed, round_state, deadline, self.io.send_verification
        )
        self.verification.add_report(job, report)

    def _own_results_for_training(self, plan: RoundPlan) -> list[list[DistroResult]]:
        owed, self.own_results_to_subtract = own_results_to_subtract(
            self.own_results_to_subtract, self.previous.self_distro_results, plan
        )
        return owed

    async def _run_round(
        self,
        handle: TrainingStep,
        apply_job: ApplyJob | None,
        train_job: TrainJob | None,
        verify_job: verify.VerifyJob | None = None,
        held: verify.HeldRound | None = None,
        follow_job: follow.FollowJob | None = None,
        fresh: bool = False,
    ) -> None:
        """The round's training step; evaluations give the model back first and take it
        again once the step is done (the trainer is idle until the next round). Right after
        the apply, a tie-breaker of the last round recomputes that round's disputes from the
        weights it saved (`held`), a tie-breaker of this round saves them, a verifier recomputes
        its duties; each compares on its own afterwards (`round.verify`)."""
        if self.evals is not None:
            await self.evals.stop()
        if fresh:  # before anything trains this epoch (`round.follow`)
            await trio.to_thread.run_sync(follow.reset_own_state, self.trainer)
        recomputed, disputed = verify.Recomputations(), verify.Recomputations()
        rebuilt: dict[BatchId, bytes] = {}
        follow_round = None
        if follow_job is not None and self.fetcher is not None:
            follow_fetcher, job = self.fetcher, follow_job

            async def follow_round() -> None:
                rebuilt.update(
                    await follow.follow_round(
                        handle, self.trainer, job, self.following, follow_fetcher
                    )
                )

        dispute_job: verify.VerifyJob | None = None
        round_state = self.current
        recompute = None
        if (verify_job is not None or held is not None) and self.fetcher is not None:
            fetcher, config = self.fetcher, self.coordinator_state.config

            async def recompute() -> None:
                nonlocal dispute_job
                weights = None
                if held is not None:
                    until = trio.current_time() + max(
                        verify.DISPUTE_WAIT_SECONDS, config.round_witness_time
                    )
                    try:
                        reports = await verify.round_reports_when_settled(
                            held.job, self.io.round_reports, until
                        )
                        dispute_job = await verify.recompute_disputes(
                            handle, self.trainer, held, reports, fetcher, disputed
                        )
                    except Exception:  # never the training step's failure
                        logger.exception(
                            "the disputes of step %d were not arbitrated", held.job.step
                        )
                    weights = held.weights
                if verify_job is not None and verify_job.tie_breaker:
                    try:
                        self.held = await verify.hold_round(
                            self.trainer, verify_job, round_state, weights
                        )
                    except Exception:
                        logger.exception("the weights of step %d were not saved", verify_job.step)
                    return
                if weights is not None:
                    weights.tensors.clear()  # the disputes are known: the copy is dropped
                if verify_job is not None:
                    await verify.recompute_duties(
                        handle, self.trainer, verify_job, fetcher, recomputed
                    )

        config = self.coordinator_state.config
        await run_round(
            handle,
            self.trainer,
            apply_job,
            train_job,
            self.fetcher,
            self.io.publish_result,
            recompute,
            # a client that trains in a run whose verifiers train checks in the round's idle
            # time, after its own result is out (`round.verify`)
            verify_last=config.verifiers_train
            and train_job is not None
            and bool(train_job.assigned_batches),
            follow=follow_round,
        )
        config = self.coordinator_state.config
        deadline = trio.current_time() + config.max_round_train_time + config.round_witness_time
        if verify_job is not None and recomputed.domains:
            self.tasks.start_soon(
                self._compare_and_report, verify_job, recomputed, round_state, deadline
            )
        if follow_job is not None:
            for duty in follow_job.duties:
                if duty.batch_id not in rebuilt:  # not followed (the step failed first, ...)
                    why = f"its batch of step {follow_job.step} was not followed"
                    self.following.drop(duty.trainer, why)
            if rebuilt:
                self.tasks.start_soon(
                    follow.compare_and_report,
                    follow_job,
                    rebuilt,
                    self.following,
                    round_state,
                    deadline,
                    self.io.send_verification,
                )
        if held is not None and dispute_job is not None and disputed.domains:
            self.tasks.start_soon(
                self._compare_and_report, dispute_job, disputed, held.round_state, deadline
            )
        # the trainer is idle until the next round (a newer round's step, if one has started
        # meanwhile, stopped the evaluations before its own work and keeps the model)
        if (
            self.evals is not None
            and handle.finished
            and not handle.cancel.is_set()
            and self.training in (handle, None)
        ):
            self.evals.start()

    async def _finish_training(self, state: Coordinator, *, log_loss: bool = True) -> None:
        handle = self.training
        self.training = None
        if handle is None:
            return
        try:
            finished = await handle.finish()
        finally:
            # every own result of the round has been announced (and recorded) by now: checks
            # still waiting for this client's own update run without one if none is coming
            if not self.current.reference_pending:
                self.current.reference_ready.set()
        self.applying = None
        now = time.monotonic()
        step_duration = None if self.step_finish_time is None else now - self.step_finish_time
        self.step_finish_time = now
        loss = self.stats.push_round_stats(
            finished.losses, finished.duration, step_duration, finished.optim_stats
        )
        if log_loss:
            self._log_progress(state, loss, finished, now)

    def _log_progress(
        self, state: Coordinator, loss: float | None, finished: FinishedTraining, now: float
    ) -> None:
        """`client_loss`, whose console form is the progress line (from this module's logger,
        as a person reading the console knows it), and the round's report, from the same
        numbers (handed on once the round is over: `_emit_report`)."""
        step, total = self.current.step, state.config.total_steps
        trained = finished.trained
        batch_tokens = state.get_target_global_batch_size(state.current_round())
        self.progress.record(step, now, batch_tokens * state.get_sequence_length())
        tokens_per_sec = self.stats.global_tokens_per_second(state) or None
        seconds_left = self.progress.seconds_left(step, total)
        self._emit_report()  # an earlier round still pending goes first
        efficiency = self.stats.efficency()
        scores, partial = split_scores(self.evals.task_scores() if self.evals is not None else {})
        self._pending_report = RoundReport(
            step=step,
            epoch=state.progress.epoch,
            total_steps=total,
            round_height=self.current.height,
            num_clients=len(state.epoch_state.clients),
            loss=loss,
            lr=self.trainer.get_lr(step, state.get_cold_start_warmup_bounds()),
            tokens_per_sec=tokens_per_sec,
            total_tokens=self.progress.tokens,
            global_token_batch_size=batch_tokens * state.get_sequence_length(),
            efficiency=None if math.isnan(efficiency) else efficiency,
            seconds_left=seconds_left,
            trained=len(trained),
            train_seconds=finished.duration,
            distro_seconds=finished.distro_seconds,
            eval_scores=scores,
            eval_partial=tuple(sorted(partial)),
            optim_stats=dict(finished.optim_stats),
        )
        log_event(
            logger,
            "client_loss",
            text=progress_text(
                step,
                total,
                state.progress.epoch,
                loss,
                tokens_per_sec,
                seconds_left,
                verification=self.verification.take(step).text(),
            ),
            marker=IntegrationTestLogMarker.Loss,
            client_id=str(self.identity),
            epoch=state.progress.epoch,
            step=step,
            loss=loss,
            trained=trained,
            total_steps=total,
            tokens_per_sec=None if tokens_per_sec is None else round(tokens_per_sec, 1),
            seconds_left=None if seconds_left is None else round(seconds_left),
        )

    # ---- witness and cooldown ------------------------------------------------------------------

    def _emit_report(self) -> None:
        """Hand the pending round's report on, with its witness and download times."""
        report, self._pending_report = self._pending_report, None
        if report is None:
            return
        report = complete_report(report, self.round_clock.get(report.step))
        if report.eval_scores:
            log_event(
                logger,
                "eval_scores",
                text=f"evaluations at step {report.step}: "
                + ", ".join(
                    f"{name} {score:.4f}" + (" (partial)" if name in report.eval_partial else "")
                    for name, score in report.eval_scores.items()
                ),
                step=report.step,
                scores=dict(report.eval_scores),
                partial=list(report.eval_partial),
            )
        if self.settings.on_round is not None:
            self.settings.on_round(report)

    async def _start_witness(self, state: Coordinator) -> None:
        """Send the witness of the previous round (if this client is a witness of this one),
        its held votes judged first in a worker thread (`screening.judge_round`)."""
        previous, current = self.previous, self.current
        if witness.witness_due(previous, current):
            await screening.judge_round(previous)
        sent = witness.witness_to_send(previous, current)
        if sent is not None:
            logger.debug("Submitting witness blooms (step %d)", state.progress.step)
            self.round_clock.witness_sent(state.progress.step)
            metadata = self.stats.witness_metadata(state)
            self.io.send_witness(OpportunisticData.WitnessStep((sent, metadata)))
        self.active = ActiveStep.Witness

    def _start_cooldown(self, state: Coordinator, *, epoch: int | None = None) -> None:
        """Freeze the model of the epoch that ended: `state` is the Cooldown state (or the
        Finished one, with the ended `epoch`); its step is one past the last trained step."""
        self.active = ActiveStep.Cooldown
        epoch = state.progress.epoch if epoch is None else epoch
        # The run ends or pauses here: the keep policy always writes this checkpoint.
        final = state.progress.step >= state.config.total_steps or bool(state.pending_pause)
        self.cooldown.start(self.tasks, epoch, state.progress.step - 1, final)

    # ---- the end of the run --------------------------------------------------------------------

    async def finish_run(self, state: Coordinator) -> Path | None:
        """The coordinator reached `Finished` (`state`): end the last epoch as its cooldown
        would and wait until every checkpoint write has ended.

        A client that was training or witnessing when the Cooldown state went by unseen (the
        backend hands over only the newest state) finishes the round and runs the cooldown now,
        for the same epoch and step. Returns the final checkpoint's directory: None when no
        `--checkpoint-dir` was given or this client did not train in the last epoch. Raises
        `FinalCheckpointError` when that checkpoint could not be written.
        """
        last_epoch, final_step = state.progress.epoch - 1, state.progress.step - 1
        member = client_index(state, self.identity) is not None
        if self.evals is not None:
            await self.evals.stop()
        if self.active is ActiveStep.Training:
            await self._finish_training(self.coordinator_state, log_loss=member)
        if self.active in (ActiveStep.Training, ActiveStep.Witness):
            if member:
                self._start_cooldown(state, epoch=last_epoch)
            else:
                self._start_warmup()
        if self.active is ActiveStep.Cooldown:
            await self.cooldown.finish()
        await self.cooldown.wait_for_checkpoints()
        self.coordinator_state = state
        self._emit_report()
        checkpoints = self.cooldown.checkpoints
        if self.settings.checkpoint is None or final_step not in checkpoints:
            return None
        path = checkpoints[final_step]
        if path is None:
            raise FinalCheckpointError(
                f"the run finished, but the final checkpoint (step {final_step}) could not be "
                f"written under {self.settings.checkpoint.checkpoint_dir} (see the error above)"
            )
        return path

    # ---- periodic check ------------------------------------------------------------------------

    def try_send_opportunistic_witness(self) -> None:
        clients = self.coordinator_state.epoch_state.clients
        action: witness.OpportunisticAction = None
        if self.current.committee_info is not None:
            if self.active is ActiveStep.Training and self.training is not None:
                action = witness.opportunistic_training_action(
                    self.current,
                    self.previous,
                    training_finished=self.training.finished,
                    clients=clients,
                    judged=self._judged_for_witness(self.previous, self.current),
                )
        elif self.coordinator_state.run_state is RunState.Warmup:
            action = opportunistic_warmup_action(
                self.current, self.warmup, identity=self.identity, clients=clients
            )
        match action:
            case witness.SendFinished():
                self.io.broadcast_finished(action)
            case witness.SendWitness(sent):
                logger.debug("Sending opportunistic witness (step %d)", self.current.step)
                self.round_clock.witness_sent(self.current.step)
                metadata = self.stats.witness_metadata(self.coordinator_state)
                self.io.send_witness(OpportunisticData.WitnessStep((sent, metadata)))
            case witness.SendWarmupWitness(sent):
                logger.debug(
                    "Sending warmup witness (epoch %d)", self.coordinator_state.progress.epoch
                )
                self.io.send_witness(OpportunisticData.WarmupStep(sent))

    def _judged_for_witness(self, round_state: RoundState, current: RoundState) -> bool:
        """Whether `round_state`'s held votes are judged (`payloads.judgement_due`), so that its
        witness may be sent now. Once every payload of the round is in, a judgement not made
        yet is started in a worker thread (`screening.judge_round`), and the opportunistic
        check runs again as soon as it is done. A client that sends no witness of the round
        judges nothing."""
        if not witness.witness_due(round_state, current) or not payloads.judgement_due(round_state):
            return True
        if witness.previous_round_settled(round_state) and not round_state.judging.locked():

            async def judge_then_check() -> None:
                await screening.judge_round(round_state)
                self.try_send_opportunistic_witness()

            self.tasks.start_soon(judge_then_check)
        return False

    # ---- messages and payloads -----------------------------------------------------------------

    def apply_message(
        self, from_id: NodeIdentity, broadcast: Broadcast
    ) -> payloads.ApplyMessageOutcome:
        """A verified run member's broadcast into its round. One for the round after this
        client's current one is held (bounded per sender) and applied, checked as any other,
        once that round starts here."""
        if self._is_early(broadcast) and any(
            c.id == from_id for c in self.coordinator_state.epoch_state.clients
        ):
            held = self._early.setdefault(from_id, [])
            if len(held) < EARLY_BROADCASTS_PER_SENDER:
                held.append(broadcast)
                return payloads.ApplyMessageOutcome.Held
            return payloads.ApplyMessageOutcome.Ignored
        outcome, download = payloads.apply_message(
            self.current,
            self.previous,
            identity=self.identity,
            clients=self.coordinator_state.epoch_state.clients,
            from_id=from_id,
            broadcast=broadcast,
        )
        if download is not None:
            self.io.request_download(download)
        if outcome is payloads.ApplyMessageOutcome.Invalid:
            self._check_late_result(from_id, broadcast)
        return outcome

    def _check_late_result(self, from_id: NodeIdentity, broadcast: Broadcast) -> None:
        """A result for the round whose apply was already planned, which the run agreed on and
        the plan left out (`agreed_but_unapplied`): the others applied it, this client did not,
        so its model has left the run's. Upstream goes on with it; here the next state stops
        the machine (`left_run`: the client joins again and loads the run's model)."""
        job = self.last_apply
        clients = self.coordinator_state.epoch_state.clients
        if job is None or self.missed_result is not None:
            return
        if not agreed_but_unapplied(job, from_id, broadcast, clients):
            return
        data = broadcast.data
        assert isinstance(data, BroadcastType.TrainingResult)
        self.missed_result = (
            f"the result for batch {data.value.batch_id} of step {broadcast.step} arrived after "
            f"the apply at step {job.plan.step} was planned without it, and the run agreed on it"
        )
        log_event(
            logger,
            "missed_result",
            logging.WARNING,
            text=f"{self.missed_result}: this client's model has left the run's; it stops, joins "
            "again and loads the model at the next epoch it is in",
            step=broadcast.step,
            applied_at=job.plan.step,
            batch_id=data.value.batch_id,
            trainer=str(from_id),
        )

    def _is_early(self, broadcast: Broadcast) -> bool:
        """For the round this client has not started yet: the epoch's first one while it warms
        up (warmup Finished messages aside, which belong to the warmup), else the next one."""
        data = broadcast.data
        if isinstance(data, BroadcastType.Finished) and data.value.warmup:
            return False
        if self.active is ActiveStep.Warmup:
            return broadcast.step == self.coordinator_state.progress.step
        return broadcast.step == self.current.step + 1

    def _replay_early(self) -> None:
        """The held broadcasts of the round that just started; the others are dropped."""
        early, self._early = self._early, {}
        for from_id, held in early.items():
            for broadcast in held:
                if broadcast.step == self.current.step:
                    self.apply_message(from_id, broadcast)

    def apply_own_result(self, broadcast: Broadcast, result: OwnResult) -> None:
        """This client's result, as the loop announced it (`broadcast`), into its round state:
        already hashed and in tensors, it is not downloaded, hashed or deserialized again."""
        recorded = payloads.record_own_result(
            self.current,
            self.previous,
            identity=self.identity,
            clients=self.coordinator_state.epoch_state.clients,
            broadcast=broadcast,
            payload=result.deserialized(),
            original=result.original,
        )
        if recorded is None:
            logger.debug("own result for step %d came after its round", result.step)
            return
        screening.set_reference(recorded, result, self.tasks)

    def _payload_rounds(self) -> list[RoundState]:
        rounds = [self.current, self.previous]
        if self.applying is not None:
            rounds.append(self.applying)
        return rounds

    def checks_accuse(self) -> bool:
        """Whether a result this client's witness checks refuse also names its sender as not
        delivering (`witness.refusals_accuse`)."""
        return witness.refusals_accuse(self.joined_trained_model, self.momentum_rounds)

    def awaits_payload(self, blob_hash: bytes) -> bool:
        """Whether a round still waits for this payload (a download retry is worth it)."""
        round_state = payloads.round_for_payload(self._payload_rounds(), blob_hash)
        return round_state is not None and isinstance(
            round_state.downloads.get(blob_hash), Downloading
        )

    def refuse_distro_result(self, blob_hash: bytes, reason: str) -> None:
        """A peer's payload that can never be used (its ticket announces more than the run's
        largest result, or its blob does not decode): its round skips it, and remembers the
        hash, so it is not downloaded again."""
        round_state = payloads.round_for_payload(self._payload_rounds(), blob_hash)
        if round_state is not None:
            payloads.refuse_payload(round_state, blob_hash, reason)

    def apply_distro_result(self, blob_hash: bytes, payload: TransmittableDistroResult) -> None:
        """A peer's downloaded payload: checked and deserialized in the background."""
        round_state = payloads.round_for_payload(self._payload_rounds(), blob_hash)
        if round_state is None:
            logger.debug("Unknown download %s", blob_hash[:5].hex())
            return
        pending = payloads.commitment_for_payload(round_state, blob_hash)
        if pending is None:
            logger.debug("No pending commitment for payload %s", blob_hash[:5].hex())
            return
        self.round_clock.downloaded(round_state.step)
        self.tasks.start_soon(
            payloads.check_payload,
            round_state,
            blob_hash,
            payload,
            pending,
            self.trainer.results_from_payload,
            screening.screen_result,
            self.checks_accuse(),
        )


Transition = Callable[[StepStateMachine, Coordinator, int], Awaitable[None]]
"""A transition of the machine to what a coordinator state calls for (the state, and this
client's index among the epoch's clients)."""

_S, _R = ActiveStep, RunState
TRANSITIONS: Mapping[tuple[ActiveStep, RunState], Transition] = {
    **{(_S.Warmup, run_state): StepStateMachine._stay for run_state in _BETWEEN_EPOCHS},
    (_S.Warmup, _R.RoundTrain): StepStateMachine._join_first_round,
    (_S.Warmup, _R.RoundWitness): StepStateMachine._wait_for_next_epoch,
    (_S.Warmup, _R.Cooldown): StepStateMachine._wait_for_next_epoch,
    (_S.Training, _R.RoundTrain): StepStateMachine._next_round,
    (_S.Training, _R.RoundWitness): StepStateMachine._train_to_witness,
    (_S.Training, _R.Cooldown): StepStateMachine._train_to_cooldown,
    **{
        (_S.Training, run_state): StepStateMachine._round_abandoned for run_state in _BETWEEN_EPOCHS
    },
    (_S.Witness, _R.RoundTrain): StepStateMachine._witness_to_train,
    (_S.Witness, _R.RoundWitness): StepStateMachine._next_witness,
    (_S.Witness, _R.Cooldown): StepStateMachine._witness_to_cooldown,
    **{(_S.Witness, run_state): StepStateMachine._round_abandoned for run_state in _BETWEEN_EPOCHS},
    (_S.Cooldown, _R.Cooldown): StepStateMachine._stay,
    **{
        (_S.Cooldown, run_state): StepStateMachine._cooldown_to_warmup
        for run_state in _BETWEEN_EPOCHS
    },
}
"""Upstream's `step_state_machine` transitions, keyed by (the step this machine is in, the run
state the coordinator moved to); the pairs it leaves out are desyncs (`StepDesync`): a state this
client cannot follow from where it is (`Finished` is not applied here: `finish_run`)."""
