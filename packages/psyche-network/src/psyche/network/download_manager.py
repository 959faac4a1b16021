"""Each started download run to its one outcome (upstream `DownloadManager`).

`DownloadManager.start` fetches a ticket's blob in the background and returns its `Download`,
which resolves exactly once: `DownloadComplete` with the decoded payload, or `DownloadFailed`
(blob over the size limit, every provider failed, timed out, undecodable, or the network shut
down first). On the way, progress feeds the peers' bandwidth figures and the stats' download list.

A blob larger than the download's limit (`max_size`, e.g. the largest result the run's model
can produce, else the network's `max_blob_size`) is refused before a byte is fetched, and a
blob that does not decode loses the download's tag and leaves the store at once (unless
another tag keeps it); both failures are `permanent`: the hash names bytes this download can
never use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from psyche.network.blob_store import BlobStore
from psyche.network.connection_monitor import ConnectionMonitor
from psyche.network.download import (
    Download,
    DownloadComplete,
    Downloader,
    DownloadFailed,
    DownloadOutcome,
    DownloadState,
    DownloadUpdate,
    ProgressItem,
    track_progress,
)
from psyche.network.latency_sorted import LatencySorted
from psyche.network.stats import BandwidthTracker, DownloadProgress, NetworkStats, PeerBandwidth
from psyche.network.ticket import BlobTicket
from psyche.network.transmittable import DownloadCodec, DownloadType

logger = logging.getLogger(__name__)

INLINE_WORK_BYTES = 1 << 20
"""Blobs smaller than this are hashed and decoded on the event loop, larger ones in a thread."""

SpawnFn = Callable[..., bool]
"""Start `fn(*args)` in the network's nursery; False once the network has shut down."""


class DownloadManager:
    def __init__(
        self,
        store: BlobStore,
        downloader: Downloader,
        codec: DownloadCodec,
        connection_monitor: ConnectionMonitor,
        bandwidth_tracker: BandwidthTracker,
        stats: NetworkStats,
        spawn: SpawnFn,
        *,
        max_blob_size: int,
        timeout_secs: float,
    ) -> None:
        self._store = store
        self._downloader = downloader
        self._codec = codec
        self._monitor = connection_monitor
        self._bandwidth = bandwidth_tracker
        self._stats = stats
        self._spawn = spawn
        self.max_blob_size = max_blob_size
        self.timeout_secs = timeout_secs

    def start(
        self,
        ticket: BlobTicket,
        tag: str,
        download_type: DownloadType,
        max_size: int | None = None,
    ) -> Download:
        """`max_size`: the largest blob this download may fetch (at most `max_blob_size`)."""
        download = Download(ticket, tag, download_type)
        limit = self.max_blob_size if max_size is None else min(max_size, self.max_blob_size)
        if not self._spawn(self._run, download, limit):
            download.finish(download.failure("the network is shut down"))
        return download

    async def _run(self, download: Download, limit: int) -> None:
        try:
            download.finish(await self._fetch(download, limit))
        finally:
            if not download.done:  # cancelled: the network is shutting down
                download.finish(download.failure("the network shut down first"))

    async def _fetch(self, download: Download, limit: int) -> DownloadOutcome:
        ticket = download.ticket
        if ticket.size > limit:
            self._store.release(download.tag, ticket.hash)
            error = f"blob of {ticket.size} bytes exceeds the limit of {limit} bytes"
            return self._failed(download.failure(error, permanent=True))
        extra = (
            download.download_type.value
            if isinstance(download.download_type, DownloadType.DistroResult)
            else []
        )
        providers = LatencySorted([ticket.addr.id, *extra], self._monitor)
        state = DownloadState(ticket, download.tag, download.download_type)
        last: DownloadUpdate | DownloadFailed | None = None

        def emit(item: ProgressItem) -> None:
            nonlocal last
            if last is None or not _final(last):
                last = track_progress(state, item)
                if isinstance(last, DownloadUpdate):
                    self._on_progress(last)

        with trio.move_on_after(self.timeout_secs):
            await self._downloader.download(ticket, providers, emit)
        if last is None or not _final(last):
            timeout = f"Download timed out after {self.timeout_secs:g} s"
            return self._failed(download.failure(timeout))
        if isinstance(last, DownloadFailed):
            return self._failed(last)
        return await self._decode(download)

    def _on_progress(self, update: DownloadUpdate) -> None:
        provider = update.blob_ticket.addr.id
        digest = update.blob_ticket.hash
        self._bandwidth.add_event(provider, update.downloaded_size_delta)
        self._monitor.update_peer_bandwidth(provider, self._bandwidth.get_peer_bandwidth(provider))
        if update.all_done:
            self._stats.download_progresses.pop(digest, None)
        else:
            self._stats.download_progresses[digest] = DownloadProgress(
                update.downloaded_size, update.total_size
            )

    def _failed(self, failed: DownloadFailed) -> DownloadFailed:
        self._stats.download_progresses.pop(failed.blob_ticket.hash, None)
        self._monitor.update_peer_bandwidth(failed.blob_ticket.addr.id, PeerBandwidth.Measured(0.0))
        logger.warning("download of %s failed: %s", failed.blob_ticket, failed.error)
        return failed

    async def _decode(self, download: Download) -> DownloadOutcome:
        ticket = download.ticket
        blob = self._store.get(ticket.hash)
        if blob is None:
            return download.failure("blob vanished from the store")
        try:
            # No copy of the payload: its `bytes` fields are views into the verified blob.
            if len(blob) < INLINE_WORK_BYTES:
                data = self._codec.decode(blob)
            else:
                data = await trio.to_thread.run_sync(self._codec.decode, blob)
        except Exception as e:  # PostcardError, or anything a hostile payload provokes
            self._store.release(download.tag, ticket.hash)  # unusable: not kept, not served
            return download.failure(f"undecodable blob: {e}", permanent=True)
        return DownloadComplete(ticket.hash, ticket.addr.id, data)


def _final(event: DownloadUpdate | DownloadFailed) -> bool:
    return isinstance(event, DownloadFailed) or event.all_done
