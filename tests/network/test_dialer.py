"""Paced dials (`psyche.network.dialer`): one dial per peer, a few at once, failures backed off,
the timeout sized from measured set-ups; and a node's background top-up dials once per peer."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from psyche.core.identity import SecretKey
from psyche.network.connection import JOINS_UNDER_WAY_MAX
from psyche.network.dialer import (
    BACKOFF_BASE_SECS,
    BACKOFF_MAX_SECS,
    TIMEOUT_HEADROOM,
    TIMEOUT_MAX_FACTOR,
    Dialer,
    DialPacing,
    MeasuredTimeout,
)
from psyche.network.testing import introduce, open_nodes, wait_until
from psyche.network.ticket import EndpointAddr, TransportAddr

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def test_the_timeout_is_sized_from_measured_set_ups_within_bounds() -> None:
    pacing = DialPacing(MeasuredTimeout(5.0))
    assert pacing.timeout() == 5.0  # nothing measured yet
    for secs in (0.1, 0.2, 0.3):
        pacing.succeeded(A, secs)
    assert pacing.timeout() == 5.0  # fast set-ups never shorten the configured timeout
    for secs in (2.0, 2.0, 2.0, 2.0):
        pacing.succeeded(A, secs)
    assert pacing.timeout() == TIMEOUT_HEADROOM * 2.0  # slow ones lengthen it
    for secs in (100.0,) * 8:
        pacing.succeeded(A, secs)
    assert pacing.timeout() == TIMEOUT_MAX_FACTOR * 5.0


def test_timed_out_dials_lengthen_the_timeout() -> None:
    """Where no set-up finishes within the configured timeout, the timeout must grow: cutting
    every attempt short at the same 5 s is what kept 32 loaded nodes from connecting."""
    pacing = DialPacing(MeasuredTimeout(5.0))
    for _ in range(3):
        pacing.failed(A, 0.0, timed_out_after=pacing.timeout())
    assert pacing.timeout() == TIMEOUT_MAX_FACTOR * 5.0
    pacing.failed(B, 0.0)  # refused at once: says nothing about speed
    assert pacing.timeouts.recent.count(5.0) == 1


def test_a_failed_peer_is_backed_off_doubling_up_to_the_cap() -> None:
    pacing = DialPacing(MeasuredTimeout(5.0))
    assert not pacing.backed_off(A, 0.0)
    pacing.failed(A, 100.0)
    assert pacing.backed_off(A, 100.0 + BACKOFF_BASE_SECS - 0.1)
    assert not pacing.backed_off(A, 100.0 + BACKOFF_BASE_SECS)
    assert not pacing.backed_off(B, 100.0)  # only the peer that failed
    pacing.failed(A, 200.0)
    assert pacing.backed_off(A, 200.0 + 2 * BACKOFF_BASE_SECS - 0.1)
    for _ in range(20):
        pacing.failed(A, 300.0)
    assert not pacing.backed_off(A, 300.0 + BACKOFF_MAX_SECS)
    pacing.succeeded(A, 1.0)
    assert not pacing.backed_off(A, 300.0)  # a success forgets the failures


def test_dials_to_one_peer_are_joined_and_at_most_max_run_at_once() -> None:
    async def main() -> None:
        started: list[bytes] = []
        running = {"now": 0, "most": 0}
        release = trio.Event()

        async def dial(peer: bytes, timeout: float) -> None:
            started.append(peer)
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
            try:
                await release.wait()
                if peer == C:
                    raise OSError("refused")
            finally:
                running["now"] -= 1

        dialer = Dialer(dial, base_timeout=5.0, max_concurrent=2)
        failures: list[BaseException] = []

        async def connect(peer: bytes) -> None:
            try:
                await dialer.connect(peer)
            except Exception as e:
                failures.append(e)

        async with trio.open_nursery() as nursery:
            for peer in (A, A, A, B, C, C):
                nursery.start_soon(connect, peer)
            await trio.testing.wait_all_tasks_blocked()
            assert all(dialer.dialing(p) for p in (A, B, C))
            assert len(started) == 2  # C waits for a slot
            release.set()
        assert sorted(started) == [A, B, C]  # one dial per peer
        assert running["most"] == 2
        assert len(failures) == 2  # C's dial and the caller that joined it
        assert [dialer.backed_off(p) for p in (A, C)] == [False, True]

    trio.run(main)


def test_the_next_top_up_does_not_dial_a_peer_that_just_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client tops its gossip neighbours up every few seconds with random members; one whose
    dial just failed is skipped for a while (before: dialed again at every top-up, and on a
    loaded machine those failing dials kept the load up)."""

    async def main() -> None:
        async with open_nodes(1) as (a,):
            async with open_nodes(1) as (b,):
                gone, addr = b.endpoint_id, b.endpoint_addr()
            a.set_allowed_peers([a.endpoint_id, gone])
            a.address_book.add(addr)

            def failures() -> int:
                return sum("Failed to join gossip peer" in r.getMessage() for r in caplog.records)

            with caplog.at_level(logging.WARNING, logger="psyche.network.connection"):
                a.add_peers([gone])
                await wait_until(lambda: failures() == 1)
                a.add_peers([gone])  # the next top-up, within the back-off
                await trio.sleep(1.0)  # a second dial to a closed port fails at once
            assert failures() == 1

    trio.run(main)


def test_a_top_up_dials_no_more_peers_while_earlier_joins_are_under_way() -> None:
    """At most `JOINS_UNDER_WAY_MAX` (3) joins at once: a top-up that names 4 peers dials 3,
    and the next top-up, while those are still connecting, dials none; once they are over a
    top-up dials again. The 4 peers here accept TCP and never answer, so their joins stay
    under way until the dials time out. Before, every top-up dialed all it was given (the
    dialer runs 4 at once), and a starved swarm's nodes held 11-18 connections without a
    gossip stream (`scripts/bench/swarm.py`, 32 nodes)."""

    async def main() -> None:
        silent = [SecretKey.generate().public_key for _ in range(4)]
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]  # accepts (the kernel's backlog), never answers
        async with open_nodes(2) as (a, b):
            a.set_allowed_peers([a.endpoint_id, b.endpoint_id, *silent])
            introduce(a, b)
            for key in silent:
                a.address_book.add(
                    EndpointAddr(key, [TransportAddr.Libp2p(f"/ip4/127.0.0.1/tcp/{port}")])
                )
            a.add_peers(silent)
            await trio.testing.wait_all_tasks_blocked()
            assert len(a.joins_under_way()) == JOINS_UNDER_WAY_MAX
            a.add_peers([b.endpoint_id])  # the next top-up, while those three are under way
            await trio.testing.wait_all_tasks_blocked()
            assert b.endpoint_id not in a.joins_under_way() | set(a.connected_peers())
            await wait_until(lambda: not a.joins_under_way(), timeout=120.0)  # they time out
            a.add_peers([b.endpoint_id])
            await wait_until(lambda: b.endpoint_id in a.connected_peers(), timeout=60.0)
        await listener.aclose()

    trio.run(main)
