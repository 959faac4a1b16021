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

On the side channel the fetches to one provider share one session as a pipeline
(`BlobSession`): each sends its request at once and reads its reply in turn, so the provider
sends blob after blob without waiting a round trip for the next request, and a provider costs
one Noise handshake however many blobs are fetched at once. A fetch joins a session only while
at most `PIPELINE_BYTES` are queued on it (else it opens another), so a request waits behind at
most that many bytes and its attempt timeout (10 s plus 1 s per MiB) still measures its own
transfer on any path faster than 1 MiB/s. libp2p sessions carry one fetch at a time: the
direct-path stall watch times a fetch from its start, which a queued request would trip.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from psyche.network.blob_protocol import (
    BlobNotFound,
    BlobProtocolError,
    BlobRefused,
    BlobSession,
    HashMismatch,
    NoModelAnswers,
    ProgressFn,
    SessionBroken,
    StreamClosed,
)
from psyche.network.blob_transport import Libp2pBlobStreams, TcpBlobTransport
from psyche.network.identity import fmt_short
from psyche.network.secure_channel import SecureChannelError
from psyche.network.ticket import EndpointAddr

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

SIDE_CHANNEL = "side channel"
LIBP2P_DIRECT = "libp2p stream (direct connection)"
LIBP2P_RELAYED = "libp2p stream (through a relay)"

SIDE_CHANNEL_RETRY_SECS = 60.0
OLDER_PROVIDER_SECS = 600.0
"""How long a provider that closed a session on a model request (older than `GetConfig` and
`GetTickets`) is asked for the model over libp2p only; after it, a provider restarted on a
newer version is asked on the side channel again."""
DIRECT_STALL_SECS = 3.0
"""How long a fetch on a direct connection may receive nothing before it moves to the relayed
connection to the same peer (when there is one): long enough for a loaded provider to start
sending, short enough that a payload still arrives within its round."""
DIRECT_SUSPECT_SECS = 30.0
"""How long after a stall new sessions to that peer take the relayed connection."""
IDLE_SESSION_SECS = 20.0
MAX_IDLE_SESSIONS_PER_PEER = 4
DEFAULT_MAX_FETCHES_PER_PEER = 4
PIPELINE_BYTES = 8 << 20
"""At most this many bytes of requests queue on one side-channel session (one request of any
size may always go on an idle session)."""

_BROKEN = (OSError, trio.TooSlowError, trio.BrokenResourceError, SecureChannelError, StreamClosed)
"""What a broken path raises (as opposed to a provider that answers wrongly)."""


def is_relayed_record(addr: EndpointAddr) -> bool:
    """Whether an endpoint announces itself through a relay (it is not directly reachable)."""
    return any("/p2p-circuit" in a for a in addr.libp2p_addrs())


@dataclass
class _Session:
    """A session kept for the provider's next fetches; `since`: when it last became idle."""

    session: BlobSession
    route: str
    since: float

    def takes(self, size: int) -> bool:
        """Whether a fetch of `size` bytes may go on it now."""
        session = self.session
        if session.broken is not None:
            return False
        if session.pending == 0:
            return True
        return self.route == SIDE_CHANNEL and session.queued_bytes + size <= PIPELINE_BYTES


