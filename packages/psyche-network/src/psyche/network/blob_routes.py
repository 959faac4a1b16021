"""Which way a blob comes from each provider, and the sessions kept open for the next one.

`BlobRoutes` is the downloader's `BlobTransport`. Per provider it uses:

1. **the side channel** when the provider announces one and is directly reachable (its address
   record names no relay): a Noise session on a TCP connection of its own, near socket speed;
2. **a libp2p stream** otherwise, or as soon as the side channel cannot be reached or breaks:
   the stream goes over whatever libp2p connection joins the two peers (direct, hole punched,
   or through a relay), so bulk data goes wherever the peer connection goes.

A peer behind NAT is first reached through a relay; once hole punching opens a direct
connection beside the relayed one (both stay open), new sessions take the direct one and idle
sessions on the relay are not reused. A punched path can die without a word (a NAT drops the
mapping): a fetch on it that receives nothing (or cannot open its stream) for
`DIRECT_STALL_SECS` while the relayed connection is open is moved to the relay at once, the
peer's direct path is suspect (sessions use the relay) for `DIRECT_SUSPECT_SECS`, and `on_direct_stalled` asks the network to check the
path (it closes the direct connection when pings go unanswered). So a dead punched path costs a
fetch a few seconds, not the attempt timeout, and the round goes on over the relay.

The switch is automatic: a provider whose side channel failed is fetched over libp2p for
`SIDE_CHANNEL_RETRY_SECS` before the side channel is tried again, and the route a provider's
blobs take is logged once each time it changes. A fetch whose side channel breaks mid-transfer
continues on libp2p at once. Sessions are reused (one handshake per provider, not per blob):
after a blob its session waits up to `IDLE_SESSION_SECS` for the next fetch from that
provider, and at most `max_per_peer` fetches run against one provider at a time (upstream's
bounded concurrent downloads per peer), so no provider is swamped by one requester.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import trio

from psyche.network.blob_protocol import (
    BlobNotFound,
    BlobProtocolError,
    BlobRefused,
    BlobSession,
    HashMismatch,
    ProgressFn,
    StreamClosed,
)
from psyche.network.blob_transport import Libp2pBlobStreams, TcpBlobTransport
from psyche.network.identity import fmt_short
from psyche.network.secure_channel import SecureChannelError
from psyche.network.ticket import EndpointAddr

logger = logging.getLogger(__name__)

SIDE_CHANNEL = "side channel"
LIBP2P_DIRECT = "libp2p stream (direct connection)"
LIBP2P_RELAYED = "libp2p stream (through a relay)"

SIDE_CHANNEL_RETRY_SECS = 60.0
DIRECT_STALL_SECS = 3.0
"""How long a fetch on a direct connection may receive nothing before it moves to the relayed
connection to the same peer (when there is one): long enough for a loaded provider to start
sending, short enough that a payload still arrives within its round."""
DIRECT_SUSPECT_SECS = 30.0
"""How long after a stall new sessions to that peer take the relayed connection."""
IDLE_SESSION_SECS = 20.0
MAX_IDLE_SESSIONS_PER_PEER = 4
DEFAULT_MAX_FETCHES_PER_PEER = 4

_BROKEN = (OSError, trio.TooSlowError, trio.BrokenResourceError, SecureChannelError, StreamClosed)
"""What a broken path raises (as opposed to a provider that answers wrongly)."""


def is_relayed_record(addr: EndpointAddr) -> bool:
    """Whether an endpoint announces itself through a relay (it is not directly reachable)."""
    return any("/p2p-circuit" in a for a in addr.libp2p_addrs())


@dataclass
class _Idle:
    session: BlobSession
    route: str
    since: float


class DirectPathStalled(trio.BrokenResourceError):
    """Nothing came over a direct connection for `DIRECT_STALL_SECS`."""


class BlobRoutes:
    def __init__(
        self,
        side_channel: TcpBlobTransport,
        libp2p: Libp2pBlobStreams | None,
        *,
        max_per_peer: int = DEFAULT_MAX_FETCHES_PER_PEER,
        clock: Callable[[], float] = trio.current_time,
        on_direct_stalled: Callable[[bytes], None] = lambda peer: None,
        direct_stall_secs: float = DIRECT_STALL_SECS,
    ) -> None:
        self.side_channel = side_channel
        self.libp2p = libp2p
        self.max_per_peer = max_per_peer
        self._clock = clock
        self._on_direct_stalled = on_direct_stalled
        self.direct_stall_secs = direct_stall_secs
        self._direct_suspect: dict[bytes, float] = {}
        self._slots: dict[bytes, trio.Semaphore] = {}
        self._idle: defaultdict[bytes, list[_Idle]] = defaultdict(list)
        self._side_channel_down: dict[bytes, float] = {}
        self._closing: list[BlobSession] = []
        self.routes: dict[bytes, str] = {}
        """The route each provider's last blob took."""

    # the BlobTransport interface ---------------------------------------------------------------

    def can_reach(self, addr: EndpointAddr) -> bool:
        return bool(addr.blob_addrs()) or (self.libp2p is not None and bool(addr.libp2p_addrs()))

    async def fetch(
        self, provider: EndpointAddr, digest: bytes, size: int, on_progress: ProgressFn
    ) -> bytearray:
        peer = provider.id
        slot = self._slots.setdefault(peer, trio.Semaphore(self.max_per_peer))
        async with slot:
            return await self._fetch(provider, digest, size, on_progress)

    # routes ------------------------------------------------------------------------------------

    def _side_channel_usable(self, provider: EndpointAddr) -> bool:
        if not provider.blob_addrs() or is_relayed_record(provider):
            return False
        down_since = self._side_channel_down.get(provider.id)
        return down_since is None or self._clock() - down_since >= SIDE_CHANNEL_RETRY_SECS

    async def _fetch(
        self, provider: EndpointAddr, digest: bytes, size: int, on_progress: ProgressFn
    ) -> bytearray:
        peer = provider.id
        side_channel_error: Exception | None = None
        if self._side_channel_usable(provider):
            try:
                return await self._fetch_on(SIDE_CHANNEL, provider, digest, size, on_progress)
            except _BROKEN as e:
                side_channel_error = e
                self._side_channel_down[peer] = self._clock()
                if self.libp2p is None:
                    raise
        if self.libp2p is None or not (provider.libp2p_addrs() or self.libp2p.connected(peer)):
            if side_channel_error is not None:
                raise side_channel_error
            raise ConnectionError(f"{fmt_short(peer)} has no blob route we can use")
        try:
            return await self._fetch_on(
                None, provider, digest, size, on_progress, side_channel_error
            )
        except _BROKEN as e:
            if side_channel_error is None:
                raise
            raise ConnectionError(f"side channel: {side_channel_error}; libp2p: {e}") from e

    async def _fetch_on(
        self,
        route: str | None,
        provider: EndpointAddr,
        digest: bytes,
        size: int,
        on_progress: ProgressFn,
        why: Exception | None = None,
    ) -> bytearray:
        """Fetch on an idle session of `route` (None: libp2p) or a new one. A reused session
        the provider has closed meanwhile is replaced once, transparently."""
        peer = provider.id
        fresh = stalled = False
        while True:
            idle = None if fresh else self._take_idle(peer, route)
            if idle is not None:
                session, used = idle.session, idle.route
            else:
                try:
                    session, used = await self._open(route, provider)
                except DirectPathStalled as e:
                    if stalled:
                        raise
                    stalled = fresh = True  # once more, through the relay
                    why = e
                    continue
            try:
                if used == LIBP2P_DIRECT and self._relay_beside(peer):
                    data = await self._fetch_watching_direct(
                        session, peer, digest, size, on_progress
                    )
                else:
                    data = await session.fetch(digest, size, on_progress)
            except (BlobNotFound, BlobRefused, HashMismatch):
                await self._close(session)
                raise
            except DirectPathStalled as e:
                await self._close(session)
                if stalled:
                    raise
                stalled = fresh = True  # once more, through the relay
                why = e
                continue
            except (*_BROKEN, BlobProtocolError):
                await self._close(session)
                if idle is not None and not fresh:
                    fresh = True  # an idle session the provider closed: one more, fresh
                    continue
                raise
            except BaseException:
                await self._close(session)
                raise
            self._note_route(peer, used, why)
            self._keep_idle(peer, session, used)
            return data

    def _relay_beside(self, peer: bytes) -> bool:
        return self.libp2p is not None and self.libp2p.has_path(peer, "relayed")

    def direct_suspected(self, peer: bytes) -> bool:
        """Whether new sessions to `peer` take the relay (its direct path stalled lately)."""
        since = self._direct_suspect.get(peer)
        if since is not None and trio.current_time() - since >= DIRECT_SUSPECT_SECS:
            del self._direct_suspect[peer]
            since = None
        return since is not None

    async def _fetch_watching_direct(
        self, session: BlobSession, peer: bytes, digest: bytes, size: int, on_progress: ProgressFn
    ) -> bytearray:
        """`session.fetch`, given up (`DirectPathStalled`) once nothing arrives for
        `direct_stall_secs` before the last byte."""
        watch = trio.CancelScope(deadline=trio.current_time() + self.direct_stall_secs)

        def progress(received: int) -> None:
            watch.deadline = (
                math.inf if received >= size else trio.current_time() + self.direct_stall_secs
            )
            on_progress(received)

        with watch:
            return await session.fetch(digest, size, progress)
        raise self._direct_stalled(peer, "nothing came over the direct connection")

    def _direct_stalled(self, peer: bytes, what: str) -> DirectPathStalled:
        """Mark the direct path to `peer` suspect, have it checked, and say so."""
        self._direct_suspect[peer] = trio.current_time()
        logger.info(
            "blobs from %s: %s for %.0f s; fetching through the relay",
            fmt_short(peer),
            what,
            self.direct_stall_secs,
        )
        self._on_direct_stalled(peer)
        return DirectPathStalled(f"the direct path to {fmt_short(peer)} stalled")

    async def _open(self, route: str | None, provider: EndpointAddr) -> tuple[BlobSession, str]:
        """A new session. On a direct connection with a relayed one beside it, opening the
        stream is watched as a fetch is: on a dead path it would wait for the connection to
        be closed."""
        if route == SIDE_CHANNEL:
            return await self.side_channel.open_session(provider), SIDE_CHANNEL
        assert self.libp2p is not None
        peer = provider.id
        suspected = self.direct_suspected(peer)
        watched = not suspected and self._relay_beside(peer)
        with trio.move_on_after(self.direct_stall_secs if watched else math.inf):
            session, relayed = await self.libp2p.open_session(peer, relayed=suspected)
            return session, LIBP2P_RELAYED if relayed else LIBP2P_DIRECT
        raise self._direct_stalled(peer, "no stream opened on the direct connection")

    def _note_route(self, peer: bytes, route: str, why: Exception | None) -> None:
        if self.routes.get(peer) == route:
            return
        self.routes[peer] = route
        if isinstance(why, DirectPathStalled):
            reason = " (the direct connection stalled)"
        else:
            reason = f" (side channel unreachable: {why})" if why is not None else ""
        logger.info("blobs from %s now come by %s%s", fmt_short(peer), route, reason)

    # idle sessions -----------------------------------------------------------------------------

    def _take_idle(self, peer: bytes, route: str | None) -> _Idle | None:
        sessions = self._idle.get(peer)
        now = self._clock()
        while sessions:
            idle = sessions.pop()
            if now - idle.since >= IDLE_SESSION_SECS:
                self._close_later(idle.session)
                continue
            if (route == SIDE_CHANNEL) == (idle.route == SIDE_CHANNEL) and not self._outdated(
                peer, idle.route
            ):
                return idle
            self._close_later(idle.session)
        return None

    def _outdated(self, peer: bytes, route: str) -> bool:
        """An idle libp2p session on the other path than the one new sessions take: on the
        relay once a (trusted) direct connection is open, on a suspect direct one."""
        if self.libp2p is None or route == SIDE_CHANNEL:
            return False
        if route == LIBP2P_DIRECT:
            return self.direct_suspected(peer)
        return self.libp2p.has_path(peer, "direct") and not self.direct_suspected(peer)

    def _keep_idle(self, peer: bytes, session: BlobSession, route: str) -> None:
        sessions = self._idle[peer]
        sessions.append(_Idle(session, route, self._clock()))
        while len(sessions) > MAX_IDLE_SESSIONS_PER_PEER:
            self._close_later(sessions.pop(0).session)

    def _close_later(self, session: BlobSession) -> None:
        self._closing.append(session)

    async def _close(self, session: BlobSession) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            try:
                await session.stream.aclose()
            except Exception as e:
                logger.debug("closing a blob session: %s", e)

    async def run(self) -> None:
        """Close sessions idle past `IDLE_SESSION_SECS` (run in the network's nursery); all of
        them when cancelled."""
        try:
            while True:
                await trio.sleep(IDLE_SESSION_SECS / 4)
                now = self._clock()
                for peer in list(self._idle):
                    keep = []
                    for idle in self._idle[peer]:
                        if now - idle.since < IDLE_SESSION_SECS:
                            keep.append(idle)
                        else:
                            self._closing.append(idle.session)
                    if keep:
                        self._idle[peer] = keep
                    else:
                        del self._idle[peer]
                await self._close_pending()
        finally:
            for sessions in self._idle.values():
                self._closing.extend(idle.session for idle in sessions)
            self._idle.clear()
            await self._close_pending()

    async def _close_pending(self) -> None:
        closing, self._closing = self._closing, []
        for session in closing:
            await self._close(session)

    def idle_sessions(self) -> int:
        return sum(len(s) for s in self._idle.values())


__all__ = [
    "DIRECT_STALL_SECS",
    "LIBP2P_DIRECT",
    "LIBP2P_RELAYED",
    "SIDE_CHANNEL",
    "BlobRoutes",
    "DirectPathStalled",
    "is_relayed_record",
]
