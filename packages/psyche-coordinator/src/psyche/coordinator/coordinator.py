"""The coordinator: a run's shared state and the state machine every backend runs.

`Coordinator` holds the run's state (its fields are the wire layout; their types are in
`run_state.py`, and the read-only queries it inherits in `consensus.py`).
`Coordinator.tick` and the message methods (`witness`, `warmup_witness`, `health_check`,
`checkpoint`, `withdraw`, `pause`, `resume`) are deterministic functions of the state and their
arguments: the caller supplies the time (whole unix seconds) and the randomness, nothing here
reads a clock or a random source. They change the coordinator in place, as upstream's `&mut self`
methods do; `copy()` gives an independent coordinator for simulations.

Integer arithmetic follows upstream's release build (wrapping), because every client must predict
the same numbers; the places are marked "wrapping". See docs/coordinator.md for the upstream quirks
kept here and for the exceptions raised where upstream panics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Annotated, Any

from psyche.coordinator.committee_selection import CommitteeSelection
from psyche.coordinator.config import (
    SOLANA_MAX_NUM_CLIENTS,
    SOLANA_MAX_NUM_WITNESSES,
    CoordinatorConfig,
)
from psyche.coordinator.consensus import CoordinatorQueries
from psyche.coordinator.errors import CoordinatorError, CoordinatorErrorKind, CoordinatorPanic
from psyche.coordinator.model import (
    LLM,
    Checkpoint,
    LLMArchitecture,
    LLMTrainingDataLocation,
    LLMTrainingDataType,
    Model,
)
from psyche.coordinator.run_state import (
    NUM_STORED_ROUNDS,
    SOLANA_RUN_ID_MAX_LEN,
    Client,
    ClientState,
    CoordinatorEpochState,
    CoordinatorProgress,
    HealthChecks,
    Round,
    RunState,
    TickResult,
    Witness,
)
from psyche.coordinator.verification import tie_breaker_tasks_for
from psyche.core.definitions import ConstantLR, LearningRateSchedule, OptimizerDefinition
from psyche.core.node_identity import NodeIdentity
from psyche.core.numeric import U64_MAX, truncating_cast_unsigned, wrapping_u32, wrapping_u64
from psyche.core.serde import U64, FixedStr, SmallBool, struct, to_bytes

__all__ = ["Coordinator"]

# What a tick returns: the variants are frozen values, named once with their type.
_TICKED: TickResult = TickResult.Ticked()
_EPOCH_FAILED: TickResult = TickResult.EpochEnd(False)
_EPOCH_SUCCEEDED: TickResult = TickResult.EpochEnd(True)


@struct(kw_only=True)
class Coordinator(CoordinatorQueries):
    run_id: Annotated[str, FixedStr(SOLANA_RUN_ID_MAX_LEN)]
    run_state: RunState
    model: Model
    config: CoordinatorConfig
    progress: CoordinatorProgress = dataclasses.field(default_factory=CoordinatorProgress)
    epoch_state: CoordinatorEpochState = dataclasses.field(default_factory=CoordinatorEpochState)
    run_state_start_unix_timestamp: U64 = 0
    pending_pause: SmallBool = False

    # ---- construction, copies, equality ------------------------------------------------------

    @classmethod
    def zeroed(cls) -> Coordinator:
        """Upstream `Coordinator::zeroed()`: every byte zero (step 0, no first round, an
        Ephemeral checkpoint); upstream's tests start from it and fill in a config."""
        llm = LLM(
            max_seq_len=0,
            cold_start_warmup_steps=0,
            architecture=LLMArchitecture.HfLlama,
            checkpoint=Checkpoint.Ephemeral(),
            data_type=LLMTrainingDataType.Pretraining,
            data_location=LLMTrainingDataLocation.Dummy(),
            lr_schedule=LearningRateSchedule.Constant(ConstantLR(0.0, 0.0, 0)),
            optimizer=OptimizerDefinition.Dummy(),
        )
        zeros: dict[str, Any] = {
            f.name: 0
            for f in dataclasses.fields(CoordinatorConfig)
            if f.default is dataclasses.MISSING  # the appended flags keep their defaults
        }
        config = CoordinatorConfig(**zeros)
        return cls(
            run_id="",
            run_state=RunState.Uninitialized,
            model=Model.LLM(llm),
            config=config,
            progress=CoordinatorProgress(0, 0, 0),
            epoch_state=CoordinatorEpochState.zeroed(),
        )

    def copy(self) -> Coordinator:
        """An independent deep copy (upstream's `Coordinator` is `Copy`)."""
        llm = self._llm()
        return Coordinator(
            run_id=self.run_id,
            run_state=self.run_state,
            model=Model.LLM(
                dataclasses.replace(llm, backup_data_locations=list(llm.backup_data_locations))
            ),
            config=dataclasses.replace(self.config),
            progress=dataclasses.replace(self.progress),
            epoch_state=self.epoch_state.copy(),
            run_state_start_unix_timestamp=self.run_state_start_unix_timestamp,
            pending_pause=self.pending_pause,
        )

    def to_bytes(self) -> bytes:
        """The postcard encoding (what the centralized server broadcasts)."""
        return to_bytes(self, Coordinator)

    def __eq__(self, other: object) -> bool:
        # Equal when their encodings are: dataclass equality would compare clients by id only.
        if not isinstance(other, Coordinator):
            return NotImplemented
        return self.to_bytes() == other.to_bytes()

    # (defining __eq__ without __hash__ leaves instances unhashable: they are mutable)
    # ---- the state machine -------------------------------------------------------------------

    def tick(
        self, new_clients: Iterable[NodeIdentity] | None, unix_timestamp: int, random_seed: int
    ) -> TickResult:
        """Advance the run by the clock.

        `new_clients` are the clients waiting to join (the server's pending set, in its order),
        read only while waiting for members; None means "no information" and never starts an
        epoch. `random_seed` seeds a round if one starts. Raises `CoordinatorError(Halted)` when
        the run is uninitialized, finished or paused.
        """
        _check_u64("unix_timestamp", unix_timestamp)
        _check_u64("random_seed", random_seed)
        state = self.run_state
        if self.halted():
            raise CoordinatorError(CoordinatorErrorKind.Halted)
        if state is RunState.WaitingForMembers:
            return self._tick_waiting_for_members(new_clients, unix_timestamp)
        if state is RunState.Warmup:
            return self._tick_warmup(unix_timestamp, random_seed)
        if state is RunState.RoundTrain:
            return self._tick_round_train(unix_timestamp)
        if state is RunState.RoundWitness:
            return self._tick_round_witness(unix_timestamp, random_seed)
        return self._tick_cooldown(unix_timestamp)

    def _tick_waiting_for_members(
        self, pending_clients: Iterable[NodeIdentity] | None, unix_timestamp: int
    ) -> TickResult:
        if pending_clients is None:
            return _TICKED
        pending = list(pending_clients)
        # The extra time counts from entering WaitingForMembers, not from reaching the minimum
        # (upstream behaviour); `len as u16` truncates.
        if truncating_cast_unsigned(
            len(pending), 16
        ) >= self.config.init_min_clients and self._check_timeout(
            unix_timestamp, self.config.waiting_for_members_extra_time
        ):
            # Upstream kicks unhealthy clients here although the epoch state is zeroed just
            # below; kept, since it can fail (a full exited list) exactly where upstream panics.
            self._move_clients_to_exited(self._current_round_unchecked().height)

            # No client of the last epoch is back: nobody can serve the model peer to peer.
            pending_signers = {identity.signer for identity in pending}
            if not any(c.id.signer in pending_signers for c in self.epoch_state.clients):
                llm = self._llm()
                match llm.checkpoint:
                    case Checkpoint.P2P(hub_repo):
                        llm.checkpoint = Checkpoint.Hub(hub_repo)
                    case Checkpoint.P2PGcs(gcs_repo):
                        llm.checkpoint = Checkpoint.Gcs(gcs_repo)

            epoch_state = CoordinatorEpochState.zeroed()
            epoch_state.first_round = True
            epoch_state.cold_start_epoch = self.epoch_state.cold_start_epoch
            epoch_state.start_step = self.progress.step
            epoch_state.start_timestamp = unix_timestamp
            # Duplicates in `pending_clients` are kept, as upstream's iterator would; the server
            # passes a set.
            epoch_state.clients = [Client(i) for i in pending[:SOLANA_MAX_NUM_CLIENTS]]
            self.epoch_state = epoch_state
            self._start_warmup(unix_timestamp)
        return _TICKED

    def _tick_warmup(self, unix_timestamp: int, random_seed: int) -> TickResult:
        if self._check_timeout(unix_timestamp, self.config.warmup_time):
            self._start_round_train(unix_timestamp, random_seed, self._tie_breaker_tasks())
        else:
            self._move_clients_to_exited(0)
        if len(self.epoch_state.clients) < self.config.min_clients:
            # Upstream quirk: when warmup times out, the round is started first and abandoned
            # here in the same tick; its data indices are not consumed (no cooldown).
            self._start_waiting_for_members(unix_timestamp)
            return _EPOCH_FAILED
        return _TICKED

    def _tick_round_train(self, unix_timestamp: int) -> TickResult:
        if self._check_timeout(unix_timestamp, self.config.max_round_train_time):
            self._change_state(unix_timestamp, RunState.RoundWitness)
        return _TICKED

    def _tick_round_witness(self, unix_timestamp: int, random_seed: int) -> TickResult:
        if not self._check_timeout(unix_timestamp, self.config.round_witness_time):
            return _TICKED
        current = self._current_round_unchecked()
        height = current.height
        num_witnesses = len(current.witnesses)
        leaving = self._leaving_clients()  # before any change, so a panic leaves the state intact

        epoch_state = self.epoch_state
        epoch_state.first_round = False
        self.progress.step = wrapping_u32(self.progress.step + 1)
        self._move_clients_to_exited(height, leaving)

        # Without witnesses nobody can tell "the witnesses left" from "everyone left": upstream
        # withdraws everyone and ends the epoch.
        if num_witnesses == 0:
            self.withdraw_all()
            self._start_cooldown(unix_timestamp)
            return _TICKED

        # Once the epoch's time is up, two more rounds run (the pipeline needs them); the
        # "at least 4" guard keeps very short epochs from ending too early.
        if self._check_epoch_timeout(unix_timestamp) and not epoch_state.last_step_set():
            last_step = wrapping_u32(self.progress.step + 2)
            if last_step >= 4:
                epoch_state.last_step = last_step

        if epoch_state.last_step_set() and self.progress.step == epoch_state.last_step:
            self._start_cooldown(unix_timestamp)
            return _TICKED

        if (
            len(epoch_state.clients) < self.config.min_clients
            or num_witnesses < self.witness_quorum(num_witnesses)
            or self.progress.step >= self.config.total_steps
            or self.pending_pause
        ):
            self._start_cooldown(unix_timestamp)
            return _TICKED

        self._start_round_train(unix_timestamp, random_seed, self._tie_breaker_tasks())
        return _TICKED

    def _tick_cooldown(self, unix_timestamp: int) -> TickResult:
        if not self._check_timeout(unix_timestamp, self.config.cooldown_time):
            return _TICKED
        current = self._current_round_unchecked()
        leaving = self._leaving_clients()

        last_round_batch_size = self.get_target_global_batch_size(current)
        self.progress.epoch_start_data_index = wrapping_u64(
            current.data_index + last_round_batch_size
        )
        self.progress.epoch = truncating_cast_unsigned(self.progress.epoch + 1, 16)  # wrapping
        self._move_clients_to_exited(current.height, leaving)

        # After a completed epoch the clients hold the model: new joiners fetch it from them.
        llm = self._llm()
        match llm.checkpoint:
            case Checkpoint.Hub(hub_repo) | Checkpoint.Dummy(hub_repo):
                llm.checkpoint = Checkpoint.P2P(hub_repo)
            case Checkpoint.Gcs(gcs_repo):
                llm.checkpoint = Checkpoint.P2PGcs(gcs_repo)

        if self.pending_pause:
            self.withdraw_all()
            self._change_state(unix_timestamp, RunState.Paused)
            self.pending_pause = False
            self.epoch_state.cold_start_epoch = True
        else:
            self._start_waiting_for_members(unix_timestamp)
            self.epoch_state.cold_start_epoch = False
        return _EPOCH_SUCCEEDED

    def _check_timeout(self, unix_timestamp: int, duration: int) -> bool:
        # The `!=` guard: nothing fires in the second the state was entered, even for 0 s.
        start = self.run_state_start_unix_timestamp
        return start != unix_timestamp and unix_timestamp >= wrapping_u64(duration + start)

    def _check_epoch_timeout(self, unix_timestamp: int) -> bool:
        start = self.epoch_state.start_timestamp
        return start != unix_timestamp and unix_timestamp >= wrapping_u64(
            start + self.config.epoch_time
        )

    def _start_cooldown(self, unix_timestamp: int) -> None:
        # The slot's witnesses are cleared for reuse by the next warmup.
        self._current_round_unchecked().witnesses.clear()
        self._change_state(unix_timestamp, RunState.Cooldown)

    def _tie_breaker_tasks(self) -> int:
        """Upstream starts every round with none; a verifying run with its tie-breakers
        (`psyche.coordinator.verification`)."""
        return tie_breaker_tasks_for(self.config, len(self.epoch_state.clients))

    def _start_round_train(
        self, unix_timestamp: int, random_seed: int, tie_breaker_tasks: int
    ) -> None:
        epoch_state = self.epoch_state
        if epoch_state.first_round:
            head, height, data_index = 0, 0, self.progress.epoch_start_data_index
        else:
            previous = self._current_round_unchecked()
            tokens = wrapping_u64(previous.data_index * self.get_sequence_length())
            batch_size = self.config.get_batch_size(tokens)
            head = (epoch_state.rounds_head + 1) % NUM_STORED_ROUNDS
            height = wrapping_u32(previous.height + 1)
            data_index = wrapping_u64(previous.data_index + batch_size)
        round_ = epoch_state.rounds[head]
        epoch_state.rounds_head = head
        round_.clients_len = truncating_cast_unsigned(len(epoch_state.clients), 16)
        round_.height = height
        round_.data_index = data_index
        round_.tie_breaker_tasks = tie_breaker_tasks
        round_.random_seed = random_seed
        round_.witnesses.clear()
        self._change_state(unix_timestamp, RunState.RoundTrain)

    def _start_warmup(self, unix_timestamp: int) -> None:
        self._change_state(unix_timestamp, RunState.Warmup)

    def _start_waiting_for_members(self, unix_timestamp: int) -> None:
        if self.progress.step < self.config.total_steps:
            self._change_state(unix_timestamp, RunState.WaitingForMembers)
        else:
            self._change_state(unix_timestamp, RunState.Finished)

    def _change_state(self, unix_timestamp: int, new_state: RunState) -> None:
        if self.run_state is new_state:
            raise CoordinatorPanic(
                f"assertion failed: self.run_state != new_state ({new_state.name})"
            )
        self.run_state_start_unix_timestamp = unix_timestamp
        self.run_state = new_state

    def _leaving_clients(self) -> list[Client]:
        """The clients `_move_clients_to_exited` would move; raises where upstream would panic
        moving them, so callers can check before changing anything."""
        epoch_state = self.epoch_state
        leaving = [c for c in epoch_state.clients if c.state is not ClientState.Healthy]
        if len(epoch_state.exited_clients) + len(leaving) > SOLANA_MAX_NUM_CLIENTS:
            # upstream: `exited_clients.push(*x).unwrap()` on a full FixedVec
            raise CoordinatorPanic(
                'called `Result::unwrap()` on an `Err` value: "FixedVec is full" (exited_clients)'
            )
        return leaving

    def _move_clients_to_exited(self, height: int, leaving: list[Client] | None = None) -> None:
        """Move every non-healthy client, in order, to `exited_clients`, stamped with `height`."""
        if leaving is None:
            leaving = self._leaving_clients()
        if not leaving:
            return
        epoch_state = self.epoch_state
        clients = epoch_state.clients
        clients[:] = [c for c in clients if c.state is ClientState.Healthy]
        for client in leaving:
            client.exited_height = height
            epoch_state.exited_clients.append(client)

    # ---- messages ----------------------------------------------------------------------------

    def _witness_nodes(self) -> int:
        if self.config.witness_nodes == 0:
            return min(len(self.epoch_state.clients), SOLANA_MAX_NUM_WITNESSES)
        return self.config.witness_nodes

    def _check_duplicate_witness(self, round_: Round, from_: NodeIdentity) -> None:
        clients = self.epoch_state.clients
        signer = from_.signer
        for stored in round_.witnesses:
            index = stored.proof.index
            if not 0 <= index < len(clients):
                # Upstream indexes `clients[witness.proof.index]` of the stored witnesses, which
                # panics for a stored index past the clients (warmup witnesses are unchecked).
                raise CoordinatorPanic(
                    f"index out of bounds: the len is {len(clients)} but the index is {index} "
                    "(stored witness of the current round)"
                )
            if clients[index].id.signer == signer:
                raise CoordinatorError(CoordinatorErrorKind.DuplicateWitness)

    def warmup_witness(
        self, from_: NodeIdentity, witness: Witness, unix_timestamp: int, random_seed: int
    ) -> None:
        """A client reports it is ready (has the model). Enough of them start the first round.

        Nobody checks the proof in warmup: clients send `{position: i, index: i, witness:
        false}` with `i` their own index. A warmup witness arriving after the round started is
        ignored.
        """
        _check_u64("unix_timestamp", unix_timestamp)
        _check_u64("random_seed", random_seed)
        if self.halted():
            raise CoordinatorError(CoordinatorErrorKind.Halted)
        if self.run_state is RunState.RoundTrain:
            return
        if self.run_state is not RunState.Warmup:
            raise CoordinatorError(CoordinatorErrorKind.InvalidRunState)
        witness_nodes = self._witness_nodes()
        round_ = self._current_round_unwrap()
        self._check_duplicate_witness(round_, from_)
        if len(round_.witnesses) >= SOLANA_MAX_NUM_WITNESSES:
            raise CoordinatorError(CoordinatorErrorKind.WitnessesFull)
        round_.witnesses.append(witness)
        if len(round_.witnesses) == witness_nodes:
            self._start_round_train(unix_timestamp, random_seed, self._tie_breaker_tasks())

    def witness(self, from_: NodeIdentity, witness: Witness, unix_timestamp: int) -> None:
        """A witness attests the current round (its blooms say which trainers and results it
        saw). When the last expected witness arrives during training, the round moves on to
        its witness phase at once ("opportunistic witnessing")."""
        _check_u64("unix_timestamp", unix_timestamp)
        if self.halted():
            raise CoordinatorError(CoordinatorErrorKind.Halted)
        witness_nodes = self._witness_nodes()
        if self.run_state not in (RunState.RoundWitness, RunState.RoundTrain):
            raise CoordinatorError(CoordinatorErrorKind.InvalidRunState)
        selection = CommitteeSelection.from_coordinator(self, 0)
        if not selection.verify_witness_for_client(
            from_, witness.proof, self.epoch_state.clients
        ) or not (witness.proof.witness):
            raise CoordinatorError(CoordinatorErrorKind.InvalidWitness)
        round_ = self._current_round_unwrap()
        self._check_duplicate_witness(round_, from_)
        if len(round_.witnesses) >= SOLANA_MAX_NUM_WITNESSES:
            raise CoordinatorError(CoordinatorErrorKind.WitnessesFull)
        round_.witnesses.append(witness)
        if len(round_.witnesses) == witness_nodes and self.run_state is not RunState.RoundWitness:
            self._change_state(unix_timestamp, RunState.RoundWitness)

    def health_check(self, from_: NodeIdentity, checks: HealthChecks) -> int:
        """Accuse trainers of the previous round of not training; returns how many were dropped.

        The whole message is rejected if any accused node turns out healthy. `from_` is not
        used (upstream leaves rewarding the reporter for later).
        """
        if self.halted():
            raise CoordinatorError(CoordinatorErrorKind.Halted)
        current = self.current_round()
        if current is None:
            raise CoordinatorError(CoordinatorErrorKind.NoActiveRound)
        # Only once the pipeline is full.
        if current.height < 2:
            raise CoordinatorError(CoordinatorErrorKind.InvalidHealthCheck)
        for node_id, proof in checks:
            if self.healthy(node_id, proof):
                raise CoordinatorError(CoordinatorErrorKind.InvalidHealthCheck)
        clients = self.epoch_state.clients
        for _, proof in checks:
            if not 0 <= proof.index < len(clients):
                # Upstream then indexes the *current* clients with the proof's historical index.
                raise CoordinatorPanic(
                    f"index out of bounds: the len is {len(clients)} but the index is "
                    f"{proof.index} (health check)"
                )
        dropped = 0
        for _, proof in checks:
            client = clients[proof.index]
            if client.state is ClientState.Healthy:
                client.state = ClientState.Dropped
                dropped += 1
        return dropped

    def checkpoint(self, from_: NodeIdentity, index: int, checkpoint_repo: Checkpoint) -> None:
        """A client reports a new checkpoint of the model; the run's checkpoint follows it.

        No run-state check, as upstream. With several checkpointers the last one wins.
        """
        clients = self.epoch_state.clients
        if not 0 <= index < len(clients) or clients[index].id.signer != from_.signer:
            raise CoordinatorError(CoordinatorErrorKind.InvalidCommitteeProof)
        llm = self._llm()
        # Upstream's six arms: a P2P run stays P2P, falling back to the reported repo (hub or
        # GCS); a hub or GCS run takes a repo of its own kind; anything else is ignored.
        match (llm.checkpoint, checkpoint_repo):
            case (Checkpoint.P2P(_) | Checkpoint.P2PGcs(_), Checkpoint.Hub(hub_repo)):
                llm.checkpoint = Checkpoint.P2P(hub_repo)
            case (Checkpoint.P2P(_) | Checkpoint.P2PGcs(_), Checkpoint.Gcs(gcs_repo)):
                llm.checkpoint = Checkpoint.P2PGcs(gcs_repo)
            case (Checkpoint.Hub(_), Checkpoint.Hub(hub_repo)):
                llm.checkpoint = Checkpoint.Hub(hub_repo)
            case (Checkpoint.Gcs(_), Checkpoint.Gcs(gcs_repo)):
                llm.checkpoint = Checkpoint.Gcs(gcs_repo)

    def withdraw(self, index: int) -> None:
        clients = self.epoch_state.clients
        if 0 <= index < len(clients):
            client = clients[index]
            if client.state is ClientState.Healthy:
                client.state = ClientState.Withdrawn
                return
        raise CoordinatorError(CoordinatorErrorKind.InvalidWithdraw)

    def withdraw_all(self) -> None:
        for client in self.epoch_state.clients:
            if client.state is ClientState.Healthy:
                client.state = ClientState.Withdrawn

    def pause(self, unix_timestamp: int) -> None:
        """Pause now when no round runs; otherwise at the end of the current epoch."""
        _check_u64("unix_timestamp", unix_timestamp)
        if self.halted():
            raise CoordinatorError(CoordinatorErrorKind.Halted)
        if self.active():
            self.pending_pause = True
        else:
            self.withdraw_all()
            self._change_state(unix_timestamp, RunState.Paused)
            self.epoch_state.cold_start_epoch = True

    def resume(self, unix_timestamp: int) -> None:
        _check_u64("unix_timestamp", unix_timestamp)
        if self.run_state is not RunState.Paused:
            raise CoordinatorError(CoordinatorErrorKind.CannotResume)
        self._start_waiting_for_members(unix_timestamp)


def _check_u64(name: str, value: int) -> None:
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"{name} {value} is not a u64")
