"""The downloader's limits and fairness (upstream's later fixes, issue 16): each attempt's
timeout scales with the blob's size, providers are retried in rounds with a doubling backoff
while their failures are transient, and a round of permanent failures (the blob is missing,
the bytes are corrupt) ends the download at once. The real `Downloader` on trio's virtual
clock, with a transport whose providers fail as each test says."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import trio
import trio.testing

from psyche.core.identity import SecretKey
from psyche.network.blob_protocol import BlobNotFound
from psyche.network.blob_store import BlobStore
from psyche.network.connection_monitor import ConnectionMonitor
from psyche.network.download import (
    ATTEMPT_BASE_SECS,
    PROVIDER_ROUNDS,
    ROUND_BACKOFF_SECS,
    Downloader,
    DownloadError,
    PartComplete,
    ProviderFailed,
    attempt_timeout,
)
from psyche.network.latency_sorted import LatencySorted
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr, TransportAddr, blob_hash

DATA = b"x" * 3 * (1 << 20)
DIGEST = blob_hash(DATA)

Behaviour = Callable[[int], object]
"""What a provider does on its n-th attempt (from 0): return bytes, raise, or hang."""


class Transport:
    """Providers by id, each failing as told; records (virtual time, provider) per attempt."""

    def __init__(self, behaviours: dict[bytes, Behaviour]) -> None:
        self.behaviours = behaviours
        self.attempts: list[tuple[float, bytes]] = []

    def can_reach(self, addr: EndpointAddr) -> bool:
        return True

    async def fetch(self, provider: EndpointAddr, digest: bytes, size: int, on_progress) -> bytes:  # type: ignore[no-untyped-def]
        n = sum(1 for _, p in self.attempts if p == provider.id)
        self.attempts.append((trio.current_time(), provider.id))
        outcome = self.behaviours[provider.id](n)
        if outcome == "hang":
            await trio.sleep_forever()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome  # type: ignore[return-value]


def addr(peer: bytes) -> EndpointAddr:
    return EndpointAddr(peer, [TransportAddr.Libp2p("/ip4/198.18.0.2/tcp/1")])


def download(behaviours: dict[bytes, Behaviour]) -> tuple[list[object], Transport, float]:
    """Run one download of `DATA` on a virtual clock; (items emitted, transport, time taken)."""
    peers = list(behaviours)
    transport = Transport(behaviours)
    store = BlobStore()
    downloader = Downloader(store, transport, addr, lambda peer: True)
    ticket = BlobTicket(addr(peers[0]), BlobFormat.Raw, DIGEST, len(DATA))
    items: list[object] = []

    async def main() -> float:
        start = trio.current_time()
        providers = LatencySorted(peers, ConnectionMonitor())
        await downloader.download(ticket, providers, items.append)
        return trio.current_time() - start

    took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return items, transport, took


def peers(n: int) -> list[bytes]:
    return [SecretKey.generate().public_key for _ in range(n)]


def test_attempt_timeouts_scale_with_the_blob_size() -> None:
    assert attempt_timeout(0) == ATTEMPT_BASE_SECS
    assert attempt_timeout(100 << 20) == pytest.approx(ATTEMPT_BASE_SECS + 100)
    # a provider that never sends is given up on after exactly its blob's timeout, and the
    # next provider serves the blob
    slow, good = peers(2)
    items, transport, _ = download({slow: lambda n: "hang", good: lambda n: DATA})
    assert isinstance(items[-1], PartComplete)
    (t0, first), (t1, second) = transport.attempts
    assert (first, second) == (slow, good)
    assert t1 - t0 == pytest.approx(attempt_timeout(len(DATA)))


def test_transient_failures_are_retried_in_rounds_with_a_doubling_backoff() -> None:
    a, b = peers(2)
    items, transport, _ = download(
        {
            a: lambda n: OSError("connection refused") if n < PROVIDER_ROUNDS - 1 else DATA,
            b: lambda n: OSError("no route to host"),
        }
    )
    assert isinstance(items[-1], PartComplete)
    # every provider tried in each round, the rounds apart by 1 s, then 2 s
    assert [p for _, p in transport.attempts] == [a, b, a, b, a]
    starts = [t for t, p in transport.attempts if p == a]
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert gaps == pytest.approx([ROUND_BACKOFF_SECS, 2 * ROUND_BACKOFF_SECS])


def test_rounds_are_bounded_and_permanent_failures_end_the_download_at_once() -> None:
    a, b = peers(2)
    items, transport, _ = download({a: lambda n: OSError("refused"), b: lambda n: OSError("x")})
    assert isinstance(items[-1], DownloadError)
    assert len(transport.attempts) == 2 * PROVIDER_ROUNDS
    # a blob nobody has is not retried
    items, transport, took = download(
        {a: lambda n: BlobNotFound("no such blob"), b: lambda n: BlobNotFound("no such blob")}
    )
    assert isinstance(items[-1], DownloadError)
    assert len(transport.attempts) == 2
    assert took == 0
    assert sum(isinstance(i, ProviderFailed) for i in items) == 2
