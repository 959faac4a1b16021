"""What strangers can make a libp2p host hold (psyche.network.p2p_host), on loopback: a flood of
silent TCP connections from one address evicts itself and leaves the host open to its members,
inbound and outbound (a client's host, and a members-only relay as `psyche-server relay
--authorized-keys` runs it); an inbound connection's slot comes back when it closes; refused
strangers are logged once per interval, not once each.

Before the fix, py-libp2p's resource manager lost a connection slot with every evicted pending
upgrade: after about 1000 silent connections the host refused everyone, members included."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import trio
from libp2p.network.exceptions import SwarmException

from psyche.core.identity import SecretKey
from psyche.network import p2p_host
from psyche.network.relay import RelayOptions, open_relay
from psyche.network.testing import introduce, open_nodes, silent_flood, wait_until

FLOOD = 2000
HELD = 50
"""Silent connections the flood holds open at once; the host evicts the older ones (8 per
address may wait for their handshake)."""
DEADLINE = 60


def tcp_port(multiaddr: str) -> int:
    parts = multiaddr.split("/")
    return int(parts[parts.index("tcp") + 1])


async def flood(port: int) -> None:
    with trio.fail_after(DEADLINE):
        await silent_flood(port, FLOOD, HELD)


def swarm(node: Any) -> Any:
    return node.host.get_network()


async def no_pending_upgrades(node: Any) -> None:
    await wait_until(lambda: swarm(node).psyche_inbound_admission.pending == 0, DEADLINE)


def test_a_flood_of_silent_connections_leaves_a_client_open_to_its_members() -> None:
    async def main() -> None:
        async with open_nodes(3) as (victim, member, other):
            port = tcp_port(victim.host.get_transport_addrs()[0].__str__())
            await flood(port)
            await no_pending_upgrades(victim)
            # a member dials in, and the flooded host dials out to another
            introduce(member, victim)
            introduce(victim, other)
            with trio.fail_after(DEADLINE):
                await member.connect(victim.endpoint_id)
                await victim.connect(other.endpoint_id)
            assert set(victim.connected_peers()) == {member.endpoint_id, other.endpoint_id}

    trio.run(main)


def test_a_flood_of_silent_connections_leaves_a_relay_open_to_its_member() -> None:
    async def main() -> None:
        member = SecretKey.generate()
        async with open_relay(
            SecretKey.generate(),
            lambda key: key == member.public_key,
            RelayOptions(bind_host="127.0.0.1"),
        ) as relay:
            await flood(tcp_port(relay.multiaddrs()[0]))
            await no_pending_upgrades(relay)
            async with open_nodes(
                1, keys=[member], relays=tuple(relay.multiaddrs()), reachability="private"
            ) as (node,):
                await wait_until(lambda: node.reachability.relayed_addrs() != [], DEADLINE)
                assert relay.reservations() == 1

    trio.run(main)


def test_an_inbound_connection_gives_its_slot_back_when_it_closes() -> None:
    """py-libp2p's handler of an inbound connection held one of the swarm's inbound slots (as
    many as `max_connections`) until the swarm stopped, so members reconnecting over a long run
    used them up; now each handler ends with its connection."""

    async def main() -> None:
        async with open_nodes(2) as (host, member):
            introduce(member, host)
            limiter = swarm(host)._inbound_limiter  # py-libp2p's inbound slots
            for _ in range(10):
                with trio.fail_after(DEADLINE):
                    await member.connect(host.endpoint_id)
                await p2p_host.disconnect(member.host, host.endpoint_id)
                await wait_until(lambda: not swarm(host).get_connections(), DEADLINE)
            await wait_until(lambda: limiter.borrowed_tokens == 0, DEADLINE)

    trio.run(main)


def test_refused_strangers_are_logged_once_per_interval(caplog) -> None:
    """One line for the first refusal of each 10 s, the others counted (py-libp2p 0.8.1 dials
    several connections per attempt; each was one INFO line)."""
    caplog.set_level(logging.INFO, logger="psyche.network.p2p_host")
    attempts = 20
    counts: dict[str, int] = {}
    took: list[float] = []

    async def main() -> None:
        async with open_nodes(1) as (host,), open_nodes(1) as (stranger,):
            stranger.set_allowed_peers([host.endpoint_id])  # the host does not allow it
            addrs = host.endpoint_addr().libp2p_addrs()
            start = trio.current_time()
            for _ in range(attempts):
                with trio.move_on_after(5), contextlib.suppress(SwarmException):
                    await p2p_host.connect(stranger.host, host.endpoint_id, addrs)
                await p2p_host.disconnect(stranger.host, host.endpoint_id)
                assert stranger.endpoint_id not in host.connected_peers()
            took.append(trio.current_time() - start)
            drops = getattr(host, "connection_drops", None)  # (absent before the fix)
            counts.update(drops.counts if drops is not None else {})

    trio.run(main)
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refusing")]
    intervals = 1 + int(took[0] // 10)
    assert 1 <= len(refusals) <= intervals, refusals
    assert counts["not in allowlist"] >= attempts
