"""Messages of the centralized protocol (upstream `architectures/centralized/shared/src/protocol.rs`).

They travel as postcard inside the authenticated, length-delimited TCP envelope of
`psyche.transport` (`Else(T)`). Upstream's variants keep their indices and bytes, so a Rust
client can talk to this server and this client to a Rust server.

Port extensions are appended variants (higher indices), which a Rust peer cannot decode:

* client to server `ExtensionHello{version}` (4): "I understand extension messages". The server
  answers with `RunExtras` and from then on also sends `PeerEndpoints`. A server only ever sends
  extension variants to clients that sent an extension variant first, so an upstream client never
  receives one. A Rust server drops the connection on the hello; `CentralizedBackend` then
  reconnects without extensions.
* client to server `AnnounceEndpoint(record)` (5): the client's self-signed network address record
  (`psyche.network.discovery`), relayed by the server to the run's other clients.
* client to server `Verification(report)` (6): a verifier's or tie-breaker's findings for a round
  (`psyche.coordinator.verification.VerificationReport`), only sent in runs with
  `verification_percent > 0` (which a Rust server cannot run: its data selection asserts it is 0).
  Bounded like a health check: at most one finding per client of the run, heard only from a
  member, once per sender and round (`ServerCore.on_verification`).
* server to client `VerificationHeard{sender, report}` (4): a verification report the
  coordinator accepted, relayed to every extension-aware member (at most one per verifier and
  tie-breaker of a round, each bounded as above): a round's tie-breaker learns from them which
  batches were disputed, and when every verifier has reported (`psyche.client.round.verify`).
* server to client `PeerEndpoints(records)` (1): the newest record of every other joined client.
* server to client `RunExtras{version, backup_data_locations, run_identity, verifiers_train}`
  (2): what upstream's coordinator cannot carry (the backup data locations of `data_locations =
  [...]` run configs; which instance of the run this server runs: new when a run starts afresh,
  kept when the server resumes from its saved state; whether its verifiers train too, which the
  client sets on every state it receives).
* server to client `Relays(addrs)` (3): the circuit relays the server hosts for the run's
  members (`psyche.network.relay`, multiaddrs ending in `/p2p/<relay id>`); sent just before
  `RunExtras`, so a client knows them before it opens its network.

What a client may send is bounded by what each message can legitimately hold
(`CLIENT_MESSAGE_LIMITS`, from the types' capacities: the run's most clients for a health
check, the bloom filters' sizes for a witness, ...). The largest is a health check naming all
256 clients, about 22 KB: `CLIENT_FRAME_LIMIT`, the server's frame cap, far below the
transport's 8 MiB default. `screen_client_message` reads a frame's variant and checks its
length against its limit before anything is decoded; `MEMBER_VARIANTS` are the messages only a
member of the run's epoch is heard for, which the server drops unread from anyone else.
"""

from __future__ import annotations

from typing import Annotated

from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.committee_selection import CommitteeProof
from psyche.coordinator.config import SOLANA_MAX_NUM_CLIENTS
from psyche.coordinator.coordinator import Coordinator as _Coordinator
from psyche.coordinator.model import Checkpoint as _Checkpoint
from psyche.coordinator.model import LLMTrainingDataLocation
from psyche.coordinator.verification import VerificationReport
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import (
    U16,
    U32,
    DataEnum,
    FixedVec,
    PostcardError,
    decode_varint,
    max_encoded_size,
    struct,
    variant,
    varint_len,
)
from psyche.transport import FrameTooLarge, PostcardCodec, TcpProtocolError

# The version of the extensions' wire shapes, sent in `ExtensionHello`: 2 appended
# `RunExtras.verifiers_train`; 3 changed what a drawn verifier signs (`draw_message`: the domain
# and a SHA-256 of the draw, so a Solana report fits a transaction), which peers of version 2
# would refuse; 4 appended `RunExtras.exact_verification_threads` (followers' reports ride on the
# verification report: `psyche.coordinator.following`). A server refuses a hello of another version in one line (its
# `RunExtras` would not decode there); a client that cannot decode a server's says so.
EXTENSIONS_VERSION = 4
# A self-signed endpoint record is a few hundred bytes; anything far larger is refused.
MAX_ENDPOINT_RECORD_LEN = 4096
# A run id is at most 32 bytes (SOLANA_RUN_ID_MAX_LEN); a Join naming a longer one is still
# read, up to this, so that its sender hears "unknown run" rather than a closed connection.
MAX_JOIN_RUN_ID_LEN = 1024


@struct(frozen=True)
class JoinRun:
    """The body of upstream's struct variant `Join { run_id }`."""

    run_id: str


@struct(frozen=True)
class ExtensionHello:
    version: U32 = EXTENSIONS_VERSION


@struct(kw_only=True)
class RunExtras:
    version: U32 = EXTENSIONS_VERSION
    backup_data_locations: list[LLMTrainingDataLocation]
    run_identity: str = ""
    verifiers_train: bool = False
    """The run's `CoordinatorConfig.verifiers_train` (not in upstream's postcard state)."""
    exact_verification_threads: U16 = 0
    """The run's `CoordinatorConfig.exact_verification_threads` (not in upstream's state)."""


