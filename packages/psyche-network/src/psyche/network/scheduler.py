"""Download capacity and retry bookkeeping (upstream download/scheduler.rs, same rules).

Upstream runs this as an actor task; on one trio loop a plain object with the same operations
is enough: `wait_for_capacity` is the only call that waits, and its waiters are served FIFO.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from psyche.network.ticket import BlobTicket
from psyche.network.transmittable import DownloadType, ModelRequestType

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENT_PARAMETER_REQUESTS = 8


@dataclass(frozen=True)
class RetryConfig:
    backoff_base: float = 2.0
    max_distro_retries: int = 3


class RetryQueueResult:
    Queued = "queued"
    MaxRetriesExceeded = "max_retries_exceeded"


@dataclass(frozen=True)
class ReadyRetry:
    hash: bytes
    ticket: BlobTicket
    tag: str
    download_type: DownloadType
    retries: int


@dataclass
class _RetryEntry:
    retries: int
    retry_time: float | None
    ticket: BlobTicket
    tag: str
    download_type: DownloadType

    def ready(self, digest: bytes) -> ReadyRetry:
        return ReadyRetry(digest, self.ticket, self.tag, self.download_type, self.retries)


class SchedulerClosed(RuntimeError):
    """Upstream: "Download scheduler actor has shut down"."""


class _Waiter:
    __slots__ = ("event", "gone", "granted")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.granted = False
        self.gone = False


class DownloadScheduler:
    def __init__(
        self,
        max_concurrent_downloads: int = DEFAULT_MAX_CONCURRENT_PARAMETER_REQUESTS,
        retry_config: RetryConfig | None = None,
        *,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.max_concurrent = max_concurrent_downloads
        self.retry_config = retry_config or RetryConfig()
        self.active_downloads = 0
        self._waiting: deque[_Waiter] = deque()
        self._retries: dict[bytes, _RetryEntry] = {}
        self._clock = clock
        self._closed = False

    # capacity ----------------------------------------------------------------------------------

    async def wait_for_capacity(self) -> None:
        if self._closed:
            raise SchedulerClosed("Download scheduler has shut down")
        if self.active_downloads < self.max_concurrent:
            self.active_downloads += 1
            return
        waiter = _Waiter()
        self._waiting.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                # Granted while being cancelled: hand the slot on instead of leaking it.
                self.release_capacity()
            waiter.gone = True
            raise
        if not waiter.granted:
            raise SchedulerClosed("Download scheduler shut down before granting capacity")

    def release_capacity(self) -> None:
        self.active_downloads = max(0, self.active_downloads - 1)
        while self._waiting:
            waiter = self._waiting.popleft()
            if waiter.gone:
                continue
            waiter.granted = True
            self.active_downloads += 1
            waiter.event.set()
            logger.info(
                "Granted capacity to waiting requester (%d/%d active)",
                self.active_downloads,
                self.max_concurrent,
            )
            return

    def close(self) -> None:
        self._closed = True
        while self._waiting:
            self._waiting.popleft().event.set()

    # retries -----------------------------------------------------------------------------------

    def queue_failed_download(
        self, ticket: BlobTicket, tag: str, download_type: DownloadType
    ) -> str:
        if self._closed:
            return RetryQueueResult.MaxRetriesExceeded
        digest = ticket.hash
        previous = self._retries[digest].retries if digest in self._retries else 0
        if isinstance(download_type, DownloadType.ModelSharing):
            self._retries[digest] = _RetryEntry(previous + 1, None, ticket, tag, download_type)
            return RetryQueueResult.Queued
        retries = previous + 1
        if retries > self.retry_config.max_distro_retries:
            self._retries.pop(digest, None)
            return RetryQueueResult.MaxRetriesExceeded
        backoff = self.retry_config.backoff_base * (2.0**previous)
        self._retries[digest] = _RetryEntry(
            retries, self._clock() + backoff, ticket, tag, download_type
        )
        return RetryQueueResult.Queued

    def remove_retry(self, digest: bytes) -> bool:
        return self._retries.pop(digest, None) is not None

    def start_parameter_retry(self) -> ReadyRetry | None:
        if self._closed or self.active_downloads >= self.max_concurrent:
            return None
        now = self._clock()
        for digest, entry in self._retries.items():
            if (
                isinstance(entry.download_type, DownloadType.ModelSharing)
                and isinstance(entry.download_type.value, ModelRequestType.Parameter)
                and (entry.retry_time is None or now >= entry.retry_time)
            ):
                self.active_downloads += 1
                del self._retries[digest]
                return entry.ready(digest)
        return None

    def get_due_config_retries(self) -> list[ReadyRetry]:
        return self._drain(
            lambda e: (
                isinstance(e.download_type, DownloadType.ModelSharing)
                and isinstance(e.download_type.value, ModelRequestType.Config)
            )
        )

    def get_due_distro_retries(self) -> list[ReadyRetry]:
        now = self._clock()
        return self._drain(
            lambda e: (
                isinstance(e.download_type, DownloadType.DistroResult)
                and e.retry_time is not None
                and now >= e.retry_time
            )
        )

    def _drain(self, predicate: Callable[[_RetryEntry], bool]) -> list[ReadyRetry]:
        due = [digest for digest, entry in self._retries.items() if predicate(entry)]
        return [self._retries.pop(digest).ready(digest) for digest in due]
