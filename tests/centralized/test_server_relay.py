"""The relay `psyche-server run` hosts serves the run's members only (issue 24, item 5), on
loopback: a key that logged in to the coordinator but never joined is refused like a stranger,
the same key is served once it has joined, and a member that leaves the run (its coordinator
connection closes) loses its relay connection and its slot. Before, any key logged in to the
coordinator could reserve a slot and use the relay."""

from __future__ import annotations

import trio

from psyche.centralized.server import open_server
from psyche.centralized.testing import ProtocolClient, fast_options
from psyche.coordinator.testing import quick_coordinator
from psyche.core.identity import SecretKey
from psyche.network.identity import peer_id_from_public_key
from psyche.network.testing import open_nodes, wait_until

from .servers import addr, eventually

DEADLINE = 30


async def keep_reading(client: ProtocolClient) -> None:
    """Read the server's states (a client that reads nothing is dropped in the end)."""
    try:
        while True:
            await client.receive()
    except Exception:
        return


def test_the_servers_relay_serves_joined_members_only() -> None:
    async def main() -> None:
        # three clients start an epoch: the ones here stay pending, as joiners do
        async with (
            open_server(quick_coordinator(init_min_clients=3), fast_options()) as server,
            trio.open_nursery() as nursery,
        ):
            assert server.p2p_relay is not None
            relay = server.p2p_relay
            key = SecretKey.generate()
            client = await ProtocolClient.connect(addr(server), key)  # logged in, no Join
            nursery.start_soon(keep_reading, client)
            async with open_nodes(
                1, keys=[key], relays=tuple(relay.multiaddrs()), reachability="private"
            ) as (node,):
                states = node.reachability.relays.values()
                await wait_until(lambda: [r.state for r in states] == ["unreachable"], DEADLINE)
                assert relay.reservations() == 0
                # joined: served (the node retries the relay with backoff)
                await client.join("test-run")
                await eventually(lambda: len(server.core.pending_clients) == 1)
                await wait_until(lambda: node.reachability.relayed_addrs() != [], DEADLINE)
                assert relay.reservations() == 1
                # left the run: its relay connection is closed and its slot dropped
                await client.conn.aclose()
                relay_network = relay.host.get_network()
                peer = peer_id_from_public_key(key.public_key)
                await wait_until(lambda: not relay_network.get_connections(peer), DEADLINE)
                assert relay.reservations() == 0
            nursery.cancel_scope.cancel()

    trio.run(main)
