"""DisTrO result downloads that retry themselves (upstream: the client loop's retry arm over the
`DownloadScheduler`, checked every `DOWNLOAD_RETRY_CHECK_INTERVAL`).

`ResultDownloads.start` returns one `Download` that resolves exactly once with the final outcome:
the decoded result, or the failure after which nothing more is tried. A failed attempt is queued
in the scheduler (`queue_failed_download`) unless it is `permanent` (the blob can never be used:
it is not fetched again), and started again once due. The scheduler drains a retry when it is
due, so its count starts again at each failure: as upstream, a result is retried every
`backoff_base` (2 s) for as long as the application wants it (`wanted`, asked before each retry:
false once the result's round is over), and `max_distro_retries` bounds only failures queued
again before their retry ran. Each attempt fetches from the ticket's provider, then from
`providers()`, asked anew each time (upstream lists the run's other members again, shuffled).
Whatever waits or is under way when the network shuts down resolves as failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from psyche.network.download import Download, DownloadComplete, DownloadOutcome
from psyche.network.download_manager import SpawnFn
from psyche.network.scheduler import DownloadScheduler, RetryQueueResult
from psyche.network.ticket import BlobTicket
from psyche.network.transmittable import DownloadType

logger = logging.getLogger(__name__)

DOWNLOAD_RETRY_CHECK_SECS = 1.0
"""Upstream's `DOWNLOAD_RETRY_CHECK_INTERVAL`: how often due retries are started."""

StartFn = Callable[[BlobTicket, str, DownloadType, int | None], Download]
"""`NetworkConnection.start_download`: one attempt."""
ProvidersFn = Callable[[], list[bytes]]
"""The peers besides the ticket's provider that may hold the blob, asked at each attempt."""
WantedFn = Callable[[bytes], bool]
"""Whether the application still wants the blob of this hash (asked before each retry)."""


@dataclass
class _Job:
    download: Download
    """What the application awaits: the final outcome."""
    providers: ProvidersFn
    max_size: int | None
    wanted: WantedFn


class ResultDownloads:
    def __init__(self, start: StartFn, spawn: SpawnFn) -> None:
        self.scheduler = DownloadScheduler()
        """Upstream's retry rules (`RetryConfig`: 2 s backoff base)."""
        self._start = start
        self._spawn = spawn
        self.check_secs = DOWNLOAD_RETRY_CHECK_SECS
        self._waiting: dict[bytes, list[_Job]] = {}
        """Jobs whose last attempt failed, by blob hash, until the scheduler says they are due."""

    def start(
        self,
        ticket: BlobTicket,
        tag: str,
        *,
        providers: ProvidersFn,
        max_size: int | None = None,
        wanted: WantedFn | None = None,
    ) -> Download:
        """Fetch a DisTrO result's blob, retrying as the module says; the `Download` resolves
        with `DownloadComplete` or the last `DownloadFailed`. `max_size` as `start_download`'s."""
        others = providers()
        job = _Job(
            Download(ticket, tag, DownloadType.DistroResult(others)),
            providers,
            max_size,
            wanted or (lambda _: True),
        )
        self._attempt(job, others)
        return job.download

    def _attempt(self, job: _Job, others: list[bytes]) -> None:
        ticket, tag = job.download.ticket, job.download.tag
        attempt = self._start(ticket, tag, DownloadType.DistroResult(others), job.max_size)
        if not self._spawn(self._follow, job, attempt):
            job.download.finish(job.download.failure("the network is shut down"))

    async def _follow(self, job: _Job, attempt: Download) -> None:
        outcome: DownloadOutcome | None = None
        try:
            outcome = await attempt.finished()
        finally:
            if outcome is None:  # cancelled: the network is shutting down
                job.download.finish(job.download.failure("the network shut down first"))
        self._settle(job, outcome)

    def _settle(self, job: _Job, outcome: DownloadOutcome) -> None:
        download = job.download
        digest = download.ticket.hash
        if isinstance(outcome, DownloadComplete) or outcome.permanent:
            self.scheduler.remove_retry(digest)
            download.finish(outcome)
            # another download of this blob waiting for its retry has nothing left to do
            for other in self._waiting.pop(digest, []):
                other.download.finish(other.download.failure("another download of it ended"))
            return
        queued = self.scheduler.queue_failed_download(
            download.ticket, download.tag, download.download_type
        )
        if queued != RetryQueueResult.Queued:
            logger.warning("Distro result download failed (not retrying): %s", outcome.error)
            download.finish(outcome)
            return
        logger.info("Distro result download failed (will retry): %s", outcome.error)
        self._waiting.setdefault(digest, []).append(job)

    async def run(self) -> None:
        """Start the due retries every `check_secs` (until cancelled, then `close`)."""
        try:
            while True:
                await trio.sleep(self.check_secs)
                self._start_due()
        finally:
            self.close()

    def _start_due(self) -> None:
        for retry in self.scheduler.get_due_distro_retries():
            for job in self._waiting.pop(retry.hash, []):
                if not job.wanted(retry.hash):  # its round is over (or it was refused)
                    job.download.finish(job.download.failure("no longer wanted"))
                    continue
                logger.info("Retrying download for distro result (attempt %d)", retry.retries)
                self._attempt(job, job.providers())

    def close(self) -> None:
        """Retry nothing more: what waits for a retry fails now, later failures at once."""
        self.scheduler.close()
        waiting, self._waiting = self._waiting, {}
        for jobs in waiting.values():
            for job in jobs:
                job.download.finish(job.download.failure("the network shut down first"))
