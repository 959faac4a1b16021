"""A libp2p dial returns when its attempt is over: py-libp2p 0.8.1's dial loop waited 0.25 s
after its last address even when the dial had succeeded (`end_dials_when_their_attempts_end`)."""

from __future__ import annotations

import threading

import multiaddr
import trio
import trio.testing
from libp2p.peer.peerinfo import PeerInfo

from psyche.core.identity import SecretKey
from psyche.network.p2p_host import build_host, listen_multiaddr

REAL_SECS_BOUND = 60.0
"""How long the frozen-clock dial may take in real time before the test calls it stuck (the
dial itself takes milliseconds; this only ends a test whose dial waits on the clock)."""


async def _dial_two_hosts(clock: trio.testing.MockClock, connected: threading.Event) -> int:
    server = build_host(SecretKey.generate(), bind_host="127.0.0.1")
    client = build_host(SecretKey.generate(), bind_host="127.0.0.1")
    async with (
        server.run(listen_addrs=[listen_multiaddr("127.0.0.1", 0)]),
        client.run(listen_addrs=[listen_multiaddr("127.0.0.1", 0)]),
    ):
        addrs = [multiaddr.Multiaddr(str(a)) for a in server.get_transport_addrs()]
        await client.connect(PeerInfo(server.get_id(), addrs))
        connected.set()
        conns = len(client.get_network().get_connections(server.get_id()))
        clock.rate = 1.0  # closing the hosts waits on timers: let time run again
        await client.close()
        await server.close()
        return conns


def test_a_successful_dial_does_not_wait_on_the_clock() -> None:
    """The trio clock is frozen (a `MockClock` at rate 0 never advances by itself), so any wait
    for time in the dial never ends: the old loop's 0.25 s wait after its last address hung
    here, a dial that returns when its attempt is over completes on real sockets."""
    result: list[int] = []
    clock = trio.testing.MockClock(rate=0)
    connected = threading.Event()

    def run() -> None:
        result.append(trio.run(_dial_two_hosts, clock, connected, clock=clock))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    dialled = connected.wait(REAL_SECS_BOUND)
    clock.rate = 1.0  # a stuck dial's own timeout (10 s) ends it and the hosts close
    thread.join(REAL_SECS_BOUND)
    assert dialled, "the dial waited on the (frozen) clock"
    assert not thread.is_alive()
    assert result == [1]