def _noted_within(noted: dict[bytes, float], peer: bytes, now: float, secs: float) -> bool:
    """Whether `noted` holds a time for `peer` less than `secs` before `now`; an older one is
    forgotten."""
    since = noted.get(peer)
    if since is not None and now - since >= secs:
        del noted[peer]
        since = None
    return since is not None


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
        self._sessions: defaultdict[bytes, list[_Session]] = defaultdict(list)
        """Each provider's open sessions, idle or carrying fetches."""
        self._opening: dict[bytes, trio.Event] = {}
        """Providers a side-channel session is being opened to (the others wait for it)."""
        self._side_channel_down: dict[bytes, float] = {}
        self._older_providers: dict[bytes, float] = {}
        """When each provider last closed a session on a model request (`ask`)."""
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
        try:
            async with slot:
                return await self._fetch(provider, digest, size, on_progress)
        finally:
            if peer not in self._slots:  # forgotten meanwhile: drop what this fetch noted
                await self.forget(peer)

    async def prepare(self, provider: EndpointAddr) -> bool:
        """Open and authenticate a side-channel session to `provider` (a run member the caller
        is about to fetch from) ahead of its first fetch, which then takes it: the handshake
        overlaps whatever the caller waits for first (a joiner's ticket requests). Nothing new
        is opened when a session is kept or being opened (that one is waited for), or the side
        channel is not usable; a failure is only logged (the fetches meet it again and route
        around it). Returns whether the caller needs no other path to `provider` for now: a
        side-channel session is kept and the provider is not known to be older than the
        model requests (`ask`), so its model requests and blobs all go there."""
        return await self._prepare(provider) and not self._older(provider.id)

    async def _prepare(self, provider: EndpointAddr) -> bool:
        """`prepare`'s session: whether one is kept for `provider` now."""
        peer = provider.id
        if not self._side_channel_usable(provider):
            return False
        opening = self._opening.get(peer)
        if opening is not None:
            await opening.wait()
        if self._kept_side_channel(peer):
            return True
        try:
            kept = await self._open_kept(SIDE_CHANNEL, provider)
        except (*_BROKEN, BlobProtocolError) as e:
            logger.debug("opening a blob session to %s ahead: %s", fmt_short(peer), e)
            return False
        try:
            await kept.session.handshake()
        except (*_BROKEN, BlobProtocolError) as e:
            logger.debug("blob handshake with %s ahead: %s", fmt_short(peer), e)
            await self._drop(peer, kept)
            return False
        return True

    def _kept_side_channel(self, peer: bytes) -> bool:
        """Whether a side-channel session to `peer` is kept that takes a request now."""
        return any(k.route == SIDE_CHANNEL and k.takes(0) for k in self._sessions.get(peer, ()))

    async def ask(
        self, provider: EndpointAddr, request: Callable[[BlobSession], Awaitable[_T]]
    ) -> _T | None:
        """`request(session)` (`BlobSession.config`, `BlobSession.tickets`) on a side-channel
        session to `provider` (the one `prepare` opens, or a new one, kept for the blobs after
        it), so the answer waits for no libp2p connection. None when the side channel cannot
        answer: not usable to `provider` (none announced, a relay-only record, failed lately),
        broken, or a provider older than the request: the caller asks over libp2p then. The
        session is kept or closed whatever `request` raises.

        An older provider closes the session on the request (`NoModelAnswers`), breaking the
        fetches behind it on the session. Once it did so to a session's first request (a
        kept session it closed meanwhile looks the same: that one is tried again on a fresh
        session), it is not asked on the side channel again for `OLDER_PROVIDER_SECS`
        (`_older`), so later requests go straight to libp2p and cost no session."""
        peer = provider.id
        fresh = False
        while True:
            if not self._side_channel_usable(provider) or self._older(peer):
                return None
            try:
                kept = None if fresh else await self._take(peer, SIDE_CHANNEL, 0)
                if kept is None:
                    kept = await self._open_kept(SIDE_CHANNEL, provider)
            except (*_BROKEN, BlobProtocolError) as e:
                logger.debug("no blob session to %s for a model request: %s", fmt_short(peer), e)
                return None
            first = kept.session.requests == 0
            try:
                answer = await request(kept.session)
            except NoModelAnswers as e:
                await self._drop(peer, kept)
                if not first and not fresh:
                    fresh = True
                    continue
                self._note_older(peer)
                logger.debug(
                    "%s answers no model request on its side channel: %s", fmt_short(peer), e
                )
                return None
            except (*_BROKEN, BlobProtocolError) as e:
                await self._drop(peer, kept)
                logger.debug("a model request on %s's side channel: %s", fmt_short(peer), e)
                return None
            except BaseException:
                await self._drop(peer, kept)
                raise
            await self._done_with(peer, kept)
            return answer

    def _older(self, peer: bytes) -> bool:
        """Whether `peer` closed a session on a model request within `OLDER_PROVIDER_SECS`."""
        return _noted_within(self._older_providers, peer, self._clock(), OLDER_PROVIDER_SECS)

    def _note_older(self, peer: bytes) -> None:
        """Remember `peer` as older than the model requests, forgetting the others whose
        time is up (so the table holds only providers noted in the last
        `OLDER_PROVIDER_SECS`, each of which proved its identity in a handshake)."""
        now = self._clock()
        for other, since in list(self._older_providers.items()):
            if now - since >= OLDER_PROVIDER_SECS:
                del self._older_providers[other]
        self._older_providers[peer] = now

    # peers that left ---------------------------------------------------------------------------

    def peers(self) -> set[bytes]:
        """Every provider something is held for (slots, sessions, routes, remembered failures)."""
        return {
            *self._slots,
            *self._sessions,
            *self._side_channel_down,
            *self._older_providers,
            *self._direct_suspect,
            *self.routes,
        }

    async def forget(self, peer: bytes) -> None:
        """Drop everything held for `peer` (it left the run): its fetch slots, route, the
        remembered side-channel failure, older-provider and direct-path suspicion, and its
        sessions (`_drop`: an idle one is closed now, one carrying a fetch as that fetch ends,
        so the fetch is not failed under it; no fetch joins it meanwhile). Everything is
        dropped before the first close, so the tables are clean whatever a close raises
        (`_close` swallows and times out), and a fetch under way forgets again, when it ends,
        what it noted meanwhile (`fetch`). Without this a long-running client kept an entry
        per peer it ever fetched from."""
        self._slots.pop(peer, None)
        self._side_channel_down.pop(peer, None)
        self._older_providers.pop(peer, None)
        self._direct_suspect.pop(peer, None)
        self.routes.pop(peer, None)
        sessions = self._sessions.pop(peer, [])
        for kept in sessions:
            kept.session.broken = kept.session.broken or "its provider left the run"
        for kept in sessions:
            await self._drop(peer, kept)

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
        """Fetch on a kept session of `route` (None: libp2p) or a new one. A reused session
        the provider has closed meanwhile, or one an earlier request broke, is replaced once,
        transparently."""
        peer = provider.id
        fresh = stalled = False
        while True:
            kept = None if fresh else await self._take(peer, route, size)
            if kept is None:
                try:
                    kept = await self._open_kept(route, provider)
                except DirectPathStalled as e:
                    if stalled:
                        raise
                    stalled = fresh = True  # once more, through the relay
                    why = e
                    continue
            session, used = kept.session, kept.route
            reused = session.fetched > 0 or session.pending > 0
            try:
                if used == LIBP2P_DIRECT and self._relay_beside(peer):
                    data = await self._fetch_watching_direct(
                        session, peer, digest, size, on_progress
                    )
                else:
                    data = await session.fetch(digest, size, on_progress)
            except BlobNotFound:
                await self._done_with(peer, kept)
                raise
            except (BlobRefused, HashMismatch):
                await self._drop(peer, kept)
                raise
            except DirectPathStalled as e:
                await self._drop(peer, kept)
                if stalled:
                    raise
                stalled = fresh = True  # once more, through the relay
                why = e
                continue
            except (*_BROKEN, BlobProtocolError) as e:
                await self._drop(peer, kept)
                if (reused or isinstance(e, SessionBroken)) and not fresh:
                    fresh = True  # a kept session the provider closed: one more, fresh
                    continue
                raise
            except BaseException:
                await self._drop(peer, kept)
                raise
            self._note_route(peer, used, why)
            await self._done_with(peer, kept)
            return data

    def _relay_beside(self, peer: bytes) -> bool:
        return self.libp2p is not None and self.libp2p.has_path(peer, "relayed")

    def direct_suspected(self, peer: bytes) -> bool:
        """Whether new sessions to `peer` take the relay (its direct path stalled lately)."""
        return _noted_within(self._direct_suspect, peer, trio.current_time(), DIRECT_SUSPECT_SECS)

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

    # kept sessions -----------------------------------------------------------------------------

    async def _take(self, peer: bytes, route: str | None, size: int) -> _Session | None:
        """A kept session of `route`'s kind that takes a fetch of `size` bytes (the least
        loaded), waiting for a side-channel session being opened to `peer`; None: open one."""
        while True:
            now = self._clock()
            best: _Session | None = None
            for kept in list(self._sessions.get(peer, ())):
                idle = kept.session.pending == 0
                expired = idle and now - kept.since >= IDLE_SESSION_SECS
                if expired or kept.session.broken is not None or self._outdated(peer, kept.route):
                    self._forget(peer, kept)
                    if kept.session.pending == 0:
                        self._close_later(kept.session)
                    continue
                if (route == SIDE_CHANNEL) != (kept.route == SIDE_CHANNEL) or not kept.takes(size):
                    continue
                if best is None or kept.session.queued_bytes < best.session.queued_bytes:
                    best = kept
            opening = self._opening.get(peer) if route == SIDE_CHANNEL else None
            if best is not None or opening is None:
                return best
            await opening.wait()

    async def _open_kept(self, route: str | None, provider: EndpointAddr) -> _Session:
        """A new session, kept for `provider`'s next fetches from the start (so concurrent
        fetches join it instead of opening their own)."""
        peer = provider.id
        opening = trio.Event()
        if route == SIDE_CHANNEL:
            self._opening.setdefault(peer, opening)
        try:
            session, used = await self._open(route, provider)
        finally:
            if self._opening.get(peer) is opening:
                del self._opening[peer]
            opening.set()
        kept = _Session(session, used, self._clock())
        self._sessions[peer].append(kept)
        return kept

    def _forget(self, peer: bytes, kept: _Session) -> None:
        sessions = self._sessions.get(peer)
        if sessions is not None and kept in sessions:
            sessions.remove(kept)
            if not sessions:
                del self._sessions[peer]

    async def _done_with(self, peer: bytes, kept: _Session) -> None:
        """After a fetch that left `kept` in step: keep it (idle from now when nothing else is
        on it), at most `MAX_IDLE_SESSIONS_PER_PEER` idle ones per provider."""
        if kept.session.broken is not None:
            await self._drop(peer, kept)
            return
        if kept.session.pending:
            return
        kept.since = self._clock()
        idle = [k for k in self._sessions.get(peer, ()) if k.session.pending == 0]
        for extra in idle[: max(0, len(idle) - MAX_IDLE_SESSIONS_PER_PEER)]:
            self._forget(peer, extra)
            self._close_later(extra.session)

    async def _drop(self, peer: bytes, kept: _Session) -> None:
        """A session no fetch may use again: closed once the last fetch on it is done (closing
        it under a fetch reading from it would fail that fetch for no reason of its own)."""
        if kept.session.broken is None:
            kept.session.broken = "closed after a failed fetch"
        self._forget(peer, kept)
        if kept.session.pending == 0:
            await self._close(kept.session)

    def _outdated(self, peer: bytes, route: str) -> bool:
        """A kept libp2p session on the other path than the one new sessions take: on the
        relay once a (trusted) direct connection is open, on a suspect direct one."""
        if self.libp2p is None or route == SIDE_CHANNEL:
            return False
        if route == LIBP2P_DIRECT:
            return self.direct_suspected(peer)
        return self.libp2p.has_path(peer, "direct") and not self.direct_suspected(peer)

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
                for peer, sessions in list(self._sessions.items()):
                    for kept in list(sessions):
                        if kept.session.pending == 0 and now - kept.since >= IDLE_SESSION_SECS:
                            self._forget(peer, kept)
                            self._closing.append(kept.session)
                await self._close_pending()
        finally:
            for sessions in self._sessions.values():
                self._closing.extend(kept.session for kept in sessions)
            self._sessions.clear()
            await self._close_pending()

    async def _close_pending(self) -> None:
        closing, self._closing = self._closing, []
        for session in closing:
            await self._close(session)

    def idle_sessions(self) -> int:
        return sum(k.session.pending == 0 for s in self._sessions.values() for k in s)


__all__ = [
    "DIRECT_STALL_SECS",
    "LIBP2P_DIRECT",
    "LIBP2P_RELAYED",
    "PIPELINE_BYTES",
    "SIDE_CHANNEL",
    "BlobRoutes",
    "DirectPathStalled",
    "is_relayed_record",
]
