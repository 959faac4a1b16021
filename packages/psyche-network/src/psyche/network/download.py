"""Fetching one blob from the peers that may have it, and what the application hears about it.

`Downloader.download` is the iroh-blobs downloader as upstream uses it: try each provider in
`LatencySorted` order, report progress items, verify the bytes against the ticket's hash, keep
them in the store (so they are served onward) and complete, or fail once no provider is left.
Limits as upstream's later fixes: each attempt has a timeout that scales with the blob's size
(`attempt_timeout`), and when every provider failed for a transient reason (unreachable, timed
out, connection lost) the round is retried, up to `PROVIDER_ROUNDS` rounds with a backoff that
doubles (`ROUND_BACKOFF_SECS`); a provider that lacks the blob or sends corrupted bytes is not
what a retry fixes, so a round in which every failure was of that kind ends the download.
`track_progress` is upstream's `DownloadManager` mapping from progress items to updates.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.network.stream.exceptions import StreamError

from psyche.network.blob_protocol import BlobNotFound, BlobProtocolError, HashMismatch
from psyche.network.blob_store import BlobStore
from psyche.network.blob_transport import BlobTransport
from psyche.network.identity import fmt_short
from psyche.network.latency_sorted import LatencySorted
from psyche.network.ticket import BlobTicket, EndpointAddr
from psyche.network.transmittable import DownloadType

logger = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT_SECS = 600.0
"""Upstream's per-download limit (its log message says "5 minutes"; the constant is 600 s)."""


# ----------------------------------------------------------------------------------------------
# Progress items (iroh-blobs `DownloadProgressItem`)


@dataclass(frozen=True)
class TryProvider:
    id: bytes


@dataclass(frozen=True)
class Progress:
    offset: int


@dataclass(frozen=True)
class PartComplete:
    pass


@dataclass(frozen=True)
class ProviderFailed:
    id: bytes
    reason: str


@dataclass(frozen=True)
class DownloadError:
    pass


@dataclass(frozen=True)
class ProgressError:
    message: str


ProgressItem = (
    TryProvider | Progress | PartComplete | ProviderFailed | DownloadError | ProgressError
)


# ----------------------------------------------------------------------------------------------
# What the network reports


@dataclass(frozen=True)
class DownloadUpdate:
    blob_ticket: BlobTicket
    tag: str
    downloaded_size_delta: int
    downloaded_size: int
    total_size: int
    all_done: bool
    download_type: DownloadType


@dataclass(frozen=True)
class DownloadComplete:
    hash: bytes
    from_: bytes
    """The ticket's provider (as upstream), even when another peer served the bytes."""
    data: Any
    """The decoded payload; its `bytes` fields are read-only memoryviews into the verified blob
    (`DownloadCodec.decode`): no copy of the payload is made."""


@dataclass(frozen=True)
class DownloadFailed:
    blob_ticket: BlobTicket
    tag: str
    error: str
    download_type: DownloadType
    permanent: bool = False
    """The blob itself is refused (larger than allowed, or undecodable): the same hash can never
    succeed, so it must not be fetched again (a port addition: upstream retries any failure)."""


DownloadOutcome = DownloadComplete | DownloadFailed


class Download:
    """One started download, resolved exactly once with its outcome.

    Upstream reports outcomes on the network's event stream and the application matches them to
    its downloads by hash; here whoever started a download awaits `finished()`, so nothing polls
    and nothing is dispatched by hash. Every download resolves: the network fails the ones it
    cannot finish, even when it shuts down.
    """

    __slots__ = ("_event", "_outcome", "download_type", "tag", "ticket")

    def __init__(self, ticket: BlobTicket, tag: str, download_type: DownloadType) -> None:
        self.ticket = ticket
        self.tag = tag
        self.download_type = download_type
        self._event = trio.Event()
        self._outcome: DownloadOutcome | None = None

    @property
    def done(self) -> bool:
        return self._outcome is not None

    def finish(self, outcome: DownloadOutcome) -> None:
        """Resolve the download; only the first outcome counts."""
        if self._outcome is None:
            self._outcome = outcome
            self._event.set()

    def failure(self, error: str, *, permanent: bool = False) -> DownloadFailed:
        return DownloadFailed(self.ticket, self.tag, error, self.download_type, permanent)

    async def finished(self) -> DownloadOutcome:
        await self._event.wait()
        assert self._outcome is not None
        return self._outcome


@dataclass
class DownloadState:
    blob_ticket: BlobTicket
    tag: str
    download_type: DownloadType
    last_offset: int = 0


