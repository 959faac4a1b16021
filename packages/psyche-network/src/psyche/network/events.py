"""What the network tells the application (upstream `NetworkEvent`), from `next_event()`.

Gossip the run's members sent, and newly connected members. Model-sharing requests are not
events (upstream's `ParameterRequest`/`ModelConfigRequest`): the network answers them from the
model it shares (`NetworkConnection.shared_model`). Downloads are not events either: each
`start_download` or `download_result` returns its own `Download`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MessageReceived:
    from_: bytes
    message: Any


@dataclass(frozen=True)
class PeerConnected:
    """A run member is newly connected (it had no connection to us before). Gossip reaches only
    peers connected when a message is published, so the client re-sends what a newcomer may
    have missed."""

    peer: bytes


NetworkEvent = MessageReceived | PeerConnected
