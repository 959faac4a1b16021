"""The coordinator: a run's shared state and the state machine every backend runs.

Field order is wire order (postcard for the centralized protocol, the on-chain layout for Solana),
so the declarations mirror upstream's `coordinator.rs` exactly.

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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from psyche.coordinator.commitment import Commitment
from psyche.coordinator.committee_selection import (
    Committee,
    CommitteeProof,
    CommitteeSelection,
    WitnessProof,
)
from psyche.coordinator.config import (
    SOLANA_MAX_NUM_CLIENTS,
    SOLANA_MAX_NUM_WITNESSES,
    CoordinatorConfig,
)
from psyche.coordinator.errors import (
    CoordinatorError,
    CoordinatorErrorKind,
    CoordinatorPanic,
    CoordinatorUnimplemented,
)
from psyche.coordinator.model import (
    LLM,
    Checkpoint,
    LLMArchitecture,
    LLMTrainingDataLocation,
    LLMTrainingDataType,
    Model,
)
from psyche.core.bloom import WitnessBloom
from psyche.core.definitions import ConstantLR, LearningRateSchedule, OptimizerDefinition
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.node_identity import NodeIdentity
from psyche.core.numeric import U64_MAX, truncating_cast_unsigned, wrapping_u32, wrapping_u64
from psyche.core.serde import (
    F32,
    I32,
    U8,
    U16,
    U32,
    U64,
    Array,
    DataEnum,
    FixedStr,
    FixedVec,
    RustEnum,
    SmallBool,
    struct,
    to_bytes,
    variant,
)
from psyche.core.sha256 import sha256

__all__ = [
    "BLOOM_FALSE_RATE",
    "MAX_TOKENS_TO_SEND",
    "NUM_STORED_ROUNDS",
    "SOLANA_RUN_ID_MAX_LEN",
    "WITNESS_QUORUM_RAIO",
    "Client",
    "ClientState",
    "Committee",
    "CommitteeProof",
    "Coordinator",
    "CoordinatorEpochState",
    "CoordinatorProgress",
    "HealthChecks",
    "Round",
    "RunState",
    "TickResult",
    "Witness",
    "WitnessBloom",
    "WitnessEvalResult",
    "WitnessMetadata",
    "WitnessProof",
]

SOLANA_RUN_ID_MAX_LEN = 32
NUM_STORED_ROUNDS = 4
MAX_TOKENS_TO_SEND = 16
BLOOM_FALSE_RATE = 0.01
# (sic) upstream's spelling
WITNESS_QUORUM_RAIO = 2.0 / 3.0


class RunState(RustEnum):
    Uninitialized = 0
    WaitingForMembers = 1
    Warmup = 2
    RoundTrain = 3
    RoundWitness = 4
    Cooldown = 5
    Finished = 6
    Paused = 7

    def __str__(self) -> str:
        return _RUN_STATE_DISPLAY[self]


_RUN_STATE_DISPLAY = {
    RunState.Uninitialized: "Uninitialized",
    RunState.WaitingForMembers: "Waiting for members",
    RunState.Warmup: "Warmup",
    RunState.RoundTrain: "Training",
    RunState.RoundWitness: "Witness",
    RunState.Cooldown: "Cooldown",
    RunState.Finished: "Finished",
    RunState.Paused: "Paused",
}
_HALTED = frozenset((RunState.Uninitialized, RunState.Finished, RunState.Paused))
_ACTIVE = frozenset((RunState.RoundTrain, RunState.RoundWitness, RunState.Cooldown))


class ClientState(RustEnum):
    Healthy = 0
    Dropped = 1
    Withdrawn = 2
    # Never set by the centralized backend.
    Ejected = 3

    def __str__(self) -> str:
        return self.name


@struct(eq=False)
class Client:
    id: NodeIdentity
    state: ClientState = ClientState.Healthy
    exited_height: U32 = 0

    # Upstream compares and hashes clients by identity only.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Client) and self.id == other.id

    def __hash__(self) -> int:
        return hash(self.id)


@struct
class Witness:
    proof: WitnessProof = dataclasses.field(default_factory=WitnessProof)
    participant_bloom: WitnessBloom = dataclasses.field(default_factory=WitnessBloom)
    broadcast_bloom: WitnessBloom = dataclasses.field(default_factory=WitnessBloom)
    broadcast_merkle: MerkleRoot = dataclasses.field(default_factory=MerkleRoot)

    def copy(self) -> Witness:
        return Witness(
            self.proof,
            self.participant_bloom.copy(),
            self.broadcast_bloom.copy(),
            self.broadcast_merkle,
        )


@struct
class WitnessEvalResult:
    name: FixedStr[32]
    value: F32

    @classmethod
    def new_trunc_name(cls, name: str, value: float) -> WitnessEvalResult:
        raw = name.encode("utf-8")[:32]
        return cls(raw.decode("utf-8", errors="replace"), value)


@struct
class WitnessMetadata:
    """Statistics a witness sends alongside its witness; the coordinator ignores them."""

    step: U32 = 0
    tokens_per_sec: F32 = 0.0
    bandwidth_per_sec: F32 = 0.0
    loss: F32 = 0.0
    evals: FixedVec[WitnessEvalResult, 8] = dataclasses.field(default_factory=list)
    prompt_results: FixedVec[I32, MAX_TOKENS_TO_SEND] = dataclasses.field(default_factory=list)
    prompt_index: U8 = 0
    # (sic) upstream's spelling
    efficency: F32 = 0.0


@struct
class Round:
    witnesses: FixedVec[Witness, SOLANA_MAX_NUM_WITNESSES] = dataclasses.field(default_factory=list)
    data_index: U64 = 0
    random_seed: U64 = 0
    height: U32 = 0
    clients_len: U16 = 0
    tie_breaker_tasks: U16 = 0

    def copy(self) -> Round:
        return Round(
            [w.copy() for w in self.witnesses],
            self.data_index,
            self.random_seed,
            self.height,
            self.clients_len,
            self.tie_breaker_tasks,
        )


def _empty_rounds() -> list[Round]:
    return [Round() for _ in range(NUM_STORED_ROUNDS)]


@struct
class CoordinatorEpochState:
    rounds: Array[Round, NUM_STORED_ROUNDS] = dataclasses.field(default_factory=_empty_rounds)
    # The current clients. A message about an earlier round must look clients up through
    # `Coordinator.get_client_at_historical_index`: this list may have changed since.
    clients: FixedVec[Client, SOLANA_MAX_NUM_CLIENTS] = dataclasses.field(default_factory=list)
    exited_clients: FixedVec[Client, SOLANA_MAX_NUM_CLIENTS] = dataclasses.field(
        default_factory=list
    )
    rounds_head: U32 = 0
    start_step: U32 = 0
    # 0 means "not set".
    last_step: U32 = 0
    start_timestamp: U64 = 0
    first_round: SmallBool = True
    cold_start_epoch: SmallBool = False

    @classmethod
    def zeroed(cls) -> CoordinatorEpochState:
        """All-zero state (upstream `Zeroable`), unlike `Default`, which starts a first round."""
        return cls(first_round=False)

    def last_step_set(self) -> bool:
        return self.last_step != 0

    def copy(self) -> CoordinatorEpochState:
        return CoordinatorEpochState(
            [r.copy() for r in self.rounds],
            [Client(c.id, c.state, c.exited_height) for c in self.clients],
            [Client(c.id, c.state, c.exited_height) for c in self.exited_clients],
            self.rounds_head,
            self.start_step,
            self.last_step,
            self.start_timestamp,
            self.first_round,
            self.cold_start_epoch,
        )


@struct
class CoordinatorProgress:
    epoch: U16 = 0
    # Upstream's serde default starts at step 1 (`Coordinator::zeroed()` has step 0).
    step: U32 = 1
    epoch_start_data_index: U64 = 0

    def check(self) -> bool:
        return self.step > 0


class TickResult(DataEnum):
    """What a tick did: `Ticked()`, or `EpochEnd(success)` when an epoch ended."""

    Ticked = variant()
    EpochEnd = variant(bool)


# The body of a health-check message: (accused node, its committee proof in the previous round).
HealthChecks = list[tuple[NodeIdentity, CommitteeProof]]


def _error(kind: CoordinatorErrorKind) -> CoordinatorError:
    return CoordinatorError(kind)


@struct(kw_only=True)
class Coordinator:
    run_id: FixedStr[SOLANA_RUN_ID_MAX_LEN]
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
        config = CoordinatorConfig(**{f.name: 0 for f in dataclasses.fields(CoordinatorConfig)})
        return cls(
            run_id="",
            run_state=RunState.Uninitialized,
            model=Model.LLM(llm),
            config=config,
            progress=CoordinatorProgress(0, 0, 0),
            epoch_state=CoordinatorEpochState.zeroed(),
        )

    @classmethod
    def from_state_toml(cls, path: Path | str) -> Coordinator:
        """Load a state file (`state.toml`), fully validated; raises `ConfigFileError`."""
        from psyche.coordinator.run_config import ConfigFileError, load_run_config

        loaded = load_run_config(path)
        if loaded.coordinator is None:
            raise ConfigFileError(
                path, [("run_id", "missing: a state file needs run_id and run_state")]
            )
        coordinator: Coordinator = loaded.coordinator
        return coordinator

    def to_toml_obj(self) -> dict[str, Any]:
        """This state as a TOML document (backup data locations as `data_locations`)."""
        from psyche.coordinator.run_config import model_to_obj
        from psyche.core.serde import to_obj

        obj: dict[str, Any] = to_obj(self, Coordinator)
        obj["model"] = model_to_obj(self.model)
        return obj

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

    __hash__ = None  # type: ignore[assignment]

    def _llm(self) -> LLM:
        return self.model.value  # type: ignore[attr-defined,no-any-return]

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
        if state in _HALTED:
            raise _error(CoordinatorErrorKind.Halted)
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
            return TickResult.Ticked()
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
        return TickResult.Ticked()

    def _tick_warmup(self, unix_timestamp: int, random_seed: int) -> TickResult:
        if self._check_timeout(unix_timestamp, self.config.warmup_time):
            self._start_round_train(unix_timestamp, random_seed, 0)
        else:
            self._move_clients_to_exited(0)
        if len(self.epoch_state.clients) < self.config.min_clients:
            # Upstream quirk: when warmup times out, the round is started first and abandoned
            # here in the same tick; its data indices are not consumed (no cooldown).
            self._start_waiting_for_members(unix_timestamp)
            return TickResult.EpochEnd(False)
        return TickResult.Ticked()

    def _tick_round_train(self, unix_timestamp: int) -> TickResult:
        if self._check_timeout(unix_timestamp, self.config.max_round_train_time):
            self._change_state(unix_timestamp, RunState.RoundWitness)
        return TickResult.Ticked()

    def _tick_round_witness(self, unix_timestamp: int, random_seed: int) -> TickResult:
        if not self._check_timeout(unix_timestamp, self.config.round_witness_time):
            return TickResult.Ticked()
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
            return TickResult.Ticked()

        # Once the epoch's time is up, two more rounds run (the pipeline needs them); the
        # "at least 4" guard keeps very short epochs from ending too early.
        if self._check_epoch_timeout(unix_timestamp) and not epoch_state.last_step_set():
            last_step = wrapping_u32(self.progress.step + 2)
            if last_step >= 4:
                epoch_state.last_step = last_step

        if epoch_state.last_step_set() and self.progress.step == epoch_state.last_step:
            self._start_cooldown(unix_timestamp)
            return TickResult.Ticked()

        if (
            len(epoch_state.clients) < self.config.min_clients
            or num_witnesses < self.witness_quorum(num_witnesses)
            or self.progress.step >= self.config.total_steps
            or self.pending_pause
        ):
            self._start_cooldown(unix_timestamp)
            return TickResult.Ticked()

        self._start_round_train(unix_timestamp, random_seed, 0)
        return TickResult.Ticked()

    def _tick_cooldown(self, unix_timestamp: int) -> TickResult:
        if not self._check_timeout(unix_timestamp, self.config.cooldown_time):
            return TickResult.Ticked()
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
        return TickResult.EpochEnd(True)

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
                raise _error(CoordinatorErrorKind.DuplicateWitness)

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
            raise _error(CoordinatorErrorKind.Halted)
        if self.run_state is RunState.RoundTrain:
            return
        if self.run_state is not RunState.Warmup:
            raise _error(CoordinatorErrorKind.InvalidRunState)
        witness_nodes = self._witness_nodes()
        round_ = self._current_round_unwrap()
        self._check_duplicate_witness(round_, from_)
        if len(round_.witnesses) >= SOLANA_MAX_NUM_WITNESSES:
            raise _error(CoordinatorErrorKind.WitnessesFull)
        round_.witnesses.append(witness)
        if len(round_.witnesses) == witness_nodes:
            self._start_round_train(unix_timestamp, random_seed, 0)

    def witness(self, from_: NodeIdentity, witness: Witness, unix_timestamp: int) -> None:
        """A witness attests the current round (its blooms say which trainers and results it
        saw). When the last expected witness arrives during training, the round moves on to
        its witness phase at once ("opportunistic witnessing")."""
        _check_u64("unix_timestamp", unix_timestamp)
        if self.halted():
            raise _error(CoordinatorErrorKind.Halted)
        witness_nodes = self._witness_nodes()
        if self.run_state not in (RunState.RoundWitness, RunState.RoundTrain):
            raise _error(CoordinatorErrorKind.InvalidRunState)
        selection = CommitteeSelection.from_coordinator(self, 0)
        if not selection.verify_witness_for_client(
            from_, witness.proof, self.epoch_state.clients
        ) or not (witness.proof.witness):
            raise _error(CoordinatorErrorKind.InvalidWitness)
        round_ = self._current_round_unwrap()
        self._check_duplicate_witness(round_, from_)
        if len(round_.witnesses) >= SOLANA_MAX_NUM_WITNESSES:
            raise _error(CoordinatorErrorKind.WitnessesFull)
        round_.witnesses.append(witness)
        if len(round_.witnesses) == witness_nodes and self.run_state is not RunState.RoundWitness:
            self._change_state(unix_timestamp, RunState.RoundWitness)

    def health_check(self, from_: NodeIdentity, checks: HealthChecks) -> int:
        """Accuse trainers of the previous round of not training; returns how many were dropped.

        The whole message is rejected if any accused node turns out healthy. `from_` is not
        used (upstream leaves rewarding the reporter for later).
        """
        if self.halted():
            raise _error(CoordinatorErrorKind.Halted)
        current = self.current_round()
        if current is None:
            raise _error(CoordinatorErrorKind.NoActiveRound)
        # Only once the pipeline is full.
        if current.height < 2:
            raise _error(CoordinatorErrorKind.InvalidHealthCheck)
        for node_id, proof in checks:
            if self.healthy(node_id, proof):
                raise _error(CoordinatorErrorKind.InvalidHealthCheck)
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
            raise _error(CoordinatorErrorKind.InvalidCommitteeProof)
        llm = self._llm()
        match (llm.checkpoint, checkpoint_repo):
            case (Checkpoint.P2P(_), Checkpoint.Hub(hub_repo)):
                llm.checkpoint = Checkpoint.P2P(hub_repo)
            case (Checkpoint.P2PGcs(_), Checkpoint.Gcs(gcs_repo)):
                llm.checkpoint = Checkpoint.P2PGcs(gcs_repo)
            case (Checkpoint.Hub(_), Checkpoint.Hub(hub_repo)):
                llm.checkpoint = Checkpoint.Hub(hub_repo)
            case (Checkpoint.Gcs(_), Checkpoint.Gcs(gcs_repo)):
                llm.checkpoint = Checkpoint.Gcs(gcs_repo)
            case (Checkpoint.P2PGcs(_), Checkpoint.Hub(hub_repo)):
                llm.checkpoint = Checkpoint.P2P(hub_repo)
            case (Checkpoint.P2P(_), Checkpoint.Gcs(gcs_repo)):
                llm.checkpoint = Checkpoint.P2PGcs(gcs_repo)
            case _:
                pass

    def withdraw(self, index: int) -> None:
        clients = self.epoch_state.clients
        if 0 <= index < len(clients):
            client = clients[index]
            if client.state is ClientState.Healthy:
                client.state = ClientState.Withdrawn
                return
        raise _error(CoordinatorErrorKind.InvalidWithdraw)

    def withdraw_all(self) -> None:
        for client in self.epoch_state.clients:
            if client.state is ClientState.Healthy:
                client.state = ClientState.Withdrawn

    def pause(self, unix_timestamp: int) -> None:
        """Pause now when no round runs; otherwise at the end of the current epoch."""
        _check_u64("unix_timestamp", unix_timestamp)
        if self.halted():
            raise _error(CoordinatorErrorKind.Halted)
        if self.active():
            self.pending_pause = True
        else:
            self.withdraw_all()
            self._change_state(unix_timestamp, RunState.Paused)
            self.epoch_state.cold_start_epoch = True

    def resume(self, unix_timestamp: int) -> None:
        _check_u64("unix_timestamp", unix_timestamp)
        if self.run_state is not RunState.Paused:
            raise _error(CoordinatorErrorKind.CannotResume)
        self._start_waiting_for_members(unix_timestamp)

    # ---- health --------------------------------------------------------------------------------

    def healthy(self, node_id: NodeIdentity, proof: CommitteeProof) -> bool:
        """Whether `node_id` did its duty in the previous round, given its committee proof.

        Raises `CoordinatorError(InvalidCommitteeProof)` for a proof that does not belong to
        `node_id`, and `CoordinatorUnimplemented` for tie-breakers and verifiers (upstream's
        `todo!()`).
        """
        round_ = self.previous_round()
        if round_ is None:
            raise _error(CoordinatorErrorKind.NoActiveRound)
        index = proof.index
        if not 0 <= index < round_.clients_len:
            raise _error(CoordinatorErrorKind.InvalidCommitteeProof)
        client = self.get_client_at_historical_index(index, round_.clients_len)
        if client is None:
            raise _error(CoordinatorErrorKind.InvalidCommitteeProof)
        selection = CommitteeSelection.from_coordinator(self, -1)
        if client.id.signer != node_id.signer or not selection.verify_committee_for_client(
            client.id, proof, self.epoch_state.clients
        ):
            raise _error(CoordinatorErrorKind.InvalidCommitteeProof)
        if proof.committee is Committee.Trainer:
            return self.trainer_healthy(client.id)
        raise CoordinatorUnimplemented(
            f"not yet implemented: health of a {proof.committee.name} (upstream `todo!()`)"
        )

    def witness_quorum(self, num_witnesses: int) -> int:
        """Witnesses needed to agree; with `witness_nodes` 0 it depends on who showed up."""
        witness_nodes = self.config.witness_nodes or truncating_cast_unsigned(num_witnesses, 16)
        if witness_nodes == 0:
            raise CoordinatorPanic(
                "internal error: entered unreachable code (witness quorum of zero witnesses)"
            )
        if witness_nodes == 1:
            return 1
        if witness_nodes in (2, 3):
            return 2
        # f64 product truncated by `as u16`, at least 1
        return max(int(witness_nodes * WITNESS_QUORUM_RAIO), 1)

    def trainer_healthy(self, node_id: NodeIdentity) -> bool:
        round_ = self.previous_round()
        if round_ is None:
            raise _error(CoordinatorErrorKind.NoActiveRound)
        score = self.trainer_healthy_score_by_witnesses(node_id, round_.witnesses)
        return score >= self.witness_quorum(len(round_.witnesses))

    @staticmethod
    def trainer_healthy_score_by_witnesses(
        node_id: NodeIdentity, witnesses: Sequence[Witness]
    ) -> int:
        """How many witnesses list `node_id` (its signer's sha256) in their participant bloom."""
        item = sha256(node_id.signer)
        return sum(1 for w in witnesses if w.participant_bloom.contains(item))

    @staticmethod
    def select_consensus_commitment_by_witnesses(
        commitments: Sequence[Commitment], witnesses: Sequence[Witness], witness_quorum: int
    ) -> int | None:
        """Index of the commitment most witnesses saw (at least `witness_quorum`), or None.

        Each witness votes for the first commitment found in its broadcast bloom. Ties go to
        the *last* index, as Rust's `max_by_key` does.
        """
        scores = [0] * len(commitments)
        for witness in witnesses:
            for index, commitment in enumerate(commitments):
                if witness.broadcast_bloom.contains(commitment.data_hash):
                    scores[index] += 1
                    break
        best: int | None = None
        for index, score in enumerate(scores):
            if score >= witness_quorum and (best is None or score >= scores[best]):
                best = index
        return best

    # ---- queries -------------------------------------------------------------------------------

    def current_round(self) -> Round | None:
        head = self.epoch_state.rounds_head
        return self.epoch_state.rounds[head] if head < NUM_STORED_ROUNDS else None

    def _current_round_unchecked(self) -> Round:
        round_ = self.current_round()
        if round_ is None:
            raise CoordinatorPanic(
                f"index out of bounds: the len is {NUM_STORED_ROUNDS} but the index is "
                f"{self.epoch_state.rounds_head} (rounds_head)"
            )
        return round_

    def _current_round_unwrap(self) -> Round:
        round_ = self.current_round()
        if round_ is None:
            raise CoordinatorPanic("called `Option::unwrap()` on a `None` value (current round)")
        return round_

    def previous_round(self) -> Round | None:
        current = self.current_round()
        if current is None:
            return None
        head = self.epoch_state.rounds_head
        if head == 0 and current.height == 0:
            return None
        return self.epoch_state.rounds[NUM_STORED_ROUNDS - 1 if head == 0 else head - 1]

    def previous_previous_round(self) -> Round | None:
        current = self.current_round()
        if current is None:
            return None
        head = self.epoch_state.rounds_head
        if head == 0 and current.height <= 1:
            return None
        # Upstream quirk kept: at head 1 this is slot 3 even in an epoch's second round, when
        # slot 3 still holds a zeroed (or stale) round.
        rounds = self.epoch_state.rounds
        if head == 0:
            return rounds[NUM_STORED_ROUNDS - 2]
        if head == 1:
            return rounds[NUM_STORED_ROUNDS - 1]
        return rounds[head - 2]

    def active(self) -> bool:
        return self.run_state in _ACTIVE

    def halted(self) -> bool:
        return self.run_state in _HALTED

    def get_client_at_historical_index(self, n: int, prev_clients_len: int) -> Client | None:
        """The client that had index `n` in a round of `prev_clients_len` clients.

        Clients only leave during an epoch, each appended to `exited_clients`; this walks that
        list from its end (upstream's rule, exact only while the order of exits matches).
        """
        clients = self.epoch_state.clients
        if n < 0:
            return None  # (a u64 upstream)
        if n < len(clients):
            return clients[n]
        if n < prev_clients_len:
            offset = prev_clients_len - n - 1
            exited = self.epoch_state.exited_clients
            return exited[len(exited) - 1 - offset] if offset < len(exited) else None
        return None

    def get_historical_clients(self, clients_len: int) -> list[Client]:
        found = (self.get_client_at_historical_index(i, clients_len) for i in range(clients_len))
        return [c for c in found if c is not None]

    def get_sequence_length(self) -> int:
        return self._llm().max_seq_len

    def total_tokens_processed(self, round_: Round | None) -> int:
        """Tokens trained before `round_` (before the epoch when None)."""
        start = round_.data_index if round_ is not None else self.progress.epoch_start_data_index
        return wrapping_u64(start * self.get_sequence_length())

    def get_target_global_batch_size(self, round_: Round | None) -> int:
        return self.config.get_batch_size(self.total_tokens_processed(round_))

    def get_cold_start_warmup_bounds(self) -> tuple[int, int] | None:
        steps = self._llm().cold_start_warmup_steps
        if not self.epoch_state.cold_start_epoch or steps == 0:
            return None
        start = self.epoch_state.start_step
        return (start, wrapping_u32(start + steps))

    def check_cold_start_warmup_steps(self) -> bool:
        """Whether the cold-start warmup fits in one epoch's rounds (an estimate)."""
        steps = self._llm().cold_start_warmup_steps
        if steps == 0:
            return True
        config = self.config
        if config.max_round_train_time == 0:
            raise CoordinatorPanic("attempt to divide by zero (max_round_train_time)")
        training_time = wrapping_u64(config.epoch_time - config.warmup_time)
        return steps <= training_time // config.max_round_train_time

    def is_warmup_just_starting(self) -> bool:
        return bool(self.epoch_state.first_round) and self.run_state is RunState.Warmup

    def is_training_just_starting(self) -> bool:
        return bool(self.epoch_state.first_round) and self.run_state is RunState.RoundTrain


def _check_u64(name: str, value: int) -> None:
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"{name} {value} is not a u64")
