"""The per-epoch state machine of a running client (upstream `state/steps.rs`).

`StepStateMachine` follows the coordinator's run state: Warmup -> Training -> Witness ->
Training ... -> Cooldown -> Warmup. It owns the trainer and the two round states, starts the
round's work in the background (`training.run_round`, the cooldown extraction) and talks to the
outside only through a `ClientIO`, whose methods queue work for the client's main loop. Every
method is called from that loop, one at a time, as upstream's `select!` does.

A `Finished` run state is not applied like the others (upstream desyncs on it): the client
calls `finish_run`, which completes the last epoch's cooldown and waits for its checkpoint.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from psyche.client import core
from psyche.client.broadcast import Broadcast
from psyche.client.cooldown import (
    CheckpointConfig,
    CheckpointJob,
    extract_for_sharing,
    write_and_upload,
)
from psyche.client.logs import log_event
from psyche.client.round_state import DeserializedPayload, Downloading, PayloadHandle, RoundState
from psyche.client.stats import RunProgress, StatsLogger, progress_text
from psyche.client.training import (
    ApplyJob,
    DataFetcher,
    OwnResult,
    TrainingStep,
    TrainJob,
    run_round,
)
from psyche.coordinator import Coordinator, RunState
from psyche.coordinator.backend import HealthCheck, OpportunisticData
from psyche.coordinator.model import Checkpoint
from psyche.core.bloom import WitnessBloom
from psyche.core.log_markers import IntegrationTestLogMarker
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    import torch

    from psyche.modeling.distro import DistroResult
    from psyche.modeling.serialized_distro import TransmittableDistroResult
    from psyche.modeling.trainer import Trainer

logger = logging.getLogger(__name__)


class ClientIO(Protocol):
    """What the state machine asks of the client loop; every call only queues the work."""

    def send_witness(self, data: OpportunisticData) -> None: ...

    def send_health_check(self, checks: list[HealthCheck]) -> None: ...

    def send_checkpoint(self, checkpoint: Checkpoint) -> None: ...

    def broadcast_finished(self, action: core.SendFinished) -> None: ...

    def publish_result(self, result: OwnResult) -> None: ...

    def request_download(self, request: core.DownloadRequest) -> None: ...

    def share_model(self, parameters: dict[str, torch.Tensor]) -> None: ...


class ActiveStep(enum.Enum):
    Warmup = "Warmup"
    Training = "Training"
    Witness = "Witness"
    Cooldown = "Cooldown"

    def allowed_in(self, run_state: RunState) -> bool:
        return run_state in _ALLOWED[self]


_ALLOWED = {
    ActiveStep.Warmup: (RunState.Warmup, RunState.WaitingForMembers, RunState.Paused),
    ActiveStep.Training: (RunState.RoundTrain,),
    ActiveStep.Witness: (RunState.RoundWitness,),
    ActiveStep.Cooldown: (RunState.Cooldown,),
}


_BETWEEN_EPOCHS = (RunState.WaitingForMembers, RunState.Warmup, RunState.Paused)


class PayloadRejected(ValueError):
    """A downloaded payload that does not answer its commitment."""


class StepDesync(RuntimeError):
    """The coordinator moved to a state this client cannot follow from where it is."""


class FinalCheckpointError(RuntimeError):
    """The run finished but this client's final checkpoint could not be written."""


