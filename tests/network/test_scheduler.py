"""The download scheduler: upstream's 13 scheduler tests, plus the exact backoff schedule."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from psyche.core.identity import SecretKey
from psyche.network.scheduler import (
    DownloadScheduler,
    RetryConfig,
    RetryQueueResult,
    SchedulerClosed,
)
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr, blob_hash
from psyche.network.transmittable import DownloadType, ModelRequestType

FAST = RetryConfig(backoff_base=0.010, max_distro_retries=3)


def run(test: Callable[[], Awaitable[None]]) -> None:
    trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))


def dummy_ticket(seed: int) -> BlobTicket:
    key = SecretKey.from_bytes(bytes([seed]) * 32)
    return BlobTicket(EndpointAddr(key.public_key, []), BlobFormat.Raw, blob_hash(bytes([seed])), 1)


def param(seed: int) -> DownloadType:
    return DownloadType.ModelSharing(ModelRequestType.Parameter(f"layer.{seed}"))


CONFIG = DownloadType.ModelSharing(ModelRequestType.Config())
DISTRO = DownloadType.DistroResult([])


def test_capacity_grants_up_to_max() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(2)
        await scheduler.wait_for_capacity()
        await scheduler.wait_for_capacity()
        with trio.move_on_after(0.05) as scope:
            await scheduler.wait_for_capacity()
        assert scope.cancelled_caught, "third request should have timed out"
        assert scheduler.active_downloads == 2

    run(main)


def test_release_unblocks_waiter() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(1)
        await scheduler.wait_for_capacity()
        granted = trio.Event()

        async def waiter() -> None:
            await scheduler.wait_for_capacity()
            granted.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.01)
            assert not granted.is_set()
            scheduler.release_capacity()
            with trio.fail_after(0.1):
                await granted.wait()

    run(main)


def test_waiters_are_served_fifo() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(1)
        await scheduler.wait_for_capacity()
        order: list[int] = []

        async def first() -> None:
            await scheduler.wait_for_capacity()
            order.append(1)
            await trio.sleep(0.005)
            scheduler.release_capacity()

        async def second() -> None:
            await scheduler.wait_for_capacity()
            order.append(2)
            scheduler.release_capacity()

        with trio.fail_after(0.2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                await trio.sleep(0.01)
                nursery.start_soon(second)
                await trio.sleep(0.001)
                scheduler.release_capacity()
        assert order == [1, 2]

    run(main)


def test_cancelled_waiter_does_not_take_capacity() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(1)
        await scheduler.wait_for_capacity()
        with trio.move_on_after(0.01):
            await scheduler.wait_for_capacity()
        scheduler.release_capacity()
        assert scheduler.active_downloads == 0
        await scheduler.wait_for_capacity()

    run(main)


def test_model_sharing_retry_respects_capacity() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(1)
        await scheduler.wait_for_capacity()
        assert scheduler.queue_failed_download(dummy_ticket(1), "param-1", param(1)) == (
            RetryQueueResult.Queued
        )
        assert scheduler.start_parameter_retry() is None, "no retry while at capacity"
        scheduler.release_capacity()
        retry = scheduler.start_parameter_retry()
        assert retry is not None
        assert retry.retries == 1
        assert scheduler.active_downloads == 1

    run(main)


def test_parameter_retries_are_immediate() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(2)
        scheduler.queue_failed_download(dummy_ticket(1), "param-1", param(1))
        assert scheduler.start_parameter_retry() is not None

    run(main)


def test_config_retries_dont_consume_capacity() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(1)
        await scheduler.wait_for_capacity()
        scheduler.queue_failed_download(dummy_ticket(2), "config", CONFIG)
        retries = scheduler.get_due_config_retries()
        assert len(retries) == 1
        assert retries[0].download_type == CONFIG
        assert scheduler.active_downloads == 1

    run(main)


def test_distro_retry_not_immediately_due() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(2, FAST)
        assert scheduler.queue_failed_download(dummy_ticket(1), "distro-1", DISTRO) == (
            RetryQueueResult.Queued
        )
        assert scheduler.get_due_distro_retries() == []

    run(main)


def test_distro_retries_returned_and_removed() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(2, FAST)
        t1, t2 = dummy_ticket(1), dummy_ticket(2)
        scheduler.queue_failed_download(t1, "distro-1", DISTRO)
        scheduler.queue_failed_download(t2, "distro-2", DISTRO)
        await trio.sleep(0.05)
        assert len(scheduler.get_due_distro_retries()) == 2
        assert scheduler.get_due_distro_retries() == [], "drained by the first call"
        assert not scheduler.remove_retry(t1.hash)
        assert not scheduler.remove_retry(t2.hash)

    run(main)


def test_distro_retries_dont_consume_capacity() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(1, FAST)
        await scheduler.wait_for_capacity()
        scheduler.queue_failed_download(dummy_ticket(1), "distro-1", DISTRO)
        await trio.sleep(0.05)
        assert len(scheduler.get_due_distro_retries()) == 1

    run(main)


def test_remove_retry() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(2)
        t = dummy_ticket(1)
        scheduler.queue_failed_download(t, "param-1", param(1))
        assert scheduler.remove_retry(t.hash)
        assert not scheduler.remove_retry(t.hash)

    run(main)


def test_distro_max_retries_exceeded() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(2, RetryConfig(backoff_base=0.001, max_distro_retries=2))
        t = dummy_ticket(1)
        assert scheduler.queue_failed_download(t, "d", DISTRO) == RetryQueueResult.Queued
        assert scheduler.queue_failed_download(t, "d", DISTRO) == RetryQueueResult.Queued
        assert scheduler.queue_failed_download(t, "d", DISTRO) == (
            RetryQueueResult.MaxRetriesExceeded
        )
        assert not scheduler.remove_retry(t.hash), "the entry is dropped"

    run(main)


def test_model_sharing_never_exceeds_max_retries() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(10, RetryConfig(backoff_base=0.001, max_distro_retries=1))
        t = dummy_ticket(1)
        for _ in range(10):
            assert scheduler.queue_failed_download(t, "param-1", param(1)) == (
                RetryQueueResult.Queued
            )
            scheduler.start_parameter_retry()

    run(main)


def test_wait_for_capacity_errors_on_shutdown() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(1)
        await scheduler.wait_for_capacity()
        errors: list[Exception] = []

        async def blocked() -> None:
            try:
                await scheduler.wait_for_capacity()
            except SchedulerClosed as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked)
            await trio.sleep(0.01)
            scheduler.close()
        assert len(errors) == 1
        with pytest.raises(SchedulerClosed):
            await scheduler.wait_for_capacity()

    run(main)


def test_distro_backoff_doubles_from_two_seconds() -> None:
    async def main() -> None:
        scheduler = DownloadScheduler(1)  # upstream default: 2 s base, 3 retries
        t = dummy_ticket(7)
        # each failure re-queued before the retry ran: due after 2 s, then 4 s, then 8 s
        for expected_wait in (2.0, 4.0, 8.0):
            assert scheduler.queue_failed_download(t, "d", DISTRO) == RetryQueueResult.Queued
            await trio.sleep(expected_wait - 0.01)
            assert scheduler.get_due_distro_retries() == []
        await trio.sleep(0.02)
        (due,) = scheduler.get_due_distro_retries()
        assert due.retries == 3
        for _ in range(3):
            scheduler.queue_failed_download(t, "d", DISTRO)
        assert scheduler.queue_failed_download(t, "d", DISTRO) == (
            RetryQueueResult.MaxRetriesExceeded
        )

    run(main)
