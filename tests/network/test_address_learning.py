"""A join asked for before the peer's address is known, or whose dial failed, is made again by
itself the moment the peer's addresses change, with no further `add_peers` (real nodes on
loopback).

Found in tests/e2e/test_nat.py: two clients behind NAT start together and each asks to join
the other before the other's record has come from the coordinator; the join failed with "no
known address", which also backed the peer off, and the next try came with the client's
top-up 10 s later, then was skipped by the back-off: the two met only after 30 s, the 20 s
warmup was over, and the run's first round lost one of them's result (a health check then
dropped it)."""

from __future__ import annotations

import logging

import pytest
import trio

from psyche.network.testing import open_nodes, wait_until
from psyche.network.ticket import EndpointAddr

JOIN_TIMEOUT_SECS = 60.0
"""Generous (a loaded machine): the old code never joined at all."""


def _said(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


def test_a_join_waits_for_the_address_and_is_made_when_it_is_learned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        async with open_nodes(2) as (a, b):
            with caplog.at_level(logging.INFO, logger="psyche.network.connection"):
                a.add_peers([b.endpoint_id])
                await wait_until(lambda: _said(caplog, "no known address"), JOIN_TIMEOUT_SECS)
            assert b.endpoint_id not in a.connected_peers()
            assert not a.dialer.backed_off(b.endpoint_id)  # no dial was made: nothing failed
            assert not _said(caplog, "Failed to join gossip peer")

            a.address_book.add_record(b.own_record)  # e.g. the coordinator relays b's record
            await wait_until(lambda: b.endpoint_id in a.connected_peers(), JOIN_TIMEOUT_SECS)

    trio.run(main)


def test_a_failed_join_is_made_again_when_the_peer_announces_new_addresses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A dial to an address that no longer reaches the peer fails (and backs it off); the
    peer's new record (a relay slot it reserved, a restart on a new port) is new information:
    the join is made again at once, back-off or not."""

    async def main() -> None:
        async with open_nodes(2) as (a, b):
            async with open_nodes(1) as (gone,):
                stale = gone.endpoint_addr()
            a.address_book.add(EndpointAddr(b.endpoint_id, stale.addrs))  # a closed port
            with caplog.at_level(logging.WARNING, logger="psyche.network.connection"):
                a.add_peers([b.endpoint_id])
                await wait_until(
                    lambda: _said(caplog, "Failed to join gossip peer"), JOIN_TIMEOUT_SECS
                )
            assert a.dialer.backed_off(b.endpoint_id)
            assert b.endpoint_id not in a.connected_peers()

            a.address_book.add_record(b.own_record)
            await wait_until(lambda: b.endpoint_id in a.connected_peers(), JOIN_TIMEOUT_SECS)

    trio.run(main)


def test_the_same_addresses_again_make_no_new_dial(caplog: pytest.LogCaptureFixture) -> None:
    """Hearing the same addresses again (every peer exchange and ticket repeats them) changes
    nothing: a peer whose dial failed stays backed off and is not dialed again in a loop."""

    async def main() -> None:
        async with open_nodes(2) as (a, b):
            async with open_nodes(1) as (gone,):
                stale = EndpointAddr(b.endpoint_id, gone.endpoint_addr().addrs)
            a.address_book.add(stale)
            with caplog.at_level(logging.WARNING, logger="psyche.network.connection"):
                a.add_peers([b.endpoint_id])
                await wait_until(
                    lambda: _said(caplog, "Failed to join gossip peer"), JOIN_TIMEOUT_SECS
                )
                for _ in range(3):
                    a.address_book.add(stale)
                await trio.sleep(1.0)  # a dial to a closed port fails at once
            failures = [r for r in caplog.records if "Failed to join" in r.getMessage()]
            assert len(failures) == 1, failures

    trio.run(main)
