"""The run's state types, field for field in upstream's wire order (`coordinator.rs`).

Field order is wire order (postcard for the centralized protocol, the on-chain layout for Solana),
so the declarations mirror upstream's `coordinator.rs` exactly. The `Coordinator` that holds them
and changes them is in `coordinator.py`; what is read off them, in `consensus.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from psyche.coordinator.committee_selection import CommitteeProof, WitnessProof
from psyche.coordinator.config import SOLANA_MAX_NUM_CLIENTS, SOLANA_MAX_NUM_WITNESSES
from psyche.core.bloom import WitnessBloom
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
    DataEnum,
    FixedStr,
    FixedVec,
    RustEnum,
    SmallBool,
    struct,
    variant,
)

__all__ = [
    "BLOOM_FALSE_RATE",
    "MAX_TOKENS_TO_SEND",
    "NUM_STORED_ROUNDS",
    "SOLANA_RUN_ID_MAX_LEN",
    "Client",
    "ClientState",
    "CoordinatorEpochState",
    "CoordinatorProgress",
    "HealthChecks",
    "Round",
    "RunState",
    "TickResult",
    "Witness",
    "WitnessEvalResult",
    "WitnessMetadata",
]

SOLANA_RUN_ID_MAX_LEN = 32
NUM_STORED_ROUNDS = 4
MAX_TOKENS_TO_SEND = 16
BLOOM_FALSE_RATE = 0.01


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
    name: Annotated[str, FixedStr(32)]
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
    evals: Annotated[list[WitnessEvalResult], FixedVec(8)] = dataclasses.field(default_factory=list)
    prompt_results: Annotated[list[I32], FixedVec(MAX_TOKENS_TO_SEND)] = dataclasses.field(
        default_factory=list
    )
    prompt_index: U8 = 0
    # (sic) upstream's spelling
    efficency: F32 = 0.0


@struct
class Round:
    witnesses: Annotated[list[Witness], FixedVec(SOLANA_MAX_NUM_WITNESSES)] = dataclasses.field(
        default_factory=list
    )
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
    rounds: Annotated[list[Round], Array(NUM_STORED_ROUNDS)] = dataclasses.field(
        default_factory=_empty_rounds
    )
    # The current clients. A message about an earlier round must look clients up through
    # `Coordinator.get_client_at_historical_index`: this list may have changed since.
    clients: Annotated[list[Client], FixedVec(SOLANA_MAX_NUM_CLIENTS)] = dataclasses.field(
        default_factory=list
    )
    exited_clients: Annotated[list[Client], FixedVec(SOLANA_MAX_NUM_CLIENTS)] = dataclasses.field(
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
