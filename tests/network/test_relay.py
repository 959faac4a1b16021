"""Relays, reachability and hole punching on loopback (psyche.network.relay, .reachability):
members reserve slots and are reached through the relay, strangers are refused, AutoNAT's
dial-back tells a reachable node from one whose announced address answers nobody (py-libp2p's
own dial-back cannot), and a relayed connection is upgraded to a direct one."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import multiaddr
import trio
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.peer.peerinfo import PeerInfo
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as GOSSIP_V11

from psyche.core.identity import SecretKey
from psyche.network import p2p_host
from psyche.network.blob_routes import LIBP2P_DIRECT, LIBP2P_RELAYED
from psyche.network.connection import NetworkConnection
from psyche.network.download import DownloadComplete
from psyche.network.identity import peer_id_from_public_key
from psyche.network.reachability import DialBackAutoNAT, Reachability, relay_peer
from psyche.network.relay import Relay, RelayOptions, open_relay
from psyche.network.testing import only_relayed, open_nodes, wait_until
from psyche.network.ticket import BlobFormat, BlobTicket
from psyche.network.transmittable import DownloadType

DEADLINE = 30


@asynccontextmanager
async def relay_for(members: set[bytes]) -> AsyncIterator[Relay]:
    async with open_relay(
        SecretKey.generate(), lambda key: key in members, RelayOptions(bind_host="127.0.0.1")
    ) as relay:
        yield relay


async def reserved(*nodes: NetworkConnection) -> None:
    await wait_until(lambda: all(n.reachability.relayed_addrs() for n in nodes), DEADLINE)


def test_members_reach_a_private_member_through_the_relay() -> None:
    async def main() -> None:
        keys = [SecretKey.generate() for _ in range(2)]
        async with (
            relay_for({k.public_key for k in keys}) as relay,
            open_nodes(2, keys=keys, relays=tuple(relay.multiaddrs()), reachability="private") as (
                a,
                b,
            ),
        ):
            # open() waited for the reservations: the first record names the relay
            assert a.reachability.reachability == Reachability.PRIVATE
            assert relay.reservations() == 2
            record = b.endpoint_addr()
            assert [p for p in record.libp2p_addrs() if "/p2p-circuit" in p] == [
                f"{relay.multiaddrs()[0]}/p2p-circuit"
            ]
            # a knows b only through the relay
            a.address_book._addrs[b.endpoint_id] = only_relayed(record)
            with trio.fail_after(DEADLINE):
                await a.connect(b.endpoint_id)
            assert a.peer_paths()[b.endpoint_id] in ("relayed", "direct")
            data = os.urandom(3_000_000)
            ticket, _ = await b.add_downloadable(data, "distro-result_1")
            relayed_ticket = BlobTicket(
                only_relayed(record), BlobFormat.Raw, ticket.hash, ticket.size
            )
            with trio.fail_after(DEADLINE):
                done = await a.start_download(
                    relayed_ticket, "distro-result_1", DownloadType.DistroResult([])
                ).finished()
            assert isinstance(done, DownloadComplete)
            assert bytes(done.data) == data
            # no side channel for a peer that announces itself through a relay
            assert a.blob_routes.routes[b.endpoint_id] in (LIBP2P_RELAYED, LIBP2P_DIRECT)

    trio.run(main)


def test_the_relay_serves_only_members(caplog) -> None:
    caplog.set_level(logging.INFO, logger="psyche.network.reachability")

    async def main() -> None:
        members: set[bytes] = set()
        async with relay_for(members) as relay:
            relay_id = relay_peer(relay.multiaddrs()[0])
            async with open_nodes(1, relays=tuple(relay.multiaddrs()), reachability="private") as (
                stranger,
            ):
                # refused right after its handshake: no reservation, nothing announced
                assert stranger.reachability.relays[relay_id].state == "unreachable"
                assert relay.reservations() == 0
                assert stranger.reachability.relayed_addrs() == []
                assert not relay.host.get_network().get_connections(
                    peer_id_from_public_key(stranger.endpoint_id)
                )
                # once the run admits it, it gets its slot (it retries with backoff)
                members.add(stranger.endpoint_id)
                await reserved(stranger)
                assert relay.reservations() == 1
        states = [r.getMessage() for r in caplog.records if "relay " in r.getMessage()]
        assert any("unreachable" in s for s in states)
        assert any("reserved" in s for s in states)

    trio.run(main)


def test_autonat_dial_back_tells_reachable_from_unreachable() -> None:
    async def main() -> None:
        keys = [SecretKey.generate() for _ in range(2)]
        members = {k.public_key for k in keys}
        async with (
            relay_for(members) as relay,
            open_nodes(2, keys=keys, relays=tuple(relay.multiaddrs())) as (reachable, hidden),
        ):
            assert reachable.reachability.reachability == Reachability.PUBLIC
            assert reachable.reachability.relayed_addrs() == []
            assert not any("/p2p-circuit" in a for a in reachable.endpoint_addr().libp2p_addrs())
            # `hidden` now announces a port nobody listens on (as behind a NAT that
            # forwards nothing): the relay's dial-back fails, and it takes a slot
            closed = trio.socket.socket()
            await closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
            closed.close()
            hidden.nat._announced = lambda: [f"/ip4/127.0.0.1/tcp/{port}"]
            await p2p_host.disconnect(hidden.host, relay.endpoint_id)  # asked anew on reconnect
            await wait_until(
                lambda: hidden.reachability.reachability == Reachability.PRIVATE, DEADLINE
            )
            await reserved(hidden)
            assert any("/p2p-circuit" in a for a in hidden.endpoint_addr().libp2p_addrs())

    trio.run(main)


def test_py_libp2p_autonat_reports_any_connected_peer_reachable() -> None:
    """The reason for `DialBackAutoNAT`: py-libp2p's server answers OK for an address nobody
    listens on, because `host.connect` returns the connection the request came on."""

    async def main() -> None:
        server_key, client_key = SecretKey.generate(), SecretKey.generate()
        server = p2p_host.build_host(server_key, "127.0.0.1")
        client = p2p_host.build_host(client_key, "127.0.0.1")
        stock = AutoNATService(server, serve=True)  # type: ignore[arg-type]
        fixed = DialBackAutoNAT(client, serve=False)  # type: ignore[arg-type]
        listen = p2p_host.listen_multiaddr("127.0.0.1", 0)
        async with server.run([listen]), client.run([p2p_host.listen_multiaddr("127.0.0.1", 0)]):
            closed = trio.socket.socket()
            await closed.bind(("127.0.0.1", 0))
            nowhere = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}")
            closed.close()
            await client.connect(PeerInfo(server.get_id(), server.get_addrs()))
            with trio.fail_after(DEADLINE):
                status, _ = await fixed.query_server(server.get_id(), [nowhere.to_bytes()])
            assert status == 0  # OK: py-libp2p's server "reached" a closed port
            # ours, serving the same question, dials for real and says no
            DialBackAutoNAT(server, serve=True)  # type: ignore[arg-type]
            with trio.fail_after(DEADLINE):
                status, _ = await fixed.query_server(server.get_id(), [nowhere.to_bytes()])
            assert status != 0
            del stock
            for host in (client, server):
                with contextlib.suppress(Exception):
                    await p2p_host.close_all_connections(host)

    trio.run(main)


def test_a_relayed_connection_is_upgraded_to_a_direct_one(caplog) -> None:
    caplog.set_level(logging.INFO, logger="psyche.network")

    async def main() -> None:
        keys = [SecretKey.generate() for _ in range(2)]
        async with (
            relay_for({k.public_key for k in keys}) as relay,
            open_nodes(2, keys=keys, relays=tuple(relay.multiaddrs()), reachability="private") as (
                a,
                b,
            ),
        ):
            a.address_book._addrs[b.endpoint_id] = only_relayed(b.endpoint_addr())
            with trio.fail_after(DEADLINE):
                await a.connect(b.endpoint_id)
            # DCUtR (its direct-dial step succeeds on loopback) moves both to a direct path
            await wait_until(lambda: a.peer_paths().get(b.endpoint_id) == "direct", DEADLINE)
        lines = [r.getMessage() for r in caplog.records]
        assert any("connected through a relay" in line for line in lines)
        assert any("connected directly" in line for line in lines)

    trio.run(main)


def test_a_relay_named_later_takes_over_from_one_that_is_gone() -> None:
    """What a client does when its coordinator server restarts: the old relay vanishes, the
    server names a new one (`add_relays`), and the node reserves there and announces it."""

    async def main() -> None:
        key = SecretKey.generate()
        first_scope = trio.CancelScope()

        async def first_relay(*, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
            with first_scope:
                async with relay_for({key.public_key}) as relay:
                    task_status.started(relay)
                    await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            first = await nursery.start(first_relay)
            old = f"{first.multiaddrs()[0]}/p2p-circuit"
            async with open_nodes(
                1, keys=[key], relays=tuple(first.multiaddrs()), reachability="private"
            ) as (node,):
                assert node.reachability.relayed_addrs() == [old]
                first_scope.cancel()
                await wait_until(lambda: not node.reachability.relayed_addrs(), DEADLINE)
                async with relay_for({key.public_key}) as second:
                    new = f"{second.multiaddrs()[0]}/p2p-circuit"
                    node.add_relays(second.multiaddrs())
                    await wait_until(lambda: node.reachability.relayed_addrs() == [new], DEADLINE)
                    assert second.reservations() == 1
                    announced = node.endpoint_addr().libp2p_addrs()
                    assert new in announced
                    assert old not in announced

    trio.run(main)


def test_the_relay_drains_a_members_gossip_within_its_budget() -> None:
    """The relay accepts the gossip stream every member opens to it and discards what comes,
    at most a burst and then a slow rate per member; a member that pumps bytes into it has its
    stream reset (before: the relay drained whatever came, ~2 GB in 45 s from one member)."""
    pump = 32 * 1024 * 1024

    async def main() -> None:
        key = SecretKey.generate()
        async with (
            relay_for({key.public_key}) as relay,
            open_nodes(1, keys=[key], relays=tuple(relay.multiaddrs()), reachability="private") as (
                member,
            ),
        ):
            await reserved(member)
            relay_id = peer_id_from_public_key(relay_peer(relay.multiaddrs()[0]))
            stream = await member.host.new_stream(relay_id, [GOSSIP_V11])
            chunk = bytes(64 * 1024)
            sent = 0
            start = trio.current_time()
            with trio.move_on_after(DEADLINE):
                try:
                    while sent < pump:
                        await stream.write(chunk)
                        sent += len(chunk)
                except Exception:  # the relay reset the stream
                    pass
            elapsed = trio.current_time() - start
            # what the member got written: the budget plus one Yamux window (256 KiB)
            assert sent < 2 * 1024 * 1024, sent
            budget = relay.gossip.burst + relay.gossip.rate * (elapsed + 1)
            assert relay.gossip.drained.get(key.public_key, 0) <= budget
            assert relay.gossip.resets >= 1
            # the member keeps its slot: its honest traffic is not what is refused
            assert relay.reservations() == 1

    trio.run(main)
