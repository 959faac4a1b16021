"""borsh and repr(C) codecs, discriminators and PDAs against hand-checked values from the spec."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from solders.pubkey import Pubkey

from psyche.coordinator import (
    Client,
    ClientState,
    Coordinator,
    CoordinatorProgress,
    Round,
    RunState,
    Witness,
    WitnessEvalResult,
    WitnessMetadata,
)
from psyche.coordinator.committee_selection import Committee, WitnessProof
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.model import (
    LLM,
    Checkpoint,
    GcsRepo,
    HttpLLMTrainingDataLocation,
    HttpTrainingDataLocation,
    HubRepo,
    LLMArchitecture,
    LLMTrainingDataLocation,
    LLMTrainingDataType,
    Model,
    NumberedFiles,
)
from psyche.core.bloom import WitnessBloom
from psyche.core.data_shuffle import Shuffle
from psyche.core.definitions import (
    AdamW,
    CosineLR,
    Distro,
    LearningRateSchedule,
    OptimizerDefinition,
    WarmupStableDecayLR,
)
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.node_identity import NodeIdentity
from psyche.core.token_size import TokenSize
from psyche.solana import pda
from psyche.solana.anchor import account_discriminator, instruction_discriminator
from psyche.solana.borsh import BorshError, from_borsh, to_borsh
from psyche.solana.instructions import INSTRUCTIONS
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.instructions import treasurer as treasurer_ix
from psyche.solana.state import (
    COORDINATOR_ACCOUNT_SPACE,
    REPR_C,
    Authorization,
    CoordinatorAccount,
    CoordinatorAccountError,
    CoordinatorAccountErrorKind,
    CoordinatorInstance,
    CoordinatorInstanceState,
    RunMetadata,
    SolanaClient,
    coordinator_account_from_bytes,
    coordinator_account_nonce,
    coordinator_account_to_bytes,
    decode_anchor_account,
    encode_anchor_account,
)

# ---------------------------------------------------------------------------------------------
# Discriminators (spec §1, computed independently with hashlib there)

ACCOUNT_DISCRIMINATORS = {
    "CoordinatorAccount": "ef21b1372c9b562b",
    "CoordinatorInstance": "9c099910af181ffc",
    "Authorization": "0344a8f3c3a8204b",
    "Run": "c7369b56eb73f6bd",
    "Participant": "208e6c4ff7b33606",
}
INSTRUCTION_DISCRIMINATORS = {
    "init_coordinator": "14399449e8857a19",
    "free_coordinator": "59d8d7e5dff24a20",
    "update": "dbc858b09e3ffd7f",
    "update_client_version": "c1152e3c33020dfb",
    "set_future_epoch_rates": "ef15a057c7c8b681",
    "join_run": "48a07d666a86f64b",
    "set_paused": "5b3c7dc0b0e1a6da",
    "tick": "5c4f2c0865503f0f",
    "witness": "d5f495198edf1527",
    "warmup_witness": "d3e87ae83f16375e",
    "health_check": "735a63a88a129d83",
    "checkpoint": "d5c813ccf08fb8fc",
    "authorization_create": "149dc4b3e7df6d66",
    "authorization_grantor_update": "1d7441a161bd3af9",
    "authorization_grantee_update": "ba6f7fc75990c143",
    "authorization_close": "81d0f820c8855717",
    "run_create": "c638a3f70e3aa7fd",
    "run_update": "33562e740d42149d",
    "participant_create": "32b18e2875b046b5",
    "participant_claim": "a096e8563b6bad26",
    # Beyond upstream (issue 27): Anchor's rule, sha256("global:<name>")[..8].
    "init_verification": "8c3d060b7bbc1e29",
    "verification_report": "024def0e125fc8c7",
    "set_verifiers_train": "614d7e3fa2acf49c",
    "run_set_verifiers_train": "2d1e8b7fcece76ee",
    "set_exact_verification_threads": "0543c11a02261a20",
    "run_set_exact_verification_threads": "d5daef7ebdf8453f",
}


@pytest.mark.parametrize(("name", "expected"), ACCOUNT_DISCRIMINATORS.items())
def test_account_discriminators(name: str, expected: str) -> None:
    assert account_discriminator(name).hex() == expected


def test_instruction_discriminators_cover_every_instruction() -> None:
    specs = {s.name: s for program in INSTRUCTIONS.values() for s in program.values()}
    assert set(specs) == set(INSTRUCTION_DISCRIMINATORS)
    for name, expected in INSTRUCTION_DISCRIMINATORS.items():
        assert instruction_discriminator(name).hex() == expected
        assert specs[name].discriminator.hex() == expected


# ---------------------------------------------------------------------------------------------
# borsh: sizes and hand-built byte vectors (spec §4)


def test_borsh_sizes() -> None:
    config = CoordinatorConfig(*range(1, 15))
    assert len(to_borsh(RunMetadata())) == 360
    assert len(to_borsh(config)) == 64
    assert len(to_borsh(CoordinatorProgress())) == 14
    assert len(to_borsh(WitnessProof())) == 17
    assert len(to_borsh(WitnessEvalResult("x", 1.0))) == 36
    assert len(to_borsh(WitnessMetadata())) == 389
    assert len(to_borsh(WitnessBloom())) == 192
    assert len(to_borsh(NodeIdentity())) == 64
    assert len(to_borsh(MerkleRoot())) == 32


def test_init_coordinator_byte_vector() -> None:
    main, join, account, payer = (Pubkey.from_bytes(bytes([i]) * 32) for i in (1, 2, 3, 4))
    instruction = coordinator_ix.coordinator_init_coordinator(
        payer, "test", "v1.2", account, main, join
    )
    expected = (
        bytes.fromhex("14399449e8857a19")
        + bytes([1]) * 32
        + bytes([2]) * 32
        + (4).to_bytes(4, "little")
        + b"test"
        + (4).to_bytes(4, "little")
        + b"v1.2"
    )
    assert bytes(instruction.data) == expected
    assert len(expected) == 88


def test_checkpoint_hub_repo_borsh_order() -> None:
    # borsh writes repo_id then the Option (declaration order), unlike the memory layout.
    data = to_borsh(Checkpoint.Hub(HubRepo("org/model", "main")), Checkpoint)
    expected = bytes([2]) + b"org/model".ljust(64, b"\0") + bytes([1]) + b"main".ljust(64, b"\0")
    assert data == expected
    assert to_borsh(Checkpoint.Ephemeral(), Checkpoint) == bytes([0])
    assert to_borsh(Checkpoint.P2PGcs(GcsRepo("bucket")), Checkpoint) == (
        bytes([5]) + b"bucket".ljust(64, b"\0") + bytes([0])
    )


def test_bloom_borsh_is_keys_then_words() -> None:
    bloom = WitnessBloom(list(range(1, 9)), list(range(100, 116)))
    assert to_borsh(bloom, WitnessBloom) == struct.pack("<24Q", *range(1, 9), *range(100, 116))


def test_fixed_vec_and_options_in_witness_metadata() -> None:
    metadata = WitnessMetadata(
        step=7,
        loss=2.5,
        evals=[WitnessEvalResult("hellaswag", 0.25)],
        prompt_results=[-1, 2],
        prompt_index=3,
        efficency=0.5,
    )
    data = to_borsh(metadata)
    expected = bytearray()
    expected += struct.pack("<Ifff", 7, 0.0, 0.0, 2.5)
    expected += b"hellaswag".ljust(32, b"\0") + struct.pack("<f", 0.25)
    expected += bytes(36 * 7) + struct.pack("<Q", 1)
    expected += struct.pack("<ii", -1, 2) + bytes(4 * 14) + struct.pack("<Q", 2)
    expected += bytes([3]) + struct.pack("<f", 0.5)
    assert data == bytes(expected)
    assert from_borsh(data, WitnessMetadata) == metadata


def test_health_check_and_set_paused_vectors() -> None:
    identity = NodeIdentity(bytes([9]) * 32, bytes([8]) * 32)
    args = coordinator_ix.HealthCheckArgs(identity, Committee.Trainer, 5, 6)
    spec = INSTRUCTIONS["coordinator"]["health_check"]
    assert spec.encode(args) == (
        bytes.fromhex("735a63a88a129d83")
        + bytes([9]) * 32
        + bytes([8]) * 32
        + bytes([2])
        + struct.pack("<QQ", 5, 6)
    )
    assert INSTRUCTIONS["coordinator"]["set_paused"].encode(coordinator_ix.SetPausedArgs(True)) == (
        bytes.fromhex("5b3c7dc0b0e1a6da01")
    )
    assert INSTRUCTIONS["coordinator"]["tick"].encode(coordinator_ix.TickArgs()) == bytes.fromhex(
        "5c4f2c0865503f0f"
    )


def test_optimizer_option_f32_borsh() -> None:
    distro = OptimizerDefinition.Distro(
        Distro(
            clip_grad_norm=1.0,
            weight_decay=None,
            compression_decay=0.999,
            compression_topk=2,
            compression_chunk=64,
            quantize_1bit=True,
        )
    )
    assert to_borsh(distro, OptimizerDefinition) == (
        bytes([2, 1])
        + struct.pack("<f", 1.0)
        + bytes([0])
        + struct.pack("<fHH", 0.999, 2, 64)
        + bytes([1])
    )


def test_borsh_rejects_bad_input() -> None:
    with pytest.raises(BorshError):
        from_borsh(bytes([9]), Checkpoint)  # no variant 9
    with pytest.raises(BorshError):
        from_borsh(bytes([2]) + bytes(10), Checkpoint)  # truncated
    with pytest.raises(BorshError):
        from_borsh(bytes([1]) * 14 + b"\0", CoordinatorProgress)  # trailing byte
    bad_bool = to_borsh(coordinator_ix.SetPausedArgs(True))[:-1] + bytes([2])
    with pytest.raises(BorshError):
        from_borsh(bad_bool, coordinator_ix.SetPausedArgs)
    with pytest.raises(BorshError):
        to_borsh(CoordinatorProgress(epoch=70_000))
    # A FixedVec whose length field exceeds its capacity.
    data = bytearray(to_borsh(WitnessMetadata()))
    struct.pack_into("<Q", data, 16 + 288, 9)
    with pytest.raises(BorshError):
        from_borsh(bytes(data), WitnessMetadata)


# ---------------------------------------------------------------------------------------------
# Values for round trips

_u64 = st.integers(0, 2**64 - 1)
_u32 = st.integers(0, 2**32 - 1)
_u16 = st.integers(0, 2**16 - 1)
_f32 = st.floats(width=32, allow_nan=False)
_name = st.text(st.characters(min_codepoint=33, max_codepoint=0x7E), max_size=20)


def _hub(name: str, rev: str | None) -> HubRepo:
    return HubRepo(name, rev)


_checkpoint = st.one_of(
    st.just(Checkpoint.Ephemeral()),
    st.builds(lambda n, r: Checkpoint.Dummy(_hub(n, r)), _name, st.none() | _name),
    st.builds(lambda n, r: Checkpoint.Hub(_hub(n, r)), _name, st.none() | _name),
    st.builds(lambda n, r: Checkpoint.P2P(_hub(n, r)), _name, st.none() | _name),
    st.builds(lambda n, r: Checkpoint.Gcs(GcsRepo(n, r)), _name, st.none() | _name),
    st.builds(lambda n, r: Checkpoint.P2PGcs(GcsRepo(n, r)), _name, st.none() | _name),
)
_http = st.one_of(
    st.builds(lambda u: HttpTrainingDataLocation.SingleUrl(u), _name),
    st.builds(
        lambda u, a, b, c: HttpTrainingDataLocation.NumberedFiles(NumberedFiles(u, a, b, c)),
        _name,
        _u32,
        st.integers(0, 255),
        _u32,
    ),
)
_location = st.one_of(
    st.just(LLMTrainingDataLocation.Dummy()),
    st.builds(lambda s: LLMTrainingDataLocation.Server(s), _name),
    st.builds(lambda s: LLMTrainingDataLocation.WeightedHttp(s), _name),
    st.builds(
        lambda h, t, seed: LLMTrainingDataLocation.Http(
            HttpLLMTrainingDataLocation(
                h, t, Shuffle.DontShuffle() if seed is None else Shuffle.Seeded(seed)
            )
        ),
        _http,
        st.sampled_from(list(TokenSize)),
        st.none() | st.binary(min_size=32, max_size=32),
    ),
)
_lr = st.one_of(
    st.builds(
        lambda a, b, c, d, e: LearningRateSchedule.Cosine(CosineLR(a, b, c, d, e)),
        st.floats(allow_nan=False),
        st.floats(allow_nan=False),
        st.floats(allow_nan=False),
        _u32,
        _u32,
    ),
    st.builds(
        lambda *v: LearningRateSchedule.WarmupStableDecay(WarmupStableDecayLR(*v)),
        *[st.floats(allow_nan=False)] * 4,
        *[_u32] * 4,
    ),
)
_optimizer = st.one_of(
    st.just(OptimizerDefinition.Dummy()),
    st.builds(
        lambda a, b, c, d, e: OptimizerDefinition.AdamW(AdamW([a, b], c, d, e)),
        _f32,
        _f32,
        _f32,
        _f32,
        st.none() | _f32,
    ),
    st.builds(
        lambda a, b, c, d, e, f: OptimizerDefinition.Distro(
            Distro(
                clip_grad_norm=a,
                weight_decay=b,
                compression_decay=c,
                compression_topk=d,
                compression_chunk=e,
                quantize_1bit=f,
            )
        ),
        st.none() | _f32,
        st.none() | _f32,
        _f32,
        _u16,
        _u16,
        st.booleans(),
    ),
)
_model = st.builds(
    lambda seq, cold, arch, ckpt, kind, loc, lr, opt: Model.LLM(
        LLM(
            max_seq_len=seq,
            cold_start_warmup_steps=cold,
            architecture=arch,
            checkpoint=ckpt,
            data_type=kind,
            data_location=loc,
            lr_schedule=lr,
            optimizer=opt,
        )
    ),
    _u32,
    _u32,
    st.sampled_from(list(LLMArchitecture)),
    _checkpoint,
    st.sampled_from(list(LLMTrainingDataType)),
    _location,
    _lr,
    _optimizer,
)


@settings(max_examples=60, deadline=None)
@given(_model)
def test_model_borsh_and_repr_c_round_trip(model: Model) -> None:
    assert from_borsh(to_borsh(model, Model), Model) == model
    assert REPR_C.decode(REPR_C.encode(model, Model), Model) == model
    assert REPR_C.layout(Model).size == 552


@settings(max_examples=40, deadline=None)
@given(
    st.builds(
        treasurer_ix.RunUpdateParams,
        metadata=st.none() | st.builds(RunMetadata, _name, _name, _u64, _u64),
        model=st.none() | _model,
        progress=st.none() | st.builds(CoordinatorProgress, _u16, _u32, _u64),
        epoch_earning_rate_total_shared=st.none() | _u64,
        epoch_slashing_rate_per_client=st.none() | _u64,
        paused=st.none() | st.booleans(),
        client_version=st.none() | _name,
    )
)
def test_run_update_round_trip(params: treasurer_ix.RunUpdateParams) -> None:
    spec = INSTRUCTIONS["treasurer"]["run_update"]
    args = treasurer_ix.RunUpdateArgs(params)
    assert spec.decode(spec.encode(args)) == args


# ---------------------------------------------------------------------------------------------
# repr(C) layout (spec §3.2)

LAYOUT_TABLE = {
    # type: (size, align, {field: offset})
    NodeIdentity: (64, 1, {"signer": 0, "p2p_identity": 32}),
    WitnessProof: (24, 8, {"position": 0, "index": 8, "witness": 16}),
    Witness: (
        440,
        8,
        {"proof": 0, "participant_bloom": 24, "broadcast_bloom": 216, "broadcast_merkle": 408},
    ),
    Round: (
        14112,
        8,
        {
            "witnesses": 0,
            "data_index": 14088,
            "random_seed": 14096,
            "height": 14104,
            "clients_len": 14108,
            "tie_breaker_tasks": 14110,
        },
    ),
    Client: (72, 4, {"id": 0, "state": 64, "exited_height": 68}),
    HubRepo: (129, 1, {"revision": 0, "repo_id": 65}),
    GcsRepo: (129, 1, {"prefix": 0, "bucket": 65}),
    Checkpoint: (136, 4, {}),
    HttpTrainingDataLocation: (260, 4, {}),
    HttpLLMTrainingDataLocation: (
        300,
        4,
        {"location": 0, "token_size_in_bytes": 260, "shuffle": 264},
    ),
    LLMTrainingDataLocation: (304, 4, {}),
    LearningRateSchedule: (56, 8, {}),
    OptimizerDefinition: (32, 4, {}),
    LLM: (
        544,
        8,
        {
            "max_seq_len": 0,
            "cold_start_warmup_steps": 4,
            "architecture": 8,
            "checkpoint": 12,
            "data_type": 148,
            "data_location": 152,
            "lr_schedule": 456,
            "optimizer": 512,
        },
    ),
    Model: (552, 8, {}),
    CoordinatorConfig: (
        64,
        8,
        {
            "warmup_time": 0,
            "epoch_time": 40,
            "total_steps": 48,
            "init_min_clients": 52,
            "min_clients": 54,
            "witness_nodes": 56,
            "global_batch_size_start": 58,
            "global_batch_size_end": 60,
            "verification_percent": 62,
            "waiting_for_members_extra_time": 63,
        },
    ),
    CoordinatorProgress: (16, 8, {"epoch": 0, "step": 4, "epoch_start_data_index": 8}),
    Coordinator: (
        94048,
        8,
        {
            "run_id": 0,
            "run_state": 32,
            "model": 40,
            "config": 592,
            "progress": 656,
            "epoch_state": 672,
            "run_state_start_unix_timestamp": 94032,
            "pending_pause": 94040,
        },
    ),
    RunMetadata: (360, 8, {"name": 0, "description": 64, "num_parameters": 344, "vocab_size": 352}),
    SolanaClient: (96, 8, {"id": 0, "unused": 64, "earned": 72, "slashed": 80, "active": 88}),
    CoordinatorInstanceState: (
        119136,
        8,
        {
            "metadata": 0,
            "coordinator": 360,
            "clients_state": 94408,
            "is_warmup_first_tick": 119032,
            "is_training_first_tick": 119033,
            "client_version": 119034,
        },
    ),
    CoordinatorAccount: (119152, 8, {"version": 0, "state": 8, "nonce": 119144}),
}


@pytest.mark.parametrize("tp", LAYOUT_TABLE, ids=lambda t: t.__name__)
def test_layout_sizes_and_offsets(tp: type) -> None:
    size, align, offsets = LAYOUT_TABLE[tp]
    layout = REPR_C.layout(tp)
    assert (layout.size, layout.align) == (size, align)
    for name, offset in offsets.items():
        assert layout.offset_of(name) == offset, name


def test_nested_offsets_and_account_size() -> None:
    layout = REPR_C.layout(CoordinatorAccount)
    assert COORDINATOR_ACCOUNT_SPACE == 119160
    base = 8  # the discriminator
    assert base + layout.offset_of("state.coordinator.epoch_state.rounds_head") == 1048 + 93328
    assert base + layout.offset_of("state.coordinator.epoch_state.exited_clients") == 1048 + 74888
    assert base + layout.offset_of("state.clients_state.next_active") == 94424 + 24584
    assert base + layout.offset_of("state.clients_state.future_epoch_rates") == 94424 + 24608
    assert base + layout.offset_of("state.coordinator.model") == 416


def _populated_account(rng: random.Random) -> CoordinatorAccount:
    def key() -> bytes:
        return rng.randbytes(32)

    def bloom() -> WitnessBloom:
        return WitnessBloom(
            [rng.getrandbits(64) for _ in range(8)], [rng.getrandbits(64) for _ in range(16)]
        )

    coordinator = Coordinator.zeroed()
    coordinator.run_id = "populated"
    coordinator.run_state = RunState.RoundWitness
    coordinator.config = CoordinatorConfig(15, 30, 15, 1, 0, 60, 25000, 1, 1, 0, 2048, 2048, 0, 3)
    coordinator.model = Model.LLM(
        dataclasses.replace(LLM.dummy(), checkpoint=Checkpoint.P2P(HubRepo("org/m", "abc")))
    )
    coordinator.progress = CoordinatorProgress(3, 1234, 567890)
    identities = [NodeIdentity(key(), key()) for _ in range(200)]
    states = list(ClientState)
    coordinator.epoch_state.clients = [
        Client(i, rng.choice(states), rng.getrandbits(32)) for i in identities[:150]
    ]
    coordinator.epoch_state.exited_clients = [
        Client(i, ClientState.Dropped, 3) for i in identities[150:]
    ]
    for r, round_ in enumerate(coordinator.epoch_state.rounds):
        round_.height = r + 10
        round_.data_index = rng.getrandbits(64)
        round_.random_seed = rng.getrandbits(64)
        round_.clients_len = 150
        round_.witnesses = [
            Witness(WitnessProof(rng.getrandbits(64), i, True), bloom(), bloom(), MerkleRoot(key()))
            for i in range(32 if r == 2 else r)
        ]
    coordinator.epoch_state.rounds_head = 2
    coordinator.run_state_start_unix_timestamp = 1_750_000_000
    coordinator.pending_pause = True
    state = CoordinatorInstanceState(
        metadata=RunMetadata("name", "description", 10**9, 32768),
        coordinator=coordinator,
        client_version="v0.1.2",
        is_warmup_first_tick=True,
    )
    state.clients_state.clients = [
        SolanaClient(i, earned=rng.getrandbits(32), slashed=rng.getrandbits(16), active=7)
        for i in identities[:256]
    ]
    state.clients_state.next_active = 7
    return CoordinatorAccount(version=1, state=state, nonce=424242)


def test_coordinator_account_round_trip_is_byte_exact() -> None:
    account = _populated_account(random.Random(5))
    data = coordinator_account_to_bytes(account)
    assert len(data) == COORDINATOR_ACCOUNT_SPACE
    decoded = coordinator_account_from_bytes(data)
    assert decoded == account
    assert coordinator_account_to_bytes(decoded) == data
    assert coordinator_account_nonce(data) == 424242
    # spot-check raw bytes at the spec's absolute offsets
    assert data[408] == RunState.RoundWitness.value
    assert struct.unpack_from("<Q", data, 119152)[0] == 424242
    assert data[119050:119056] == b"v0.1.2"


def test_coordinator_account_errors() -> None:
    data = bytearray(coordinator_account_to_bytes(_populated_account(random.Random(1))))
    cases = [
        (bytes(data[:-1]), CoordinatorAccountErrorKind.IncorrectSize),
        (b"\0" * 8 + bytes(data[8:]), CoordinatorAccountErrorKind.InvalidDiscriminator),
        (
            bytes(data[:8]) + (2).to_bytes(8, "little") + bytes(data[16:]),
            CoordinatorAccountErrorKind.InvalidVersion,
        ),
        (bytes(data[:8]) + bytes(119072 - 8), CoordinatorAccountErrorKind.UnsupportedLayoutVersion),
    ]
    bad_state = bytearray(data)
    bad_state[408] = 99  # run_state out of range
    cases.append((bytes(bad_state), CoordinatorAccountErrorKind.InvalidContent))
    for blob, kind in cases:
        with pytest.raises(CoordinatorAccountError) as info:
            coordinator_account_from_bytes(blob)
        assert info.value.kind is kind


def test_anchor_accounts_round_trip() -> None:
    instance = CoordinatorInstance(254, bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32, "run")
    data = encode_anchor_account(instance, space=CoordinatorInstance.SPACE)
    assert len(data) == 173
    assert data[:8] == account_discriminator("CoordinatorInstance")
    assert decode_anchor_account(data, CoordinatorInstance) == instance
    authorization = Authorization(
        1, bytes(32), bytes([5]) * 32, b"scope", True, [bytes([6]) * 32], -5
    )
    data = encode_anchor_account(authorization)
    assert len(data) == Authorization.space_with_discriminator(5, 1)
    assert decode_anchor_account(data, Authorization) == authorization
    with pytest.raises(ValueError, match="discriminator"):
        decode_anchor_account(data, CoordinatorInstance)


def test_authorization_is_valid_for() -> None:
    grantor, grantee, delegate, other = (bytes([i]) * 32 for i in (1, 2, 3, 4))
    scope = b"CoordinatorJoinRun"
    auth = Authorization(1, grantor, grantee, scope, True, [delegate], 0)
    assert auth.is_valid_for(grantor, grantee, scope)
    assert auth.is_valid_for(grantor, delegate, scope)
    assert not auth.is_valid_for(grantor, other, scope)
    assert not auth.is_valid_for(other, grantee, scope)
    assert not auth.is_valid_for(grantor, grantee, b"other")
    assert not dataclasses.replace(auth, active=False).is_valid_for(grantor, grantee, scope)
    everyone = dataclasses.replace(auth, grantee=bytes(32), delegates=[])
    assert everyone.is_valid_for(grantor, other, scope)


# ---------------------------------------------------------------------------------------------
# PDAs (spec §2.1 and §5.2, computed with solders there)


def test_pdas_and_treasurer_index() -> None:
    assert str(pda.find_coordinator_instance("test")) == (
        "9L4yCH7TsMn9JfoXYEupuQwtcNPTTtHcyNL6uqDfjwGB"
    )
    assert str(pda.find_coordinator_instance("consilience-40b-1")) == (
        "7pRsEWgkuQE3YzcH7yhDwtWquU8nzYVyCiwrdh6BgcNk"
    )
    assert pda.find_coordinator_instance_with_bump("test")[1] == 255
    index = pda.compute_deterministic_treasurer_index("test")
    assert index == 7313085519096743583
    assert index == int.from_bytes(hashlib.sha256(b"test").digest()[:8], "little")
    assert str(pda.find_run(index)) == "tG3nRngwkJC3JAL9Aq9AMhFtTzr56hr9ZmaSRpD8dT8"
    assert pda.compute_deterministic_treasurer_index("test", 41) == 41
    with pytest.raises(ValueError, match="32 bytes"):
        pda.find_coordinator_instance("x" * 33)


def test_account_metas_follow_upstream_flags() -> None:
    k = Pubkey.new_unique()
    tick = coordinator_ix.coordinator_tick(k, k, k)
    assert [(m.is_signer, m.is_writable) for m in tick.accounts] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    init = coordinator_ix.coordinator_init_coordinator(k, "r", "v", k, k, k)
    assert [(m.is_signer, m.is_writable) for m in init.accounts] == [
        (True, True),
        (False, True),
        (False, True),
        (False, False),
    ]
    claim = treasurer_ix.treasurer_participant_claim(3, k, k, k, 0)
    assert [(m.is_signer, m.is_writable) for m in claim.accounts] == [
        (True, False),
        (False, True),
        (False, True),
        (False, True),
        (False, False),
        (False, True),
        (False, False),
    ]
    identity = NodeIdentity(bytes(Pubkey.new_unique()), bytes(32))
    join = coordinator_ix.coordinator_join_run(k, k, k, identity)
    assert join.accounts[0].pubkey == Pubkey.from_bytes(identity.signer)
