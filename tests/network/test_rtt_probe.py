"""RTT probes (`p2p_host.measure_rtt`): a Yamux ping frame the peer's muxer answers, no stream."""

from __future__ import annotations

import trio
from libp2p.host.ping import ID as PING_PROTOCOL_ID

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
