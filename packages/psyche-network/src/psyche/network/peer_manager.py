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

A live peer that answers with a model of another version than the one the joiner wants
(`OtherModelVersion`) has not failed either. One that serves an older model (a provider that
missed its last cooldown's update, or a stale one) will not serve the wanted model in this
serving window: it is asked nothing more until the peers are set again (`set_peers`: a new
download, or the download's restart when a serving window ended), and when every peer left is
such a one or failed, the peer manager is exhausted. One that names a newer version (this joiner
is behind the run) or none (its model was replaced while it answered) or any number (a hostile
member) rests for a time that doubles with each such answer, from `NOT_SERVING_RETRY_SECS` to
`MAX_OTHER_VERSION_RETRY_SECS` (before, every such peer was asked every 2 s, for ever).
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
MAX_OTHER_VERSION_RETRY_SECS = 32.0
"""The longest rest of a peer that keeps answering with a newer (or no) model version."""


class OtherModelVersion(Exception):
    """A peer answered with tickets of another model than the one asked for: `version` (the
    peer's claim; None: not said) instead of `expected`."""

    def __init__(self, version: int | None, expected: int | None) -> None:
        super().__init__(f"a model of version {version}, not {expected}")
        self.version = version
        self.expected = expected

    @property
    def older(self) -> bool:
        """Whether the peer's model is older than the one asked for (both versions known)."""
        return (
            self.version is not None
            and self.expected is not None
            and (self.version < self.expected)
        )


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
        self.older: set[bytes] = set()
        """Peers that answered with an older model: asked nothing until `set_peers`."""
        self.other_version_answers: dict[bytes, int] = {}
        """Peers -> how many times in a row they answered with a newer (or no) model version."""
        self.exhausted = False
        """Every peer failed too often or serves an older model (`on_exhausted` was called)."""
        self.give_up_at = math.inf
        """While every peer says "not serving now", wait for them until this
        (`trio.current_time()`), then `PeersUnreachable`."""

    def set_peers(self, peers: Iterable[bytes]) -> None:
        self.available_peers = deque(bytes(p) for p in peers)
        self.errors_per_peer = {p: 0 for p in self.available_peers}
        self.resting = {}
        self._not_serving = set()
        self.older = set()
        self.other_version_answers = {}
        self.exhausted = False
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
        self.other_version_answers.pop(peer, None)
        if peer not in self.available_peers:
            self.available_peers.append(peer)

    def report_not_serving(self, peer: bytes) -> None:
        """`peer` is alive but serves no model now: no error; ask it again in a while."""
        if peer in self.older:
            return
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

    def report_other_version(self, peer: bytes, answer: OtherModelVersion) -> None:
        """`peer` answered with a model of another version: no error. An older model's peer is
        asked nothing more until `set_peers`; any other rests for a doubling time (at most
        `MAX_OTHER_VERSION_RETRY_SECS`)."""
        if answer.older:
            if peer not in self.older:
                logger.info(
                    "peer %s serves an older model (version %s, not %s): asking it nothing "
                    "more until the peers serve again",
                    fmt_short(peer),
                    answer.version,
                    answer.expected,
                )
            self.older.add(peer)
            self.available_peers = deque(p for p in self.available_peers if p != peer)
            self.resting.pop(peer, None)
            self._check_exhausted()
            return
        count = self.other_version_answers.get(peer, 0) + 1
        self.other_version_answers[peer] = count
        rest = min(NOT_SERVING_RETRY_SECS * 2 ** (count - 1), MAX_OTHER_VERSION_RETRY_SECS)
        logger.info(
            "peer %s serves another model (version %s, not %s): asking it again in %.0f s",
            fmt_short(peer),
            answer.version,
            answer.expected,
            rest,
        )
        self.resting[peer] = trio.current_time() + rest
        if peer not in self.available_peers and self.errors_per_peer.get(peer, 0) < (
            self.max_errors_per_peer
        ):
            self.available_peers.append(peer)

    def _check_exhausted(self) -> None:
        """Call `on_exhausted` once no peer is left to ask nor being asked: each failed too
        often or serves an older model."""
        if self.exhausted or self.available_peers:
            return
        if all(
            e >= self.max_errors_per_peer or p in self.older
            for p, e in self.errors_per_peer.items()
        ):
            logger.error("No more peers available to ask for model blob tickets")
            self.exhausted = True
            self._on_exhausted()

    def report_blob_ticket_request_error(self, peer: bytes) -> None:
        count = self.errors_per_peer.get(peer, 0) + 1
        self.errors_per_peer[peer] = count
        logger.warning(
            "Error requesting a blob ticket from peer %s (%d time(s))", fmt_short(peer), count
        )
        if count >= self.max_errors_per_peer:
            self.available_peers = deque(p for p in self.available_peers if p != peer)
            logger.warning("Removing peer %s after %d errors", fmt_short(peer), count)
            self._check_exhausted()
        elif peer not in self.available_peers and peer not in self.older:
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
        if peer_manager.exhausted:
            raise PeersUnreachable(f"{gave_up}: every peer failed or serves an older model")
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
            if isinstance(e, OtherModelVersion):
                peer_manager.report_other_version(peer, e)
                continue
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
