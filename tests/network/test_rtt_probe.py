"""RTT probes (`p2p_host.measure_rtt`): a Yamux ping frame the peer's muxer answers, no stream."""

from __future__ import annotations

import struct
from typing import Any

import trio
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import (
    FLAG_ACK,
    FLAG_SYN,
    HEADER_SIZE,
    TYPE_PING,
    YAMUX_HEADER_FORMAT,
)

from psyche.network import p2p_host
from psyche.network.connection import NetworkConnection
from psyche.network.testing import introduce, open_nodes, wait_until


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


PROBING = {
    "rtt_probe_interval_secs": 0.2,
    "rtt_probe_timeout_secs": 0.1,
}
"""Probes every 0.2 s that time out after 0.1 s (at most twice that once grown)."""


def _muxers_to(node: NetworkConnection, peer: NetworkConnection) -> list[Any]:
    conns = node.host.get_network().get_connections(peer.gossip.pubsub.my_id)
    return [c.muxed_conn for c in conns]


def _hold_back_ping_answers(muxed: Any, secs: float) -> None:
    """`muxed` answers each ping `secs` late, its reader stalled meanwhile (a process stalled
    by load); everything else it writes (its own pings among them) goes out at once."""
    write_frame = muxed._write_frame

    async def late_answers(data: bytes) -> None:
        _, kind, flags, _, _ = struct.unpack(YAMUX_HEADER_FORMAT, data[:HEADER_SIZE])
        if kind == TYPE_PING and flags & FLAG_ACK:
            await trio.sleep(secs)
        await write_frame(data)

    muxed._write_frame = late_answers


def test_a_peer_that_answers_probes_late_but_keeps_sending_is_kept() -> None:
    """b answers each of a's pings 1.5 s late, far past a's probe timeout, so most of a's
    probes fail, many in a row; b's late answers and its own probes still reach a. Before,
    two unanswered probes in a row closed the connection and redialed it (at 32 nodes on two
    loaded cores: live connections dropped faster than meshes formed); now only a connection
    that received nothing for `idle_timeout_secs` is closed, so the same connection stays."""

    async def main() -> None:
        async with open_nodes(2, idle_timeout_secs=8.0, **PROBING) as (a, b):
            introduce(a, b)
            await a.connect(b.endpoint_id)
            for muxed in _muxers_to(b, a):
                _hold_back_ping_answers(muxed, 1.5)
            kept = _muxers_to(a, b)
            await trio.sleep(10.0)  # four probe cycles per late answer, over 6 answers
            assert all(not m.is_closed for m in kept)
            assert all(m in _muxers_to(a, b) for m in kept)
            assert b.endpoint_id in a.peer_paths()

    trio.run(main)


def test_a_silent_peer_is_dropped_once_nothing_came_for_the_idle_timeout() -> None:
    """The bound kept: b, still connected, stops sending anything to a (no answers, no frames
    of its own). a closes that connection, and not before `idle_timeout_secs` of silence."""
    idle = 2.0

    async def main() -> None:
        async with open_nodes(2, idle_timeout_secs=idle, **PROBING) as (a, b):
            introduce(a, b)
            await a.connect(b.endpoint_id)

            async def silence(data: bytes) -> None:
                return None

            for muxed in _muxers_to(b, a):
                muxed._write_frame = silence
            silent_since = trio.current_time()
            watched = _muxers_to(a, b)
            await wait_until(lambda: all(m.is_closed for m in watched), timeout=120.0)
            assert trio.current_time() - silent_since >= idle

    trio.run(main)
