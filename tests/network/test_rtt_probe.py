"""RTT probes (`p2p_host.measure_rtt`): a Yamux ping frame the peer's muxer answers, no stream."""

from __future__ import annotations

import struct

import trio
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import FLAG_SYN, HEADER_SIZE, TYPE_PING, YAMUX_HEADER_FORMAT

from psyche.network import p2p_host
from psyche.network.testing import introduce, open_nodes


def test_a_probe_is_answered_by_the_muxer_without_a_ping_stream() -> None:
    """Before, each probe opened a stream and negotiated the ping protocol (per peer every
    5 s: most of an idle node's CPU, and on a loaded machine the negotiation stalled while
    the connection was alive). With the ping protocol gone from the peer, a stream-based probe
    fails; the muxer's answer does not need it."""

    async def main() -> None:
        async with open_nodes(2) as (a, b):
            introduce(a, b)
            await a.connect(b.endpoint_id)
            b.host.remove_stream_handler(PING_PROTOCOL_ID)
            for _ in range(3):
                with trio.fail_after(30):
                    rtt = await p2p_host.measure_rtt(a.host, b.endpoint_id)
                assert 0 < rtt < 30
            conn = a.host.get_network().get_connections(b.gossip.pubsub.my_id)[0]
            with trio.fail_after(30):
                assert await p2p_host.measure_rtt(a.host, b.endpoint_id, conn=conn) > 0

    trio.run(main)


def test_a_probe_is_answered_when_the_muxers_own_rtt_loop_pings_meanwhile() -> None:
    """py-libp2p's RTT loop replaces the muxer's ping event whenever it pings (every 30 s);
    an answer arriving after that sets the loop's event. Before, the probe waited on its own
    event only and timed out on a live connection (two in a row closed it); here the loop's
    ping is made to come between the probe's event and its SYN, every time."""

    async def main() -> None:
        async with open_nodes(2) as (a, b):
            introduce(a, b)
            await a.connect(b.endpoint_id)
            conn = a.host.get_network().get_connections(b.gossip.pubsub.my_id)[0]
            muxed = conn.muxed_conn
            write_frame = muxed._write_frame

            async def the_loop_pings_too(data: bytes) -> None:
                _, kind, flags, _, _ = struct.unpack(YAMUX_HEADER_FORMAT, data[:HEADER_SIZE])
                if kind == TYPE_PING and flags & FLAG_SYN:  # the loop's ping: its own event
                    muxed._ping_event = trio.Event()
                await write_frame(data)

            muxed._write_frame = the_loop_pings_too
            for _ in range(2):
                with trio.fail_after(10):
                    rtt = await p2p_host.measure_rtt(a.host, b.endpoint_id, timeout=10)
                assert 0 < rtt < 10

    trio.run(main)
