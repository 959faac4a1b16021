"""The coordinator's state: a run's configuration, progress, and the current epoch's rounds.

Field order is wire order (postcard for the centralized protocol, the on-chain layout for Solana),
so these declarations mirror upstream's `coordinator.rs` exactly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from psyche.coordinator.config import (
    SOLANA_MAX_NUM_CLIENTS,
    SOLANA_MAX_NUM_WITNESSES,
    CoordinatorConfig,
)
from psyche.coordinator.model import Model
from psyche.core.bloom import Bloom
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import (
    F32,
    I32,
    U8,
    U16,
    U32,
    U64,
    Array,
    FixedStr,
    FixedVec,
    RustEnum,
    SmallBool,
    struct,
)

SOLANA_RUN_ID_MAX_LEN = 32
NUM_STORED_ROUNDS = 4
MAX_TOKENS_TO_SEND = 16
BLOOM_FALSE_RATE = 0.01
# (sic) upstream's spelling
WITNESS_QUORUM_RAIO = 2.0 / 3.0


class WitnessBloom(Bloom, num_words=16, num_keys=8):
    """The coordinator's bloom filter: 1024 bits, 8 hash keys."""


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


class Committee(RustEnum):
    TieBreaker = 0
    Verifier = 1
    Trainer = 2

    def __str__(self) -> str:
        return {0: "Tie breaker", 1: "Verifier", 2: "Trainer"}[self.value]


@struct(frozen=True)
class CommitteeProof:
    committee: Committee = Committee.TieBreaker
    position: U64 = 0
    index: U64 = 0


@struct(frozen=True)
class WitnessProof:
    # Position in the witness shuffle of the round.
    position: U64 = 0
    # Index of the sender in epoch_state.clients.
    index: U64 = 0
    # Whether the sender claims to be a witness this round.
    witness: SmallBool = False


@struct
class Witness:
    proof: WitnessProof = dataclasses.field(default_factory=WitnessProof)
    participant_bloom: WitnessBloom = dataclasses.field(default_factory=WitnessBloom)
    broadcast_bloom: WitnessBloom = dataclasses.field(default_factory=WitnessBloom)
    broadcast_merkle: MerkleRoot = dataclasses.field(default_factory=MerkleRoot)


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


@struct
class CoordinatorProgress:
    epoch: U16 = 0
    # Upstream's serde default starts at step 1 (`Coordinator::zeroed()` has step 0).
    step: U32 = 1
    epoch_start_data_index: U64 = 0

    def check(self) -> bool:
        return self.step > 0


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