def track_progress(state: DownloadState, item: ProgressItem) -> DownloadUpdate | DownloadFailed:
    """Upstream `handle_download_progress`: one progress item in, one update or failure out."""
    ticket, tag, kind = state.blob_ticket, state.tag, state.download_type
    match item:
        case TryProvider():
            return DownloadUpdate(ticket, tag, 0, 0, ticket.size, False, kind)
        case Progress(offset):
            delta = max(0, offset - state.last_offset)
            state.last_offset = offset
            return DownloadUpdate(ticket, tag, delta, offset, ticket.size, False, kind)
        case PartComplete():
            return DownloadUpdate(ticket, tag, 0, state.last_offset, ticket.size, True, kind)
        case ProviderFailed():
            return DownloadUpdate(ticket, tag, 0, state.last_offset, ticket.size, False, kind)
        case DownloadError():
            return DownloadFailed(ticket, tag, "Download error", kind)
        case ProgressError(message):
            return DownloadFailed(ticket, tag, message, kind)
    raise TypeError(f"unknown progress item {item!r}")


# ----------------------------------------------------------------------------------------------
# The downloader


ResolveFn = Callable[[bytes], EndpointAddr | None]
AllowFn = Callable[[bytes], bool]
EmitFn = Callable[[ProgressItem], None]

PROGRESS_REPORT_BYTES = 1 << 20
ATTEMPT_BASE_SECS = 10.0
ATTEMPT_MIN_BYTES_PER_SEC = 1 << 20
PROVIDER_ROUNDS = 3
ROUND_BACKOFF_SECS = 1.0


def attempt_timeout(size: int) -> float:
    """How long one provider may take for a blob of `size` bytes: 10 s, plus one second per
    MiB (a path slower than 1 MiB/s is treated as broken and the next provider tried)."""
    return ATTEMPT_BASE_SECS + size / ATTEMPT_MIN_BYTES_PER_SEC


class Downloader:
    def __init__(
        self, store: BlobStore, transport: BlobTransport, resolve: ResolveFn, allowed: AllowFn
    ) -> None:
        self._store = store
        self._transport = transport
        self._resolve = resolve
        self._allowed = allowed
        self.provider_failures: deque[tuple[bytes, bytes, str]] = deque(maxlen=256)
        """Recent (blob hash, provider, reason) failures, newest last."""

    async def download(self, ticket: BlobTicket, providers: LatencySorted, emit: EmitFn) -> None:
        """Emit progress items until `PartComplete` or `DownloadError`."""
        digest = ticket.hash
        if self._store.has(digest):
            emit(PartComplete())
            return
        for round_ in range(PROVIDER_ROUNDS):
            if round_:
                await trio.sleep(ROUND_BACKOFF_SECS * 2 ** (round_ - 1))
                if self._store.has(digest):  # another download of the same blob finished
                    emit(PartComplete())
                    return
            transient = False
            for peer in providers.find_providers():
                emit(TryProvider(peer))
                addr = ticket.addr if peer == ticket.addr.id else self._resolve(peer)
                reason = self._unusable(peer, addr)
                if reason is None and addr is not None:
                    reason, retry = await self._try(addr, ticket, emit)
                    if reason is None:
                        emit(PartComplete())
                        return
                    transient = transient or retry
                reason = reason or "no address"
                logger.debug("provider %s failed for %s: %s", fmt_short(peer), ticket, reason)
                self.provider_failures.append((digest, peer, reason))
                emit(ProviderFailed(peer, reason))
            if not transient:
                break
        emit(DownloadError())

    def _unusable(self, peer: bytes, addr: EndpointAddr | None) -> str | None:
        if not self._allowed(peer):
            return "not in allowlist"
        if addr is None:
            return "no known address"
        if not self._transport.can_reach(addr):
            return "no address the blob transport can use"
        return None

    async def _try(
        self, addr: EndpointAddr, ticket: BlobTicket, emit: EmitFn
    ) -> tuple[str | None, bool]:
        """(None, _) once the blob is stored, else (why not, whether a retry may help)."""
        reported = 0

        def on_progress(received: int) -> None:
            nonlocal reported
            if received - reported >= PROGRESS_REPORT_BYTES or received == ticket.size:
                reported = received
                emit(Progress(received))

        try:
            with trio.fail_after(attempt_timeout(ticket.size)):
                data = await self._transport.fetch(addr, ticket.hash, ticket.size, on_progress)
        except HashMismatch as e:
            logger.warning("provider %s sent corrupted bytes: %s", fmt_short(addr.id), e)
            return f"corrupted data: {e}", False
        except BlobNotFound as e:
            return str(e), False
        except (
            BlobProtocolError,
            OSError,
            trio.TooSlowError,
            trio.BrokenResourceError,
            StreamError,
        ) as e:
            return str(e) or type(e).__name__, True
        except Exception as e:  # a hostile provider must never take the downloader down
            logger.warning("unexpected error fetching from %s: %r", fmt_short(addr.id), e)
            return f"unexpected error: {e!r}", False
        self._store.put(ticket.hash, data)
        return None, False
