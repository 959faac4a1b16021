"""A member that announces junk as its result (issue 24, item 4), in a whole in-process run:
`InProcessServer`, three real clients on libp2p over loopback training a tiny Llama, one of
them announcing, in place of each of its payloads, random bytes: in turn far more than any
result of the run can be (the attack used 512 MiB; tickets up to 4 GiB were accepted), and a
blob within that bound that does not decode.

The honest clients refuse the oversized ticket before fetching a byte (its size is over the
largest payload the run's model and compression can produce), download the undecodable blob
once, drop it, and never fetch either again; the run trains on, and the honest clients apply
the same results. Before the fix, every honest client downloaded the oversized blob too, and
retried both for as long as it ran (every 2 s, re-downloading once the tag was gone)."""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import pytest
import trio

from psyche.client.client import Client
from psyche.client.round.train import OwnResult
from psyche.network.ticket import BlobFormat, BlobTicket, blob_hash

from ..timing import scaled
from .in_process import fields, run_client, three_client_run, wait_until

OVERSIZED = 16 * 1024 * 1024
UNDECODABLE = 1024
"""The tiny model's largest result is 4717 bytes (DisTrO, 1-bit values): one is over it, the
other within it."""
HONEST = (1, 2)


class JunkResultClient(Client):
    """Announces random bytes under its real commitment: oversized and undecodable in turn;
    counts the requests for each junk blob its blob provider answers."""

    published: ClassVar[list[tuple[bytes, int]]] = []
    """(hash, size) of every junk blob announced."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: Counter[bytes] = Counter()
        server = self.network.blob_server
        lookup = server.lookup

        def counting(digest: bytes) -> Any:
            if any(digest == junk for junk, _ in self.published):
                self.requests[digest] += 1
            return lookup(digest)

        server.lookup = counting

    async def _publish_result(self, result: OwnResult) -> None:
        size = OVERSIZED if len(self.published) % 2 == 0 else UNDECODABLE
        junk = os.urandom(size)
        digest = blob_hash(junk)
        self.network.store.put(digest, junk, f"distro-result_{result.step}")
        ticket = BlobTicket(self.network.endpoint_addr(), BlobFormat.Raw, digest, size)
        self.published.append((digest, size))
        self._announce_result(result, ticket)  # under the real payload's commitment


def test_junk_results_are_refused_and_never_fetched_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="psyche")
    # the junk member is health-checked out from an epoch's third round and joins again at the
    # next epoch: a short epoch brings its third and fourth junk blobs soon
    server = three_client_run(tmp_path, epoch_time=10)
    JunkResultClient.published = []
    started: list[Client] = []

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            for number in HONEST:
                nursery.start_soon(run_client, server, number, Client, started)
            nursery.start_soon(run_client, server, 3, JunkResultClient, started)
            with trio.fail_after(scaled(240)):
                # two junk blobs of each kind announced, then two rounds more for any retry
                await wait_until(lambda: len(JunkResultClient.published) >= 4)
                step = server.coordinator.progress.step
                await wait_until(lambda: server.coordinator.progress.step >= step + 2)
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    hostile = next(c for c in started if isinstance(c, JunkResultClient))
    honest = [c for c in started if not isinstance(c, JunkResultClient)]
    # nothing oversized was ever asked for; each undecodable blob once by each client at most
    asked = {
        size: [hostile.requests[d] for d, s in JunkResultClient.published if s == size]
        for size in {s for _, s in JunkResultClient.published}
    }
    assert set(asked[OVERSIZED]) == {0}, asked
    assert all(n <= len(HONEST) for sizes in asked.values() for n in sizes), asked
    limits = {int(n) for n in re.findall(r"exceeds the limit of (\d+) bytes", caplog.text)}
    assert len(limits) == 1
    assert UNDECODABLE < limits.pop() < OVERSIZED
    assert "undecodable blob" in caplog.text
    assert "Retrying download for distro result" not in caplog.text
    for client in honest:  # nothing of the junk kept
        assert not any(client.network.store.has(d) for d, _ in JunkResultClient.published)
    # the honest clients trained on and applied the same results at every step
    applied: dict[int, set[tuple[str, ...]]] = {}
    for f in fields(caplog.records, "applied_results"):
        if f["client_id"] != str(hostile.identity):
            applied.setdefault(f["step"], set()).add(tuple(str(b) for b in f["batches"]))
    assert len(applied) >= 2, applied
    assert all(len(v) == 1 for v in applied.values()), applied
