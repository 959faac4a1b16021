"""Postcard encodings of the coordinator and its messages, equality by encoding, copies, and the
saved-state TOML round trip."""

from __future__ import annotations

import random
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.coordinator import (
    Checkpoint,
    ClientState,
    Commitment,
    Committee,
    CommitteeProof,
    Coordinator,
    HealthChecks,
    HubRepo,
    Round,
    RunState,
    Witness,
    WitnessEvalResult,
    WitnessMetadata,
    WitnessProof,
)
from psyche.coordinator.run_config import (
    dumps_toml,
    load_state_toml,
    parse_run_config,
    state_to_toml_obj,
)
from psyche.coordinator.testing import (
    Simulation,
    integration_test_coordinator,
    simulated_identity,
)
from psyche.core import MerkleRoot, NodeIdentity
from psyche.core.numeric import U64_MAX
from psyche.core.serde import PostcardError, from_bytes, to_bytes

from ..upstream_data import UpstreamData
from .examples import TEST_STATE

# spec §3.1, derived from upstream: postcard of config/test/state.toml's Coordinator
TEST_STATE_POSTCARD = (
    "04746573740100800400000100000000022d431cebe2363a3f0000000000000000f168e388b5f8043f14d00f"
    "0005050502003c0a0202010404000300010000000000000000000000000000000000000000000000000000000000"
    "000001000000"
)


def load(text: str) -> Coordinator:
    coordinator = parse_run_config(tomllib.loads(text)).coordinator
    assert isinstance(coordinator, Coordinator)
    return coordinator


def mid_run() -> Simulation:
    """Three rounds into an epoch with 6 clients: random seeds, full blooms, an exited client."""
    coordinator = integration_test_coordinator(5, 12, 3)
    sim = Simulation(coordinator, now=1_000, rng=random.Random(3), record=False)
    for i in range(6):
        sim.join(simulated_identity(i))
    sim.tick()
    sim.send_warmup_witnesses()
    sim.tick()
    for _ in range(3):
        sim.send_round_witnesses()
        sim.tick(3)
    sim.disconnect(simulated_identity(2))
    sim.send_round_witnesses()
    sim.tick(3)
    sim.send_round_witnesses()
    assert coordinator.run_state is RunState.RoundWitness
    assert coordinator.epoch_state.exited_clients
    coordinator.epoch_state.rounds[0].random_seed = U64_MAX  # beyond TOML's i64
    return sim


# ---- the coordinator -----------------------------------------------------------------------


def test_test_state_encodes_to_upstreams_bytes() -> None:
    coordinator = load(TEST_STATE)
    assert coordinator.to_bytes().hex() == TEST_STATE_POSTCARD
    assert from_bytes(bytes.fromhex(TEST_STATE_POSTCARD), Coordinator) == coordinator


def test_upstream_test_state_file(upstream_data: UpstreamData) -> None:
    coordinator = load_state_toml(upstream_data.path("config", "test", "state.toml"))
    assert coordinator.to_bytes().hex() == TEST_STATE_POSTCARD


def test_zeroed_is_all_zero_bytes() -> None:
    encoded = Coordinator.zeroed().to_bytes()
    assert set(encoded) == {0}
    decoded = from_bytes(encoded, Coordinator)
    assert decoded == Coordinator.zeroed()
    assert decoded.progress.step == 0
    assert not decoded.epoch_state.first_round


def test_mid_run_round_trips_through_postcard() -> None:
    coordinator = mid_run().coordinator
    decoded = from_bytes(coordinator.to_bytes(), Coordinator)
    assert decoded == coordinator
    assert decoded.to_bytes() == coordinator.to_bytes()


def test_equality_is_equality_of_encodings() -> None:
    a = mid_run().coordinator
    b = a.copy()
    assert a == b
    assert a is not b
    b.epoch_state.clients[0].state = ClientState.Dropped
    # upstream's Client equality looks at ids only; the coordinators differ all the same
    assert b.epoch_state.clients[0] == a.epoch_state.clients[0]
    assert a != b
    c = a.copy()
    c.epoch_state.rounds[1].witnesses[0].participant_bloom.add(b"x")
    assert a != c
    with pytest.raises(TypeError):
        hash(a)


def test_copy_is_independent() -> None:
    sim = mid_run()
    original = sim.coordinator
    snapshot = original.to_bytes()
    copy = original.copy()
    copy.tick(None, sim.now + 100, 9)
    copy.epoch_state.rounds[0].witnesses[0].broadcast_bloom.add(b"y")
    copy.epoch_state.exited_clients[0].exited_height = 99
    copy.model.value.checkpoint = Checkpoint.Hub(HubRepo("x"))
    copy.config.warmup_time = 1
    copy.progress.step = 999
    assert original.to_bytes() == snapshot


