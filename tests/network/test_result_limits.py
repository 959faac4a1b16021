"""What a download may cost, on two real nodes over loopback (issue 24, item 4): a ticket larger
than the caller's `max_size` (the client passes the largest result its run can produce) fails
at once and for good, no byte fetched; a blob that does not decode fails for good and leaves
the requester's store with its tag at once, unless another tag keeps the same bytes."""

from __future__ import annotations

import os

import trio

from psyche.network.connection import NetworkConnection
from psyche.network.download import DownloadFailed
from psyche.network.testing import introduce, open_nodes, wait_until
from psyche.network.ticket import BlobFormat, BlobTicket, blob_hash
from psyche.network.transmittable import DownloadType

DEADLINE = 30
LIMIT = 64 * 1024


def offer(provider: NetworkConnection, data: bytes) -> BlobTicket:
    """`data` served as it is (not a payload this network encoded): what a hostile member can
    announce."""
    digest = blob_hash(data)
    provider.store.put(digest, data, "offered")
    return BlobTicket(provider.endpoint_addr(), BlobFormat.Raw, digest, len(data))


async def failure(requester: NetworkConnection, ticket: BlobTicket, tag: str) -> DownloadFailed:
    download = requester.start_download(ticket, tag, DownloadType.DistroResult([]), LIMIT)
    with trio.fail_after(DEADLINE):
        outcome = await download.finished()
    assert isinstance(outcome, DownloadFailed), outcome
    return outcome


def test_an_oversized_ticket_fails_at_once_and_for_good() -> None:
    async def main() -> None:
        async with open_nodes(2) as (provider, requester):
            introduce(requester, provider)
            ticket = offer(provider, os.urandom(4 * LIMIT))
            failed = await failure(requester, ticket, "result_1")
            assert failed.permanent
            assert failed.error == f"blob of {4 * LIMIT} bytes exceeds the limit of {LIMIT} bytes"
            assert provider.bytes_served == 0  # not a byte asked for
            assert "result_1" not in requester.store.tags()

    trio.run(main)


def test_an_undecodable_blob_fails_for_good_and_is_not_kept() -> None:
    async def main() -> None:
        async with open_nodes(2) as (provider, requester):
            introduce(requester, provider)
            junk = os.urandom(LIMIT // 2)
            failed = await failure(requester, offer(provider, junk), "result_1")
            assert failed.permanent
            assert failed.error.startswith("undecodable blob")
            await wait_until(lambda: provider.bytes_served == len(junk))  # counted once sent
            assert not requester.store.has(blob_hash(junk))
            assert "result_1" not in requester.store.tags()
            # the same bytes kept under another tag (its own, say) stay whatever a peer names
            kept = os.urandom(LIMIT // 2)
            requester.store.put(blob_hash(kept), kept, "model-a")
            failed = await failure(requester, offer(provider, kept), "result_2")
            assert failed.permanent
            assert requester.store.has(blob_hash(kept))
            assert requester.store.tags() == {"model-a": blob_hash(kept)}

    trio.run(main)
