"""Fetching a round's assigned batches (upstream `fetch_data.rs`).

`DataFetcher.fetch` starts reading the batches a round assigned to this client from the data
provider, a few ahead of training, and hands them over as `Batch`es (`Batch.from_samples`);
a failed read is retried as upstream does (7 retries, waiting 2 s x (attempt - 1) before each).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from psyche.core.batch_id import BatchId

if TYPE_CHECKING:
    from psyche.data_provider.types import TokenizedData, TokenizedDataProvider
    from psyche.modeling.trainer import Batch

logger = logging.getLogger(__name__)

FETCH_MAX_RETRIES = 7
FETCH_BASE_DELAY_SECS = 2.0


class DataFetcher:
    """Fetches a round's assigned batches in the background, a few ahead (upstream buffer: two
    per data-parallel trainer). A new round's fetch cancels the previous one."""

    def __init__(self, provider: TokenizedDataProvider, nursery: trio.Nursery, buffer: int = 2):
        self.provider = provider
        self._nursery = nursery
        self._buffer = buffer
        self._scope: trio.CancelScope | None = None
        self._running: set[trio.CancelScope] = set()
        self._lock = trio.Lock()
        self._closed = False

    def fetch(
        self, batch_ids: Sequence[BatchId]
    ) -> trio.MemoryReceiveChannel[tuple[BatchId, Batch]]:
        if self._scope is not None:
            self._scope.cancel()
        self._scope = trio.CancelScope()
        return self._start(batch_ids, self._scope)

    def fetch_beside(
        self, batch_ids: Sequence[BatchId]
    ) -> trio.MemoryReceiveChannel[tuple[BatchId, Batch]]:
        """Like `fetch`, but beside the round's fetch, which it neither cancels nor replaces
        (a tie-breaker's disputed batches of the last round, read while its own batches of this
        round are fetched; the provider still serves one request at a time)."""
        return self._start(batch_ids, trio.CancelScope())

    def _start(
        self, batch_ids: Sequence[BatchId], scope: trio.CancelScope
    ) -> trio.MemoryReceiveChannel[tuple[BatchId, Batch]]:
        if self._closed:
            raise trio.ClosedResourceError("the data fetcher is closed")
        send, receive = trio.open_memory_channel[tuple[BatchId, "Batch"]](self._buffer)
        self._running.add(scope)
        self._nursery.start_soon(self._run, list(batch_ids), send, scope)
        return receive

    async def aclose(self) -> None:
        """Stop every fetch and close the provider (the client left the run, or it ended): its
        connection or files are released now, not when the provider is collected, and nothing
        is fetched after it (a fetch would reopen a fallback provider). Idempotent."""
        from psyche.data_provider.factory import aclose_provider

        if self._closed:
            return
        self._closed = True
        for scope in self._running:
            scope.cancel()
        with trio.CancelScope(shield=True):
            async with self._lock:  # a request in flight has ended (cancelled) before the close
                await aclose_provider(self.provider)

    async def _run(
        self,
        batch_ids: list[BatchId],
        send: trio.MemorySendChannel[tuple[BatchId, Batch]],
        scope: trio.CancelScope,
    ) -> None:
        try:
            with scope:
                async with send:
                    await self._send_all(batch_ids, send)
        finally:
            self._running.discard(scope)

    async def _send_all(
        self, batch_ids: list[BatchId], send: trio.MemorySendChannel[tuple[BatchId, Batch]]
    ) -> None:
        from psyche.modeling.trainer import Batch

        while batch_ids:
            batch_id = batch_ids.pop()  # upstream pops from the end
            samples = await self._get_with_retries(batch_id)
            if samples is None:
                return
            try:
                await send.send((batch_id, Batch.from_samples(samples)))
            except trio.BrokenResourceError:
                return  # the round stopped reading (it ended while we fetched)

    async def _get_with_retries(self, batch_id: BatchId) -> list[TokenizedData] | None:
        attempt = 0
        while True:
            try:
                async with self._lock:  # one request at a time, as upstream's mutex
                    return await self.provider.get_samples(batch_id)
            except Exception as e:
                if attempt >= FETCH_MAX_RETRIES:
                    logger.error(
                        "Data fetch failed for batch_id=%s after %d attempts: %s",
                        batch_id,
                        FETCH_MAX_RETRIES,
                        e,
                    )
                    return None
                attempt += 1
                delay = FETCH_BASE_DELAY_SECS * (attempt - 1)
                logger.warning(
                    "Data fetch error for batch_id=%s (attempt %d/%d): %s. Retrying in %.0f ms",
                    batch_id,
                    attempt,
                    FETCH_MAX_RETRIES,
                    e,
                    delay * 1000,
                )
                await trio.sleep(delay)  # the retry's backoff: a timer, not a wait for a condition
