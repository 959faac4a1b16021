"""The centralized protocol's bytes: upstream's variants as upstream encodes them, extensions after."""

from __future__ import annotations

import pytest

from psyche.centralized.protocol import (
    EXTENSION_CLIENT_VARIANTS,
    ClientToServerMessage,
    ExtensionHello,
    JoinRun,
    RunExtras,
    ServerToClientMessage,
)
from psyche.coordinator import Witness, WitnessMetadata
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.committee_selection import Committee, CommitteeProof, WitnessProof
from psyche.coordinator.model import Checkpoint, HubRepo, LLMTrainingDataLocation
from psyche.coordinator.testing import integration_test_coordinator, simulated_identity
from psyche.core.serde import PostcardError, encode_varint, from_bytes, to_bytes
from psyche.transport import encode_else


def frame(message: ClientToServerMessage | ServerToClientMessage, tp: type) -> bytes:
    payload = encode_else(to_bytes(message, tp))
    return len(payload).to_bytes(4, "big") + payload


def test_join_frame_matches_the_spec_example() -> None:
    message = ClientToServerMessage.Join(JoinRun("test"))
    assert frame(message, ClientToServerMessage).hex() == "00000007" + "01" + "00" + "0474657374"


def test_checkpoint_frame_matches_the_spec_example() -> None:
    message = ClientToServerMessage.Checkpoint(Checkpoint.Hub(HubRepo("a/b")))
    assert frame(message, ClientToServerMessage).hex() == "00000008" + "01" + "03" + "0203612f6200"


def test_coordinator_broadcast_is_tag_zero_then_the_coordinator() -> None:
    coordinator = integration_test_coordinator(2, 4, 1, run_id="test")
    message = ServerToClientMessage.Coordinator(coordinator)
    encoded = frame(message, ServerToClientMessage)
    body = coordinator.to_bytes()
    assert encoded == (len(body) + 2).to_bytes(4, "big") + b"\x01\x00" + body


def test_witness_and_health_check_indices() -> None:
    witness = Witness()
    warmup = ClientToServerMessage.Witness(OpportunisticData.WarmupStep(witness))
    step = ClientToServerMessage.Witness(
        OpportunisticData.WitnessStep((witness, WitnessMetadata()))
    )
    assert to_bytes(warmup, ClientToServerMessage)[:2] == b"\x01\x01"
    assert to_bytes(step, ClientToServerMessage)[:2] == b"\x01\x00"
    # A default witness is 133 bytes (spec 3.1)
    assert len(to_bytes(warmup, ClientToServerMessage)) == 2 + 133
    check = ClientToServerMessage.HealthCheck(
        [(simulated_identity(1), CommitteeProof(Committee.Trainer, 3, 2))]
    )
    encoded = to_bytes(check, ClientToServerMessage)
    assert encoded[:2] == b"\x02\x01"
    assert encoded[2:66] == simulated_identity(1).signer * 2
    assert encoded[66:] == bytes([2, 3, 2])  # Trainer = 2, position, index


@pytest.mark.parametrize(
    "message",
    [
        ClientToServerMessage.Join(JoinRun("run-ü")),
        ClientToServerMessage.Witness(OpportunisticData.WarmupStep(Witness())),
        ClientToServerMessage.HealthCheck([]),
        ClientToServerMessage.Checkpoint(Checkpoint.P2P(HubRepo("x", "rev"))),
        ClientToServerMessage.ExtensionHello(ExtensionHello()),
        ClientToServerMessage.AnnounceEndpoint(b"\x00record"),
    ],
)
def test_client_messages_round_trip(message: ClientToServerMessage) -> None:
    assert from_bytes(to_bytes(message, ClientToServerMessage), ClientToServerMessage) == message


def test_extensions_are_appended_variants() -> None:
    assert [v.variant_name for v in ClientToServerMessage.variants] == [
        "Join",
        "Witness",
        "HealthCheck",
        "Checkpoint",
        "ExtensionHello",
        "AnnounceEndpoint",
        "Verification",
    ]
    assert [v.variant_name for v in ServerToClientMessage.variants] == [
        "Coordinator",
        "PeerEndpoints",
        "RunExtras",
        "Relays",
        "VerificationHeard",
    ]
    assert EXTENSION_CLIENT_VARIANTS == 4
    hello = to_bytes(ClientToServerMessage.ExtensionHello(ExtensionHello()), ClientToServerMessage)
    assert hello == b"\x04\x04"  # version 4: RunExtras.exact_verification_threads appended
    assert to_bytes(ClientToServerMessage.AnnounceEndpoint(b"ab"), ClientToServerMessage) == (
        b"\x05\x02ab"
    )
    extras = RunExtras(
        backup_data_locations=[LLMTrainingDataLocation.Local("/data")], run_identity="ab"
    )
    encoded = to_bytes(ServerToClientMessage.RunExtras(extras), ServerToClientMessage)
    # version 4; verifiers_train and exact_verification_threads (a varint): appended
    assert encoded == b"\x02\x04\x01\x02\x05/data\x02ab\x00\x00"
    assert from_bytes(encoded, ServerToClientMessage) == ServerToClientMessage.RunExtras(extras)
    peers = ServerToClientMessage.PeerEndpoints([b"a", b"bc"])
    assert to_bytes(peers, ServerToClientMessage) == b"\x01\x02\x01a\x02bc"


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # nothing
        b"\x06",  # unknown variant
        b"\x00\x05ab",  # string shorter than its length
        b"\x00\x02\xff\xfe",  # not UTF-8
        b"\x03\x09",  # unknown checkpoint variant
        b"\x00\x01a\x00",  # trailing byte
    ],
)
def test_malformed_client_messages_are_rejected(payload: bytes) -> None:
    with pytest.raises(PostcardError):
        from_bytes(payload, ClientToServerMessage)