@struct(frozen=True)
class VerificationHeard:
    """A verification report the coordinator accepted, and who sent it."""

    sender: NodeIdentity
    report: VerificationReport


class ClientToServerMessage(DataEnum):
    Join = variant(JoinRun)
    Witness = variant(OpportunisticData)
    # A FixedVec is a sequence on the wire (upstream's Vec): the capacity only makes the
    # decoder refuse a longer list before reading it.
    HealthCheck = variant(
        Annotated[list[tuple[NodeIdentity, CommitteeProof]], FixedVec(SOLANA_MAX_NUM_CLIENTS)]
    )
    Checkpoint = variant(_Checkpoint)
    # Port extensions (see the module docstring).
    ExtensionHello = variant(ExtensionHello)
    AnnounceEndpoint = variant(bytes)
    Verification = variant(VerificationReport)


class ServerToClientMessage(DataEnum):
    Coordinator = variant(_Coordinator)
    # Port extensions (see the module docstring).
    PeerEndpoints = variant(list[bytes])
    RunExtras = variant(RunExtras)
    Relays = variant(list[str])
    VerificationHeard = variant(VerificationHeard)


# Variants from this index on are extensions that an upstream peer cannot decode.
EXTENSION_CLIENT_VARIANTS = 4
EXTENSION_SERVER_VARIANTS = 1

CLIENT_TO_SERVER_CODEC: PostcardCodec[ClientToServerMessage] = PostcardCodec(ClientToServerMessage)
SERVER_TO_CLIENT_CODEC: PostcardCodec[ServerToClientMessage] = PostcardCodec(ServerToClientMessage)


def _client_message_limits() -> dict[int, int]:
    """Per variant index, the most bytes of a client's message (tag and body)."""
    bodies: dict[type[DataEnum], int | None] = {
        kind: max_encoded_size(kind.resolved_payload_type())
        for kind in ClientToServerMessage.variants
    }
    # The two bodies of unbounded types, bounded by what they legitimately carry.
    bodies[ClientToServerMessage.Join] = varint_len(MAX_JOIN_RUN_ID_LEN) + MAX_JOIN_RUN_ID_LEN
    bodies[ClientToServerMessage.AnnounceEndpoint] = (
        varint_len(MAX_ENDPOINT_RECORD_LEN) + MAX_ENDPOINT_RECORD_LEN
    )
    limits = {}
    for kind, body in bodies.items():
        if body is None:  # a new message type must say what bounds it
            raise TypeError(f"{kind.variant_name} has no size bound")
        limits[kind.index] = varint_len(kind.index) + body
    return limits


CLIENT_MESSAGE_LIMITS: dict[int, int] = _client_message_limits()
"""The most bytes each client-to-server message (by variant index) can legitimately take."""
CLIENT_FRAME_LIMIT = 1 + max(CLIENT_MESSAGE_LIMITS.values())
"""The server's frame cap: the largest message in its `Else` envelope (one tag byte)."""
MEMBER_VARIANTS = frozenset(
    v.index
    for v in (
        ClientToServerMessage.Witness,
        ClientToServerMessage.HealthCheck,
        ClientToServerMessage.Checkpoint,
        ClientToServerMessage.Verification,
    )
)
"""Messages only a client of the run's current epoch is heard for."""


def screen_client_message(payload: memoryview) -> type[DataEnum]:
    """The variant of a client's message (its `Else` payload), read without decoding it;
    raises `FrameTooLarge` when the message is longer than its variant can be, and
    `TcpProtocolError` for an unknown variant. Both close the sender's connection."""
    try:
        index, _ = decode_varint(payload, 0, 32)
    except PostcardError as e:
        raise TcpProtocolError(f"bad message variant: {e}") from None
    limit = CLIENT_MESSAGE_LIMITS.get(index)
    if limit is None:
        raise TcpProtocolError(f"invalid client-to-server message variant {index}")
    kind = ClientToServerMessage.variants[index]
    if len(payload) > limit:
        raise FrameTooLarge(
            f"a {kind.variant_name} message of {len(payload)} bytes (at most {limit} "
            "can be legitimate)"
        )
    return kind


__all__ = [
    "CLIENT_FRAME_LIMIT",
    "CLIENT_MESSAGE_LIMITS",
    "CLIENT_TO_SERVER_CODEC",
    "EXTENSIONS_VERSION",
    "EXTENSION_CLIENT_VARIANTS",
    "EXTENSION_SERVER_VARIANTS",
    "MAX_ENDPOINT_RECORD_LEN",
    "MAX_JOIN_RUN_ID_LEN",
    "MEMBER_VARIANTS",
    "SERVER_TO_CLIENT_CODEC",
    "ClientToServerMessage",
    "ExtensionHello",
    "JoinRun",
    "RunExtras",
    "ServerToClientMessage",
    "screen_client_message",
]