@dataclass(frozen=True)
class MachineSettings:
    identity: NodeIdentity
    quantize: bool
    write_gradients_dir: Path | None = None
    checkpoint: CheckpointConfig | None = None
    extra_files: list[Path] = field(default_factory=list)
    model_config_json: str = "{}"
    tokenizer_json: str = ""


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
        new_bloom: core.BloomFactory = WitnessBloom.random,
    ) -> None:
        self.settings = settings
        self.identity = settings.identity
        self.trainer = trainer
        self.fetcher = fetcher
        self.coordinator_state = coordinator_state
        self.io = io
        self.nursery = nursery
        self.stats = stats or StatsLogger()
        self._new_bloom = new_bloom
        self.layouts = trainer.distro.layouts() if trainer.distro is not None else []
        self.active = ActiveStep.Warmup
        self.current = RoundState()
        self.previous = RoundState()
        # The round being applied at the start of a training step, until its payloads are used.
        self.applying: RoundState | None = None
        self.warmup = core.WarmupProgress()
        self.training: TrainingStep | None = None
        self._cooldown_done: trio.Event | None = None
        self._cooldown_error: BaseException | None = None
        self.step_finish_time: float | None = None
        self.progress = RunProgress()
        self.pending_uploads = 0
        self._uploads_idle = trio.Event()
        self._uploads_idle.set()
        # step -> the directory its checkpoint was written to (None: the write failed)
        self.checkpoints: dict[int, Path | None] = {}
        self._kept_steps: list[int] = []
        self._late_warned: tuple[int, int] | None = None

    # ---- coordinator states ------------------------------------------------------------------

    async def apply_state(self, state: Coordinator) -> None:
        index = client_index(state, self.identity)
        if index is None:
            await self._leave_run(state)
            return
        run_state = state.run_state
        active = self.active
        step = state.progress.step
        if active is ActiveStep.Warmup and run_state is RunState.RoundTrain:
            if self._can_join_round(state):
                self.warmup = core.WarmupProgress()
                self.step_finish_time = None
                self._start_training(state, index)
        elif active is ActiveStep.Warmup and run_state in (
            RunState.RoundWitness,
            RunState.Cooldown,
        ):
            self._can_join_round(state)  # warns; waits for the next epoch
        elif active is ActiveStep.Training and run_state is RunState.RoundWitness:
            if step != self.current.step:
                self._check_next_step(step)
                await self._finish_training(state)  # its witness phase went by unseen
                self._start_training(state, index)
            await self._finish_training(state)
            self._start_witness(state)
        elif (
            active is ActiveStep.Training
            and run_state is RunState.RoundTrain
            and (step != self.current.step)
        ):
            self._check_next_step(step)
            await self._finish_training(state)
            self._start_training(state, index)
        elif active is ActiveStep.Training and run_state is RunState.Cooldown:
            await self._finish_training(state)
            self._start_cooldown(state)
        elif active is ActiveStep.Witness and run_state is RunState.RoundTrain:
            self._check_next_step(step)
            self._start_training(state, index)
        elif (
            active is ActiveStep.Witness
            and run_state is RunState.RoundWitness
            and (step != self.current.step)
        ):
            self._check_next_step(step)
            self._start_training(state, index)
            await self._finish_training(state)
            self._start_witness(state)
        elif active is ActiveStep.Witness and run_state is RunState.Cooldown:
            self._start_cooldown(state)
        elif active is ActiveStep.Cooldown and run_state in _BETWEEN_EPOCHS:
            await self._finish_cooldown()
            self._start_warmup()
        elif active in (ActiveStep.Training, ActiveStep.Witness) and run_state in _BETWEEN_EPOCHS:
            # The epoch stopped without a cooldown (a server restarted from saved state, a
            # pause): upstream desyncs here; the model is kept and the next epoch starts.
            logger.warning(
                "the round was abandoned (%s, epoch %d step %d); waiting for the next epoch",
                run_state,
                state.progress.epoch,
                step,
            )
            if active is ActiveStep.Training:
                await self._finish_training(state, log_loss=False)
            self._start_warmup()
        elif not active.allowed_in(run_state):
            raise StepDesync(
                f"Desync: we're in step {active.value} but next RunState is {run_state}"
            )
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
        """Not (or no longer) among the run's clients: stop what we do and wait in warmup."""
        if self.active is ActiveStep.Training:
            await self._finish_training(state, log_loss=False)
        elif self.active is ActiveStep.Cooldown:
            await self._finish_cooldown()
        if self.active is not ActiveStep.Warmup:
            logger.warning(
                "this client is not among the run's clients (epoch %d step %d); back to warmup",
                state.progress.epoch,
                state.progress.step,
            )
            self._start_warmup()

    def _start_warmup(self) -> None:
        self.current = RoundState()
        self.previous = RoundState()
        self.applying = None
        self.training = None
        self.active = ActiveStep.Warmup

    def _start_training(self, state: Coordinator, index: int) -> None:
        apply_job = None
        if core.needs_apply(self.current):
            plan = core.plan_apply(self.previous, state)
            apply_job = ApplyJob(
                plan,
                self.previous,
                state,
                state.get_cold_start_warmup_bounds(),
                trio.current_time() + max(1, state.config.max_round_train_time),
                self.identity,
            )
            self.applying = self.previous
        checks = core.health_checks(self.current, state)
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
        self.previous = self.current
        plan_round = core.start_round(state, self.identity, index, new_bloom=self._new_bloom)
        self.current = plan_round.state
        info = plan_round.state.committee_info
        assert info is not None
        round_ = state.current_round()
        log_event(
            logger,
            "round_start",
            quiet=True,
            marker=IntegrationTestLogMarker.WitnessElected,
            client_id=str(self.identity),
            epoch=state.progress.epoch,
            step=state.progress.step,
            round=round_.height if round_ is not None else 0,
            clients=len(state.epoch_state.clients),
            index=index,
            committee=info.committee_proof.committee.name,
            witness=bool(info.witness_proof.witness),
            assigned=plan_round.assigned_batches,
            assignments=[f"{b}={n}" for b, n in plan_round.state.data_assignments.items()],
        )
        train_job = None
        if plan_round.have_training:
            train_job = TrainJob(
                step=state.progress.step,
                proof=info.committee_proof,
                assigned_batches=plan_round.assigned_batches,
                warmup_lr_between=plan_round.warmup_lr_between,
                zero_optim=plan_round.zero_optim,
                prev_self_results=list(self.previous.self_distro_results),
                quantize=self.settings.quantize,
                identity=self.identity,
                write_gradients_dir=self.settings.write_gradients_dir,
            )
        handle = TrainingStep()
        self.training = handle
        self.active = ActiveStep.Training
        self.nursery.start_soon(
            run_round,
            handle,
            self.trainer,
            apply_job,
            train_job,
            self.fetcher,
            self.io.publish_result,
        )

    async def _finish_training(self, state: Coordinator, *, log_loss: bool = True) -> None:
        handle = self.training
        self.training = None
        if handle is None:
            return
        finished = await handle.finish()
        self.applying = None
        now = time.monotonic()
        step_duration = None if self.step_finish_time is None else now - self.step_finish_time
        self.step_finish_time = now
        loss = self.stats.push_round_stats(
            finished.losses, finished.duration, step_duration, finished.optim_stats
        )
        if log_loss:
            step, total = self.current.step, state.config.total_steps
            batch_tokens = state.get_target_global_batch_size(state.current_round())
            self.progress.record(step, now, batch_tokens * state.get_sequence_length())
            tokens_per_sec = self.stats.global_tokens_per_second(state) or None
            seconds_left = self.progress.seconds_left(step, total)
            log_event(
                logger,
                "client_loss",
                text=progress_text(
                    step, total, state.progress.epoch, loss, tokens_per_sec, seconds_left
                ),
                marker=IntegrationTestLogMarker.Loss,
                client_id=str(self.identity),
                epoch=state.progress.epoch,
                step=step,
                loss=loss,
                trained=finished.trained,
                total_steps=total,
                tokens_per_sec=None if tokens_per_sec is None else round(tokens_per_sec, 1),
                seconds_left=None if seconds_left is None else round(seconds_left),
            )

    def _start_witness(self, state: Coordinator) -> None:
        witness = core.witness_to_send(self.previous, self.current)
        if witness is not None:
            logger.debug("Submitting witness blooms (step %d)", state.progress.step)
            metadata = self.stats.witness_metadata(state)
            self.io.send_witness(OpportunisticData.WitnessStep((witness, metadata)))
        self.active = ActiveStep.Witness

    def _start_cooldown(self, state: Coordinator, *, epoch: int | None = None) -> None:
        """Freeze the model of the epoch that ended: `state` is the Cooldown state (or the
        Finished one, with the ended `epoch`); its step is one past the last trained step."""
        self.active = ActiveStep.Cooldown
        done = trio.Event()
        self._cooldown_done = done
        self._cooldown_error = None
        epoch = state.progress.epoch if epoch is None else epoch
        step = state.progress.step - 1
        self.nursery.start_soon(self._cooldown, state.run_id, epoch, step, done)

    async def _cooldown(self, run_id: str, epoch: int, step: int, done: trio.Event) -> None:
        try:
            variables, live_hash = await trio.to_thread.run_sync(extract_for_sharing, self.trainer)
            log_event(
                logger,
                "cooldown_model",
                text=f"epoch {epoch} ended at step {step}: model hash {live_hash.hex()[:16]}",
                client_id=str(self.identity),
                epoch=epoch,
                step=step,
                model_hash=live_hash,
                parameters=len(variables),
            )
            self.io.share_model(variables)
            config = self.settings.checkpoint
            if config is not None:
                job = CheckpointJob(
                    config,
                    run_id,
                    step,
                    variables,
                    list(self.settings.extra_files),
                    self.settings.model_config_json,
                    self.settings.tokenizer_json,
                )
                if self.pending_uploads == 0:
                    self._uploads_idle = trio.Event()
                self.pending_uploads += 1
                self.nursery.start_soon(self._checkpoint, job)
        except Exception as e:
            logger.exception("cooldown failed")
            self._cooldown_error = e
        finally:
            done.set()

    async def _checkpoint(self, job: CheckpointJob) -> None:
        path = None
        try:
            path = await write_and_upload(job, self._kept_steps, self.io.send_checkpoint)
        finally:
            self.checkpoints[job.step] = path
            self.pending_uploads -= 1
            if self.pending_uploads == 0:
                self._uploads_idle.set()

    async def _finish_cooldown(self) -> None:
        done = self._cooldown_done
        self._cooldown_done = None
        if done is not None:
            await done.wait()
        if self._cooldown_error is not None:
            error, self._cooldown_error = self._cooldown_error, None
            raise error

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
        if self.active is ActiveStep.Training:
            await self._finish_training(self.coordinator_state, log_loss=member)
        if self.active in (ActiveStep.Training, ActiveStep.Witness):
            if member:
                self._start_cooldown(state, epoch=last_epoch)
            else:
                self._start_warmup()
        if self.active is ActiveStep.Cooldown:
            await self._finish_cooldown()
        await self._uploads_idle.wait()
        self.coordinator_state = state
        if self.settings.checkpoint is None or final_step not in self.checkpoints:
            return None
        path = self.checkpoints[final_step]
        if path is None:
            raise FinalCheckpointError(
                f"the run finished, but the final checkpoint (step {final_step}) could not be "
                f"written under {self.settings.checkpoint.checkpoint_dir} (see the error above)"
            )
        return path

    # ---- periodic check ------------------------------------------------------------------------

    def try_send_opportunistic_witness(self) -> None:
        clients = self.coordinator_state.epoch_state.clients
        action: core.OpportunisticAction = None
        if self.current.committee_info is not None:
            if self.active is ActiveStep.Training and self.training is not None:
                action = core.opportunistic_training_action(
                    self.current,
                    self.previous,
                    training_finished=self.training.finished,
                    clients=clients,
                )
        elif self.coordinator_state.run_state is RunState.Warmup:
            action = core.opportunistic_warmup_action(
                self.current, self.warmup, identity=self.identity, clients=clients
            )
        match action:
            case core.SendFinished():
                self.io.broadcast_finished(action)
            case core.SendWitness(witness):
                logger.debug("Sending opportunistic witness (step %d)", self.current.step)
                metadata = self.stats.witness_metadata(self.coordinator_state)
                self.io.send_witness(OpportunisticData.WitnessStep((witness, metadata)))
            case core.SendWarmupWitness(witness):
                logger.debug(
                    "Sending warmup witness (epoch %d)", self.coordinator_state.progress.epoch
                )
                self.io.send_witness(OpportunisticData.WarmupStep(witness))

    # ---- messages ------------------------------------------------------------------------------

    def apply_message(
        self, from_id: NodeIdentity, broadcast: Broadcast
    ) -> core.ApplyMessageOutcome:
        outcome, download = core.apply_message(
            self.current,
            self.previous,
            identity=self.identity,
            clients=self.coordinator_state.epoch_state.clients,
            from_id=from_id,
            broadcast=broadcast,
        )
        if download is not None:
            self.io.request_download(download)
        return outcome

    def apply_distro_result(
        self,
        blob_hash: bytes,
        payload: TransmittableDistroResult,
        self_result: list[DistroResult] | None = None,
    ) -> None:
        rounds = [self.current, self.previous]
        if self.applying is not None:
            rounds.append(self.applying)
        round_state = core.round_for_payload(rounds, blob_hash)
        if round_state is None:
            logger.debug("Unknown download %s", blob_hash[:5].hex())
            return
        if self_result is not None:
            round_state.self_distro_results.append(self_result)
        pending = core.commitment_for_payload(round_state, blob_hash)
        if pending is None:
            logger.debug("No pending commitment for payload %s", blob_hash[:5].hex())
            return
        self.nursery.start_soon(self._check_payload, round_state, blob_hash, payload, pending)

    async def _check_payload(
        self,
        round_state: RoundState,
        blob_hash: bytes,
        payload: TransmittableDistroResult,
        pending: core.PendingPayload,
    ) -> None:
        digest = await trio.to_thread.run_sync(payload.compute_hash)
        problem = core.payload_problem(
            digest, payload.step, payload.batch_id, pending, round_state.step
        )
        if problem is not None:
            log_event(
                logger,
                "payload_rejected",
                logging.WARNING,
                step=round_state.step,
                batch_id=pending.batch_id,
                sender=str(pending.from_),
                reason=problem,
            )
            # The blob is content-addressed, so every honest client holds these same bytes and
            # refuses them: if a (dishonest) witness voted for this commitment anyway, all of
            # them skip it at apply alike. Upstream keeps waiting for a download that already
            # happened and then fails the apply.
            if isinstance(round_state.downloads.get(blob_hash), Downloading):
                rejected = PayloadHandle()
                rejected.set_error(PayloadRejected(problem))
                round_state.settle(blob_hash, rejected)
            return
        if not isinstance(round_state.downloads.get(blob_hash), Downloading):
            return  # checked twice concurrently, or already applied
        core.record_verified_payload(
            round_state, pending.from_, pending.batch_id, pending.commitment.data_hash
        )
        handle = PayloadHandle()
        round_state.settle(blob_hash, handle)
        try:
            value = await trio.to_thread.run_sync(self._deserialize, payload)
        except Exception as e:
            log_event(
                logger,
                "payload_invalid",
                logging.WARNING,
                step=round_state.step,
                batch_id=pending.batch_id,
                sender=str(pending.from_),
                reason=str(e),
            )
            handle.set_error(e)
        else:
            handle.set_result(value)

    def _deserialize(self, payload: TransmittableDistroResult) -> DeserializedPayload:
        from psyche.modeling.serialized_distro import distro_results_from_transmittable

        results = distro_results_from_transmittable(
            payload, self.layouts, require_1bit=self.settings.quantize
        )
        return DeserializedPayload(results, payload.trainer_nonce)
