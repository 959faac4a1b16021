"""Peer-to-peer networking for Psyche: signed gossip, content-addressed blobs and model sharing.

`NetworkConnection` (in `psyche.network.connection`) is the facade. Names are exported lazily so
`import psyche.network` does not pay for libp2p (about a second) or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "NetworkConnection": "psyche.network.connection",
    "NetworkConfig": "psyche.network.connection",
    "NetworkEvent": "psyche.network.connection",
    "MessageReceived": "psyche.network.connection",
    "ParameterRequest": "psyche.network.connection",
    "ModelConfigRequest": "psyche.network.connection",
    "TicketReply": "psyche.network.connection",
    "DownloadComplete": "psyche.network.download",
    "DownloadFailed": "psyche.network.download",
    "BlobTicket": "psyche.network.ticket",
    "EndpointAddr": "psyche.network.ticket",
    "TransportAddr": "psyche.network.ticket",
    "raw_p2p_verify": "psyche.core.signed_message",
    "TransmittableDownload": "psyche.network.transmittable",
    "DownloadType": "psyche.network.transmittable",
    "ModelRequestType": "psyche.network.transmittable",
    "SharableModelError": "psyche.network.transmittable",
    "SharableModel": "psyche.network.model_sharing",
    "fetch_model_from_peers": "psyche.network.model_download",
    "ModelDownload": "psyche.network.model_download",
    "DownloadScheduler": "psyche.network.scheduler",
    "PeerManager": "psyche.network.peer_manager",
    "fmt_bytes": "psyche.network.stats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'psyche.network' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
