"""Retrying a provider with a linear backoff (upstream's client fetch loop)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from psyche.core.batch_id import BatchId
from psyche.data_provider.types import DataProviderError, TokenizedData, TokenizedDataProvider

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """`max_retries` retries after the first attempt; retry r (1-based) waits `base_delay*(r-1)` s.

    `RetryPolicy()` is upstream's client fetch loop: `MAX_RETRIES = 7`, `BASE_DELAY_MS = 2000`.
    """

    max_retries: int = 7
    base_delay: float = 2.0

    def delay(self, retry: int) -> float:
        return self.base_delay * (retry - 1)


async def get_samples_with_retries(
    provider: TokenizedDataProvider, data_ids: BatchId, policy: RetryPolicy | None = None
) -> list[TokenizedData]:
    """`provider.get_samples`, retried on `DataProviderError` as upstream's client retries it."""
    policy = policy or RetryPolicy()
    retry = 0
    while True:
        try:
            return await provider.get_samples(data_ids)
        except DataProviderError as e:
            if retry >= policy.max_retries:
                raise DataProviderError(
                    f"Data fetch failed for batch_id={data_ids} after {policy.max_retries} "
                    f"retries: {e}"
                ) from e
            retry += 1
            delay = policy.delay(retry)
            log.warning(
                'Data fetch error for batch_id=%s (attempt %d/%d): "%s". Retrying in %.1fs',
                data_ids,
                retry,
                policy.max_retries,
                e,
                delay,
            )
            await trio.sleep(delay)
