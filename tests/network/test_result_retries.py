"""DisTrO result downloads retry by themselves, on two real nodes over loopback: the network's
`download_result` resolves once, with the result once a retry finds it, or with the failure after
which nothing more is tried (the application no longer wanting it, the network shutting down). Upstream keeps this loop in the client (`client.rs`'s retry arm)."""

from __future__ import annotations

import trio

from psyche.network.connection import NetworkConnection
from psyche.network.download import DownloadComplete, DownloadFailed
from psyche.network.scheduler import RetryConfig
from psyche.network.testing import introduce, open_nodes, wait_until
from psyche.network.ticket import BlobFormat, BlobTicket, blob_hash

DEADLINE = 30
FAST = RetryConfig(backoff_base=0.05)


def announced(provider: NetworkConnection, payload: bytes) -> tuple[BlobTicket, bytes]:
    """A ticket for `payload` on `provider` and its encoded blob, not stored yet: the provider
    announced a result it cannot serve (yet)."""
    encoded = provider.codec.encode(payload)
    digest = blob_hash(encoded)
    return BlobTicket(provider.endpoint_addr(), BlobFormat.Raw, digest, len(encoded)), encoded


def attempts(requester: NetworkConnection, ticket: BlobTicket) -> int:
    return sum(digest == ticket.hash for digest, _, _ in requester.downloader.provider_failures)


def test_a_result_missing_at_first_arrives_by_a_retry() -> None:
    async def main() -> None:
        async with open_nodes(2) as (provider, requester):
            introduce(requester, provider)
            ticket, encoded = announced(provider, b"the result")
            asked: list[bytes] = []

            def wanted(digest: bytes) -> bool:
                asked.append(digest)
                return True

            download = requester.download_result(
                ticket, "distro-result_1", providers=list, wanted=wanted
            )
            await wait_until(lambda: attempts(requester, ticket) == 1, DEADLINE)
            assert not download.done, "a failed attempt is retried, not reported"
            provider.store.put(ticket.hash, encoded, "offered")
            with trio.fail_after(DEADLINE):
                outcome = await download.finished()
            assert isinstance(outcome, DownloadComplete), outcome
            assert bytes(outcome.data) == b"the result"
            assert asked == [ticket.hash], "asked once, before the retry"
            assert attempts(requester, ticket) == 1

    trio.run(main)


def test_a_result_is_retried_while_it_is_wanted() -> None:
    """Upstream's scheduler drains a retry when it is due, so its count starts again at each
    failure: a result is retried every `backoff_base` for as long as the application wants it
    (its round waits for it), and not once more."""

    async def main() -> None:
        async with open_nodes(2) as (provider, requester):
            introduce(requester, provider)
            requester.result_downloads.scheduler.retry_config = FAST
            requester.result_downloads.check_secs = 0.05
            ticket, _ = announced(provider, b"never served")
            answers = iter([True, True, True, False])
            download = requester.download_result(
                ticket, "distro-result_1", providers=list, wanted=lambda _: next(answers)
            )
            with trio.fail_after(DEADLINE):
                outcome = await download.finished()
            assert isinstance(outcome, DownloadFailed), outcome
            assert outcome.error == "no longer wanted"
            assert not outcome.permanent
            assert attempts(requester, ticket) == 4, "the first attempt and three retries"

    trio.run(main)


def test_a_download_waiting_for_its_retry_fails_when_the_network_shuts_down() -> None:
    async def main() -> None:
        async with open_nodes(2) as (provider, requester):
            introduce(requester, provider)
            ticket, _ = announced(provider, b"never served")
            download = requester.download_result(ticket, "distro-result_1", providers=list)
            await wait_until(lambda: attempts(requester, ticket) == 1, DEADLINE)
        assert download.done
        with trio.fail_after(1):
            outcome = await download.finished()
        assert isinstance(outcome, DownloadFailed), outcome
        assert outcome.error == "the network shut down first"

    trio.run(main)
