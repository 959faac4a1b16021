"""Peer-to-peer networking for Psyche: signed gossip, content-addressed blobs and model sharing.

`NetworkConnection` is the facade (upstream `NetworkConnection<B, D>`): gossip, DisTrO result
downloads that retry themselves, and P2P model sharing (serving from `shared_model`, fetching
with `model_download`) all go through it. This module is the package's public face: other
packages import from `psyche.network`, never from its modules (an import-linter contract in the
root pyproject.toml; tests may reach in).

    from psyche.network import BlobTicket, NetworkConfig, NetworkConnection

Names load lazily (PEP 562): `import psyche.network` costs nothing, and libp2p is imported
the first time a name whose module needs it (`NetworkConnection`, `ModelDownload`, the relay)
is used, so a client that only reads tickets never loads it. The package imports only
`psyche.core` and `psyche.transport`, never torch: what gossip and blobs carry (the client's
`Broadcast`, DisTrO results and model parameters, the last through a `ParameterCodec`)
reaches it as parameters of `NetworkConnection.open`.
"""

# ruff: noqa: F401  (the imports below are the face's names for the type checker; `__all__` is
# built from `_MODULES`, which ruff cannot read)

from __future__ import annotations

from typing import TYPE_CHECKING

from psyche.core.lazy import lazy_exports

if TYPE_CHECKING:  # the names of _MODULES, each from its module (tests/test_faces.py)
    from psyche.network.connection import NetworkConfig, NetworkConnection
    from psyche.network.discovery import (
        default_local_discovery_dir,
        record_signer,
        sign_address_record,
        verify_address_record,
    )
    from psyche.network.download import (
        Download,
        DownloadComplete,
        DownloadFailed,
        DownloadOutcome,
    )
    from psyche.network.events import MessageReceived, NetworkEvent, PeerConnected
    from psyche.network.gossip import choose_gossip_peers
    from psyche.network.identity import peer_id_from_public_key
    from psyche.network.model_download import DownloadedModel, ModelDownload
    from psyche.network.peer_manager import PeersUnreachable
    from psyche.network.reachability import relay_peer
    from psyche.network.relay import Relay, RelayOptions, open_relay
    from psyche.network.sharable_model import ParameterCodec, fetchers_expected
    from psyche.network.ticket import (
        BlobFormat,
        BlobTicket,
        EndpointAddr,
        TransportAddr,
        blob_hash,
        parse_host_port,
    )
    from psyche.network.transmittable import (
        DownloadType,
        ModelRequestType,
        SharableModelError,
        TicketResult,
    )

_MODULES = {
    ".connection": ("NetworkConfig", "NetworkConnection"),
    ".discovery": (
        "default_local_discovery_dir",
        "record_signer",
        "sign_address_record",
        "verify_address_record",
    ),
    ".download": ("Download", "DownloadComplete", "DownloadFailed", "DownloadOutcome"),
    ".events": ("MessageReceived", "NetworkEvent", "PeerConnected"),
    ".gossip": ("choose_gossip_peers",),
    ".identity": ("peer_id_from_public_key",),
    ".model_download": ("DownloadedModel", "ModelDownload"),
    ".peer_manager": ("PeersUnreachable",),
    ".reachability": ("relay_peer",),
    ".relay": ("Relay", "RelayOptions", "open_relay"),
    ".sharable_model": ("ParameterCodec", "fetchers_expected"),
    ".ticket": (
        "BlobFormat",
        "BlobTicket",
        "EndpointAddr",
        "TransportAddr",
        "blob_hash",
        "parse_host_port",
    ),
    ".transmittable": ("DownloadType", "ModelRequestType", "SharableModelError", "TicketResult"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
