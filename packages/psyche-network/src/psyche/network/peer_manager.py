"""Which peer a joining client asks next for a model blob ticket (upstream p2p_model_sharing.rs).

Peers are ranked by measured download bandwidth, then latency; `get_next_peer` hands one out
and removes it from the pool until it reports back, so a peer serves one ticket request at a
time. A peer that fails `max_errors_per_peer` times is dropped; when every known peer is, the
`on_exhausted` callback fires (upstream cancels the client: "Peers were unreachable...").

A live peer that answers "not serving now" (`sharable_model.not_serving_now`: peers serve the
model only during warmup, so one asked after it ended, or still loading the model itself,
says so) has not failed: it rests for `NOT_SERVING_RETRY_SECS` and is asked again, and the
time spent waiting for a peer to serve counts against no attempt budget (the caller's
deadline bounds it). Before, each such answer was an error, and a joiner that asked after a
warmup ended had every peer removed after 5 answers and gave up (`PeersUnreachable`) instead
of waiting for the next warmup.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import trio

from psyche.network.connection_monitor import ConnectionMonitor
from psyche.network.identity import fmt_short
from psyche.network.stats import PeerBandwidth
from psyche.network.ticket import BlobTicket
from psyche.network.transmittable import (
    ModelRequestType,
    SharableModelError,
    SharableModelFailure,
    TicketResult,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_ERRORS_PER_PEER = 5
MODEL_REQUEST_TIMEOUT_SECS = 10.0
MAX_TICKET_REQUEST_ATTEMPTS = 500
NO_PEER_SLEEP_SECS = 0.5
RETRY_SLEEP_SECS = 0.1
NOT_SERVING_RETRY_SECS = 2.0
"""A peer that answered "not serving now" is asked again after this long."""


def _tier(bandwidth: PeerBandwidth) -> int:
    match bandwidth:
        case PeerBandwidth.Measured(v) if v > 0.0:
            return 0
        case PeerBandwidth.NotMeasured():
            return 1
    return 2


def sort_peers_by_quality(
    peers: list[tuple[bytes, PeerBandwidth, float]],
) -> list[tuple[bytes, PeerBandwidth, float]]:
    """Tier (fast, unmeasured, failed), then higher measured bandwidth, then lower latency."""

    def key(item: tuple[bytes, PeerBandwidth, float]) -> tuple[int, float, float]:
        _, bandwidth, latency = item
        measured = bandwidth.value if isinstance(bandwidth, PeerBandwidth.Measured) else 0.0
        # Bandwidth only orders peers that are both measured; within tier 1 all are equal.
        return (_tier(bandwidth), -measured, latency)

    return sorted(peers, key=key)


class PeerManager:
    def __init__(
        self,
        monitor: ConnectionMonitor,
        *,
        max_errors_per_peer: int = MAX_ERRORS_PER_PEER,
        on_exhausted: Callable[[], None] = lambda: None,
    ) -> None:
        self._monitor = monitor
        self.max_errors_per_peer = max_errors_per_peer
        self._on_exhausted = on_exhausted
        self.available_peers: deque[bytes] = deque()
        self.errors_per_peer: dict[bytes, int] = {}
        self.resting: dict[bytes, float] = {}
        """Peers that answered "not serving now" -> when to ask them again
        (`trio.current_time()`); they stay in `available_peers`."""
        self._not_serving: set[bytes] = set()  # logged once until the peer serves again
        self.give_up_at = math.inf
        """While every peer says "not serving now", wait for them until this
        (`trio.current_time()`), then `PeersUnreachable`."""

    def set_peers(self, peers: Iterable[bytes]) -> None:
        self.available_peers = deque(bytes(p) for p in peers)
        self.errors_per_peer = {p: 0 for p in self.available_peers}
        self.resting = {}
        self._not_serving = set()
        logger.info("Updated peer list (%d peers)", len(self.available_peers))

    def get_next_peer(self) -> bytes | None:
        if self.resting:  # (only a peer that said "not serving" needs the clock)
            now = trio.current_time()
            self.resting = {p: t for p, t in self.resting.items() if t > now}
        ranked = sort_peers_by_quality(
            [
                (
                    p,
                    self._monitor.get_bandwidth(p) or PeerBandwidth.NotMeasured(),
                    _latency_or_inf(self._monitor.get_latency(p)),
                )
                for p in self.available_peers
            ]
        )
        self.available_peers = deque(p for p, _, _ in ranked)
        ready = [p for p in self.available_peers if p not in self.resting]
        if not ready:
            if not self.available_peers:
                logger.info("No available peers to ask for the model parameters at the moment")
            return None
        self.available_peers.remove(ready[0])
        return ready[0]

    def waiting_for_serving(self) -> bool:
        """Whether every peer left to ask said "not serving now" a moment ago (a wait for the
        peers' next warmup, not for a free peer)."""
        return bool(self.available_peers) and all(p in self.resting for p in self.available_peers)

    def report_success(self, peer: bytes) -> None:
        self.resting.pop(peer, None)
        self._not_serving.discard(peer)
        if peer not in self.available_peers:
            self.available_peers.append(peer)

    def report_not_serving(self, peer: bytes) -> None:
        """`peer` is alive but serves no model now: no error; ask it again in a while."""
        if peer not in self._not_serving:
            self._not_serving.add(peer)
            logger.info(
                "peer %s serves no model now (outside its warmup, or still loading); asking "
                "again in %.0f s",
                fmt_short(peer),
                NOT_SERVING_RETRY_SECS,
            )
        self.resting[peer] = trio.current_time() + NOT_SERVING_RETRY_SECS
        if peer not in self.available_peers and self.errors_per_peer.get(peer, 0) < (
            self.max_errors_per_peer
        ):
            self.available_peers.append(peer)

    def report_blob_ticket_request_error(self, peer: bytes) -> None:
        count = self.errors_per_peer.get(peer, 0) + 1
        self.errors_per_peer[peer] = count
        logger.warning(
            "Error requesting a blob ticket from peer %s (%d time(s))", fmt_short(peer), count
        )
        if count >= self.max_errors_per_peer:
            self.available_peers = deque(p for p in self.available_peers if p != peer)
            logger.warning("Removing peer %s after %d errors", fmt_short(peer), count)
            if not self.available_peers and all(
                e >= self.max_errors_per_peer for e in self.errors_per_peer.values()
            ):
                logger.error("No more peers available to ask for model blob tickets")
                self._on_exhausted()
        elif peer not in self.available_peers:
            self.available_peers.append(peer)


def not_serving_now(error: SharableModelError) -> bool:
    """Whether a peer's answer means "alive, but serving no model now" (it has no parameters
    to serve: its warmup ended, or it is still loading the model) rather than a failure."""
    return isinstance(
        error,
        SharableModelError.ParametersNotInitialized
        | SharableModelError.ModelConfigNotInitialized
        | SharableModelError.TokenizerConfigNotInitialized,
    )


def _latency_or_inf(latency: float | None) -> float:
    return float("inf") if latency is None else latency


class PeersUnreachable(RuntimeError):
    """Upstream: "Peers were unreachable for P2P parameter requests. Try joining again"."""


RequestTicketFn = Callable[[bytes, ModelRequestType], Awaitable[BlobTicket]]
RequestTicketsFn = Callable[[bytes, list[str]], Awaitable[list[TicketResult]]]


async def blob_ticket_param_request_task(
    request: ModelRequestType,
    request_ticket: RequestTicketFn,
    peer_manager: PeerManager,
    *,
    max_attempts: int = MAX_TICKET_REQUEST_ATTEMPTS,
    request_timeout: float = MODEL_REQUEST_TIMEOUT_SECS,
) -> tuple[BlobTicket, ModelRequestType, bytes]:
    """Ask peers for `request`'s ticket until one answers; returns (ticket, request, peer).

    Waiting for a free peer counts as an attempt, as upstream. Raises `PeersUnreachable` after
    `max_attempts`.
    """
    ticket, peer = await _ask_peers(
        lambda peer: request_ticket(peer, request),
        peer_manager,
        max_attempts,
        request_timeout,
        "Request",
        "Failed to get model parameter blob ticket",
    )
    return ticket, request, peer


async def blob_ticket_batch_request_task(
    names: list[str],
    request_tickets: RequestTicketsFn,
    peer_manager: PeerManager,
    *,
    max_attempts: int = MAX_TICKET_REQUEST_ATTEMPTS,
    request_timeout: float = MODEL_REQUEST_TIMEOUT_SECS,
) -> tuple[list[TicketResult], bytes]:
    """`blob_ticket_param_request_task` for many parameters at once (the batch protocol):
    ask peers until one answers the whole batch; returns (one result per name, peer). A peer
    that answers is reported successful even if some names came back as errors: the caller
    judges those."""
    return await _ask_peers(
        lambda peer: request_tickets(peer, names),
        peer_manager,
        max_attempts,
        request_timeout,
        "Batch request",
        "Failed to get model parameter blob tickets",
    )


async def _ask_peers(
    ask: Callable[[bytes], Awaitable[T]],
    peer_manager: PeerManager,
    max_attempts: int,
    request_timeout: float,
    what: str,
    gave_up: str,
) -> tuple[T, bytes]:
    """`ask` the peer manager's next peer until one answers; (the answer, that peer). A peer
    that answers "not serving now" rests (`PeerManager.report_not_serving`); waiting while
    every peer rests costs no attempt."""
    attempts = 0
    while attempts < max_attempts:
        peer = peer_manager.get_next_peer()
        if peer is None:
            if not peer_manager.waiting_for_serving():
                attempts += 1
            elif trio.current_time() >= peer_manager.give_up_at:
                raise PeersUnreachable(f"{gave_up}: no peer served the model in time")
            await trio.sleep(NO_PEER_SLEEP_SECS)
            continue
        try:
            with trio.fail_after(request_timeout):
                answer = await ask(peer)
        except Exception as e:
            if isinstance(e, SharableModelFailure) and not_serving_now(e.error):
                peer_manager.report_not_serving(peer)
                continue
            peer_manager.report_blob_ticket_request_error(peer)
            logger.warning("%s failed for peer %s: %s. Trying next peer", what, fmt_short(peer), e)
            attempts += 1
            await trio.sleep(RETRY_SLEEP_SECS)
            continue
        peer_manager.report_success(peer)
        return answer, peer
    raise PeersUnreachable(f"{gave_up} after {max_attempts} attempts")
