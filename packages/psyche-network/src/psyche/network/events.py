"""What the network tells the application (upstream `NetworkEvent`), from `next_event()`.

Gossip the run's members sent, and model-sharing requests that the application answers through
their `TicketReply`. Downloads are not events: each `start_download` returns its own `Download`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

from psyche.network.transmittable import TicketResult


@dataclass(frozen=True)
class MessageReceived:
    from_: bytes
    message: Any


class TicketReply:
    """One-shot answer to a model-sharing request (upstream's oneshot sender)."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self._result: TicketResult | None = None

    def send(self, result: TicketResult) -> None:
        if self._result is None:
            self._result = result
            self._event.set()

    @property
    def result(self) -> TicketResult | None:
        """The answer if it was sent, without waiting."""
        return self._result

    async def receive(self) -> TicketResult:
        await self._event.wait()
        assert self._result is not None
        return self._result


@dataclass(frozen=True)
class ParameterRequest:
    name: str
    reply: TicketReply


@dataclass(frozen=True)
class ModelConfigRequest:
    reply: TicketReply


@dataclass(frozen=True)
class PeerConnected:
    """A run member is newly connected (it had no connection to us before). Gossip reaches only
    peers connected when a message is published, so the client re-sends what a newcomer may
    have missed."""

    peer: bytes


NetworkEvent = MessageReceived | ParameterRequest | ModelConfigRequest | PeerConnected
