"""The Psyche coordinator: run configuration, state machine, committee and data selection.

Research code can drive a coordinator directly::

    coordinator = load_state_toml("state.toml")
    coordinator.tick(pending_clients, now, seed)
    selection = CommitteeSelection.from_coordinator(coordinator, 0)
    batches = assign_data_for_state(coordinator, selection)

(`load_state_toml` is in `psyche.coordinator.run_config`.) The server's rules around the state
machine are `psyche.coordinator.server_core.ServerCore`; `psyche.coordinator.testing` drives one
as a server and honest clients would. See docs/coordinator.md.
"""

from psyche.coordinator.commitment import Commitment
from psyche.coordinator.committee_selection import (
    COMMITTEE_SALT,
    WITNESS_SALT,
    Committee,
    CommitteeProof,
    CommitteeSelection,
    WitnessProof,
)
from psyche.coordinator.config import (
    SOLANA_MAX_NUM_CLIENTS,
    SOLANA_MAX_NUM_WITNESSES,
    WAITING_FOR_MEMBERS_EXTRA_SECONDS,
    ConfigError,
    CoordinatorConfig,
)
from psyche.coordinator.consensus import WITNESS_QUORUM_RAIO
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.data_selection import (
    assign_data_for_state,
    get_batch_ids_for_node,
    get_batch_ids_for_round,
    get_data_index_for_step,
)
from psyche.coordinator.errors import (
    CoordinatorError,
    CoordinatorErrorKind,
    CoordinatorPanic,
    CoordinatorUnimplemented,
)
from psyche.coordinator.model import (
    LLM,
    SOLANA_MAX_STRING_LEN,
    SOLANA_MAX_URL_STRING_LEN,
    Checkpoint,
    GcsRepo,
    HubRepo,
    LLMArchitecture,
    LLMTrainingDataLocation,
    LLMTrainingDataType,
    Model,
)
from psyche.coordinator.run_state import (
    BLOOM_FALSE_RATE,
    MAX_TOKENS_TO_SEND,
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
    WitnessEvalResult,
    WitnessMetadata,
)
from psyche.core.bloom import WitnessBloom

__all__ = [
    "BLOOM_FALSE_RATE",
    "COMMITTEE_SALT",
    "LLM",
    "MAX_TOKENS_TO_SEND",
    "NUM_STORED_ROUNDS",
    "SOLANA_MAX_NUM_CLIENTS",
    "SOLANA_MAX_NUM_WITNESSES",
    "SOLANA_MAX_STRING_LEN",
    "SOLANA_MAX_URL_STRING_LEN",
    "SOLANA_RUN_ID_MAX_LEN",
    "WAITING_FOR_MEMBERS_EXTRA_SECONDS",
    "WITNESS_QUORUM_RAIO",
    "WITNESS_SALT",
    "Checkpoint",
    "Client",
    "ClientState",
    "Commitment",
    "Committee",
    "CommitteeProof",
    "CommitteeSelection",
    "ConfigError",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorEpochState",
    "CoordinatorError",
    "CoordinatorErrorKind",
    "CoordinatorPanic",
    "CoordinatorProgress",
    "CoordinatorUnimplemented",
    "GcsRepo",
    "HealthChecks",
    "HubRepo",
    "LLMArchitecture",
    "LLMTrainingDataLocation",
    "LLMTrainingDataType",
    "Model",
    "Round",
    "RunState",
    "TickResult",
    "Witness",
    "WitnessBloom",
    "WitnessEvalResult",
    "WitnessMetadata",
    "WitnessProof",
    "assign_data_for_state",
    "get_batch_ids_for_node",
    "get_batch_ids_for_round",
    "get_data_index_for_step",
]