def test_decoding_rejects_hostile_bytes() -> None:
    encoded = mid_run().coordinator.to_bytes()
    with pytest.raises(PostcardError):
        from_bytes(encoded[:-1], Coordinator)
    with pytest.raises(PostcardError):
        from_bytes(encoded + b"\x00", Coordinator)
    # 33 witnesses in a round: more than the FixedVec holds
    too_many = Round(witnesses=[Witness() for _ in range(33)])
    with pytest.raises(PostcardError):
        to_bytes(too_many, Round)
    raw = bytes([33]) + to_bytes(Witness(), Witness) * 33 + bytes(5)
    with pytest.raises(PostcardError, match="capacity"):
        from_bytes(raw, Round)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_corrupted_encodings_fail_cleanly(data: st.DataObject) -> None:
    encoded = bytearray(load(TEST_STATE).to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(encoded) - 1))
        encoded[position] = data.draw(st.integers(0, 255))
    try:
        decoded = from_bytes(bytes(encoded), Coordinator)
    except PostcardError:
        return
    # whatever decodes re-encodes to a valid coordinator
    assert from_bytes(decoded.to_bytes(), Coordinator) == decoded


# ---- messages ------------------------------------------------------------------------------------


def test_default_witness_is_133_bytes() -> None:
    assert len(to_bytes(Witness(), Witness)) == 133


def test_message_encodings() -> None:
    assert to_bytes(WitnessProof(5, 300, True), WitnessProof).hex() == "05ac0201"
    assert to_bytes(CommitteeProof(Committee.Trainer, 1, 2), CommitteeProof).hex() == "020102"
    assert to_bytes(Checkpoint.Hub(HubRepo("a/b")), Checkpoint).hex() == "0203612f6200"
    node = NodeIdentity.from_single_key(bytes([7]) * 32)
    checks: HealthChecks = [(node, CommitteeProof(Committee.Trainer, 3, 1))]
    encoded = to_bytes(checks, HealthChecks)
    assert encoded == b"\x01" + bytes([7]) * 64 + bytes.fromhex("020301")
    assert from_bytes(encoded, HealthChecks) == checks


def test_commitment_is_one_96_byte_string() -> None:
    commitment = Commitment(bytes(range(32)), bytes(range(64)))
    encoded = to_bytes(commitment, Commitment)
    assert encoded == b"\x60" + bytes(range(32)) + bytes(range(64))
    assert from_bytes(encoded, Commitment) == commitment
    with pytest.raises(PostcardError, match="Invalid length for Commitment"):
        from_bytes(b"\x5f" + bytes(95), Commitment)
    with pytest.raises(ValueError, match="Invalid length"):
        Commitment(bytes(31), bytes(64))


def test_witness_and_metadata_round_trip() -> None:
    witness = mid_run().coordinator.epoch_state.rounds[0].witnesses[0]
    assert from_bytes(to_bytes(witness, Witness), Witness) == witness
    metadata = WitnessMetadata(
        step=12,
        tokens_per_sec=1234.5,
        bandwidth_per_sec=3.25,
        loss=2.5,
        evals=[WitnessEvalResult.new_trunc_name("hellaswag" * 5, 0.5)],
        prompt_results=[1, -2, 3],
        prompt_index=4,
        efficency=0.75,
    )
    assert metadata.evals[0].name == ("hellaswag" * 5)[:32]
    assert from_bytes(to_bytes(metadata, WitnessMetadata), WitnessMetadata) == metadata
    too_many = WitnessMetadata(prompt_results=list(range(17)))
    with pytest.raises(PostcardError):
        to_bytes(too_many, WitnessMetadata)


def test_merkle_root_in_witness_is_32_raw_bytes() -> None:
    witness = Witness(broadcast_merkle=MerkleRoot(bytes([9]) * 32))
    assert to_bytes(witness, Witness).endswith(bytes([9]) * 32)


# ---- saved state ----------------------------------------------------------------------------------


def test_mid_run_state_round_trips_through_toml(tmp_path: Path) -> None:
    coordinator = mid_run().coordinator
    path = tmp_path / "saved.toml"
    text = dumps_toml(state_to_toml_obj(coordinator))
    path.write_text(text)
    # u64 values above i64::MAX (a round seed, bloom keys and words) survive, as strings
    assert f'"{U64_MAX}"' in text
    restored = load_state_toml(path)
    assert restored == coordinator
    assert restored.to_bytes() == coordinator.to_bytes()
