"""Messages of the centralized protocol (upstream `architectures/centralized/shared/src/protocol.rs`).

They travel as postcard inside the authenticated, length-delimited TCP envelope of
`psyche.core.tcp` (`Else(T)`). Upstream's variants keep their indices and bytes, so a Rust
client can talk to this server and this client to a Rust server.

Port extensions are appended variants (higher indices), which a Rust peer cannot decode:

* client to server `ExtensionHello{version}` (4): "I understand extension messages". The server
  answers with `RunExtras` and from then on also sends `PeerEndpoints`. A server only ever sends
  extension variants to clients that sent an extension variant first, so an upstream client never
  receives one. A Rust server drops the connection on the hello; `CentralizedBackend` then
  reconnects without extensions.
* client to server `AnnounceEndpoint(record)` (5): the client's self-signed network address record
  (`psyche.network.discovery`), relayed by the server to the run's other clients.
* server to client `PeerEndpoints(records)` (1): the newest record of every other joined client.
* server to client `RunExtras{version, backup_data_locations, run_identity}` (2): what
  upstream's coordinator cannot carry (the backup data locations of `data_locations = [...]`
  run configs; which instance of the run this server runs: new when a run starts afresh, kept
  when the server resumes from its saved state).
* server to client `Relays(addrs)` (3): the circuit relays the server hosts for the run's
  members (`psyche.network.relay`, multiaddrs ending in `/p2p/<relay id>`); sent just before
  `RunExtras`, so a client knows them before it opens its network.
"""

from __future__ import annotations

from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.committee_selection import CommitteeProof
from psyche.coordinator.coordinator import Coordinator as _Coordinator
from psyche.coordinator.model import Checkpoint as _Checkpoint
from psyche.coordinator.model import LLMTrainingDataLocation
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import U32, DataEnum, struct, variant
from psyche.core.tcp import PostcardCodec

EXTENSIONS_VERSION = 1
# A self-signed endpoint record is a few hundred bytes; anything far larger is refused.
MAX_ENDPOINT_RECORD_LEN = 4096


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


class ClientToServerMessage(DataEnum):
    Join = variant(JoinRun)
    Witness = variant(OpportunisticData)
    HealthCheck = variant(list[tuple[NodeIdentity, CommitteeProof]])
    Checkpoint = variant(_Checkpoint)
    # Port extensions (see the module docstring).
    ExtensionHello = variant(ExtensionHello)
    AnnounceEndpoint = variant(bytes)


class ServerToClientMessage(DataEnum):
    Coordinator = variant(_Coordinator)
    # Port extensions (see the module docstring).
    PeerEndpoints = variant(list[bytes])
    RunExtras = variant(RunExtras)
    Relays = variant(list[str])


# Variants from this index on are extensions that an upstream peer cannot decode.
EXTENSION_CLIENT_VARIANTS = 4
EXTENSION_SERVER_VARIANTS = 1

CLIENT_TO_SERVER_CODEC: PostcardCodec[ClientToServerMessage] = PostcardCodec(ClientToServerMessage)
SERVER_TO_CLIENT_CODEC: PostcardCodec[ServerToClientMessage] = PostcardCodec(ServerToClientMessage)

__all__ = [
    "CLIENT_TO_SERVER_CODEC",
    "EXTENSIONS_VERSION",
    "EXTENSION_CLIENT_VARIANTS",
    "EXTENSION_SERVER_VARIANTS",
    "MAX_ENDPOINT_RECORD_LEN",
    "SERVER_TO_CLIENT_CODEC",
    "ClientToServerMessage",
    "ExtensionHello",
    "JoinRun",
    "RunExtras",
    "ServerToClientMessage",
]