def test_each_message_kind_is_bounded_by_what_it_can_legitimately_hold() -> None:
    """Issue 24: the server reads a message's variant and length before decoding it. Each
    kind's limit is what its fullest honest message takes (a health check naming the run's
    256 clients, a witness with full blooms and metadata, ...); one byte more is refused
    unread, and the decoder itself refuses a longer health check before reading it."""
    from psyche.centralized.protocol import (
        CLIENT_FRAME_LIMIT,
        CLIENT_MESSAGE_LIMITS,
        MAX_JOIN_RUN_ID_LEN,
        screen_client_message,
    )
    from psyche.coordinator.config import SOLANA_MAX_NUM_CLIENTS
    from psyche.coordinator.run_state import MAX_TOKENS_TO_SEND, WitnessEvalResult
    from psyche.coordinator.verification import MAX_FINDINGS, Finding, VerificationReport
    from psyche.core.batch_id import BatchId
    from psyche.core.bloom import WitnessBloom
    from psyche.core.numeric import U64_MAX
    from psyche.transport import SERVER_MAX_FRAME_LENGTH, FrameTooLarge, TcpProtocolError

    def encoded(message: ClientToServerMessage) -> bytes:
        return to_bytes(message, ClientToServerMessage)

    identity = simulated_identity(1)
    proof = CommitteeProof(Committee.TieBreaker, U64_MAX, U64_MAX)
    bloom = WitnessBloom([U64_MAX] * 8, [U64_MAX] * 16)
    witness = Witness(WitnessProof(U64_MAX, U64_MAX, True), bloom, bloom)
    metadata = WitnessMetadata(
        step=2**32 - 1,
        evals=[WitnessEvalResult("e" * 32, 1.0)] * 8,
        prompt_results=[-(2**31)] * MAX_TOKENS_TO_SEND,
        prompt_index=255,
    )
    fullest = {
        ClientToServerMessage.Join: ClientToServerMessage.Join(JoinRun("r" * MAX_JOIN_RUN_ID_LEN)),
        ClientToServerMessage.Witness: ClientToServerMessage.Witness(
            OpportunisticData.WitnessStep((witness, metadata))
        ),
        ClientToServerMessage.HealthCheck: ClientToServerMessage.HealthCheck(
            [(identity, proof)] * SOLANA_MAX_NUM_CLIENTS
        ),
        ClientToServerMessage.Checkpoint: ClientToServerMessage.Checkpoint(
            Checkpoint.Hub(HubRepo("h" * 64, "v" * 64))
        ),
        ClientToServerMessage.ExtensionHello: ClientToServerMessage.ExtensionHello(
            ExtensionHello(2**32 - 1)
        ),
        ClientToServerMessage.AnnounceEndpoint: ClientToServerMessage.AnnounceEndpoint(bytes(4096)),
        ClientToServerMessage.Verification: ClientToServerMessage.Verification(
            VerificationReport(
                2**32 - 1,
                [Finding(BatchId(U64_MAX, U64_MAX), False, float("inf"))] * MAX_FINDINGS,
            )
        ),
    }
    for kind, message in fullest.items():
        payload = encoded(message)
        assert len(payload) == CLIENT_MESSAGE_LIMITS[kind.index], kind
        assert screen_client_message(memoryview(payload)) is kind
        with pytest.raises(FrameTooLarge, match=kind.variant_name):
            screen_client_message(memoryview(payload + b"\x00"))
    assert 1 + len(encoded(fullest[ClientToServerMessage.HealthCheck])) == CLIENT_FRAME_LIMIT
    assert CLIENT_FRAME_LIMIT < SERVER_MAX_FRAME_LENGTH // 300  # about 22 KB against 8 MiB
    with pytest.raises(TcpProtocolError, match="variant 9"):
        screen_client_message(memoryview(b"\x09"))
    # one entry more than the run can have clients: refused by its length, before any entry
    too_many = bytearray(b"\x02")
    encode_varint(SOLANA_MAX_NUM_CLIENTS + 1, too_many)
    with pytest.raises(PostcardError, match="FixedVec is full"):
        from_bytes(bytes(too_many), ClientToServerMessage)
