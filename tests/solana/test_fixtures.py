"""Upstream's coordinator account dumps: every value upstream's data-layout test asserts.

Skipped when PSYCHE_UPSTREAM_DATA is unset; a failure when it is set and a dump is missing.
"""

from __future__ import annotations

import pytest

from psyche.coordinator import Round, RunState
from psyche.coordinator.model import (
    Checkpoint,
    HttpTrainingDataLocation,
    HubRepo,
    LLMArchitecture,
    LLMTrainingDataLocation,
    LLMTrainingDataType,
)
from psyche.core.data_shuffle import Shuffle
from psyche.core.definitions import LearningRateSchedule, OptimizerDefinition
from psyche.core.numeric import to_f32
from psyche.core.token_size import TokenSize
from psyche.solana.localnet.ledger import Ledger
from psyche.solana.state import (
    CoordinatorAccountError,
    CoordinatorAccountErrorKind,
    coordinator_account_from_bytes,
    coordinator_account_to_bytes,
)

from ..upstream_data import UpstreamData


@pytest.fixture(scope="module")
def v1(upstream_data: UpstreamData) -> bytes:
    return upstream_data.path("solana", "coordinator-account-v1.so").read_bytes()


def test_v1_fixture_values(v1: bytes) -> None:
    account = coordinator_account_from_bytes(v1)
    state = account.state
    assert account.version == 1
    assert account.nonce == 2
    assert not state.is_warmup_first_tick
    assert not state.is_training_first_tick
    assert state.client_version == "test"
    assert state.metadata.name == ""
    assert state.metadata.description == ""
    assert state.metadata.num_parameters == 1_100_000_000
    assert state.metadata.vocab_size == 32768

    c = state.coordinator
    assert c.run_id == "test"
    assert c.run_state is RunState.Uninitialized
    assert c.run_state_start_unix_timestamp == 0
    assert not c.pending_pause

    llm = c.model.value
    assert llm.max_seq_len == 2048
    assert llm.cold_start_warmup_steps == 0
    assert llm.architecture is LLMArchitecture.HfLlama
    assert llm.checkpoint == Checkpoint.Hub(HubRepo("emozilla/llama2-1.1b-gqa-init", None))
    assert llm.data_type is LLMTrainingDataType.Pretraining
    match llm.data_location:
        case LLMTrainingDataLocation.Http(http):
            assert http.location == HttpTrainingDataLocation.Gcp(
                http.location.value.__class__(
                    "nous-pretraining-public-us", "fineweb-edu-tokenized-llama2"
                )
            )
            assert http.token_size_in_bytes is TokenSize.TwoBytes
            assert http.shuffle == Shuffle.DontShuffle()
        case other:
            pytest.fail(f"unexpected data location {other!r}")
    match llm.lr_schedule:
        case LearningRateSchedule.Cosine(cosine):
            assert cosine.base_lr == 4e-4
            assert cosine.warmup_steps == 250
            assert cosine.warmup_init_lr == 0.0
            assert cosine.total_steps == 25000
            assert cosine.final_lr == 4e-5
        case other:
            pytest.fail(f"unexpected lr schedule {other!r}")
    match llm.optimizer:
        case OptimizerDefinition.Distro(distro):
            assert distro.clip_grad_norm == 1.0
            assert distro.weight_decay is None
            assert distro.compression_decay == to_f32(0.999)
            assert distro.compression_topk == 2
            assert distro.compression_chunk == 64
            assert distro.quantize_1bit is False
        case other:
            pytest.fail(f"unexpected optimizer {other!r}")

    config = c.config
    assert (config.warmup_time, config.cooldown_time) == (15, 30)
    assert (config.max_round_train_time, config.round_witness_time) == (15, 1)
    assert config.global_batch_size_warmup_tokens == 0
    assert config.epoch_time == 60
    assert config.total_steps == 25000
    assert (config.init_min_clients, config.min_clients, config.witness_nodes) == (1, 1, 0)
    assert (config.global_batch_size_start, config.global_batch_size_end) == (2048, 2048)
    assert config.verification_percent == 0
    assert config.waiting_for_members_extra_time == 3

    assert (c.progress.epoch, c.progress.step, c.progress.epoch_start_data_index) == (0, 0, 0)
    epoch = c.epoch_state
    assert epoch.rounds == [Round() for _ in range(4)]
    assert epoch.clients == []
    assert epoch.exited_clients == []
    assert (epoch.rounds_head, epoch.start_step, epoch.last_step, epoch.start_timestamp) == (
        0,
        0,
        0,
        0,
    )
    assert not epoch.first_round
    assert not epoch.cold_start_epoch

    clients = state.clients_state
    assert clients.clients == []
    assert clients.next_active == 0
    assert (
        clients.current_epoch_rates.earning_rate_total_shared,
        clients.current_epoch_rates.slashing_rate_per_client,
    ) == (0, 0)
    assert clients.future_epoch_rates.earning_rate_total_shared == 1_000_000
    assert clients.future_epoch_rates.slashing_rate_per_client == 0


def test_v1_fixture_reencodes_to_the_same_values(v1: bytes) -> None:
    account = coordinator_account_from_bytes(v1)
    data = coordinator_account_to_bytes(account)
    assert coordinator_account_from_bytes(data) == account
    # Only padding and unused union bytes (which hold leftovers on chain) may differ.
    assert sum(a != b for a, b in zip(data, v1)) <= 32


def test_v0_fixture_is_rejected_as_unsupported_layout(upstream_data: UpstreamData) -> None:
    v0 = upstream_data.path("solana", "coordinator-account-v0.so").read_bytes()
    assert len(v0) == 119_072
    with pytest.raises(CoordinatorAccountError, match="unsupported layout version") as info:
        coordinator_account_from_bytes(v0)
    assert info.value.kind is CoordinatorAccountErrorKind.UnsupportedLayoutVersion


def test_v1_fixture_runs_in_the_local_endpoint(v1: bytes) -> None:
    """The dump loaded as an account of the local endpoint decodes the same over RPC."""
    from solders.account import Account
    from solders.pubkey import Pubkey

    ledger = Ledger()
    key = Pubkey.new_unique()
    ledger.set_account(key, Account(10**9, v1, ledger.program_ids.coordinator_key))
    stored = ledger.get_account(key)
    assert stored is not None
    assert bytes(stored.data) == v1
    assert coordinator_account_from_bytes(bytes(stored.data)).nonce == 2
