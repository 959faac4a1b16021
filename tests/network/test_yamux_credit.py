"""Yamux window credit (`p2p_host.batch_window_updates`): one WINDOW_UPDATE per half window
consumed, as go-yamux, not one per read or per message."""

from __future__ import annotations

import struct
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.stream_muxer.yamux.yamux import FLAG_ACK, HEADER_SIZE, TYPE_WINDOW_UPDATE
from libp2p.stream_muxer.yamux.yamux import YAMUX_HEADER_FORMAT as HEADER

from psyche.network import p2p_host
from psyche.network.testing import introduce, open_nodes

PROTOCOL = p2p_host.protocol("/psyche/test/credit/0")
MESSAGES = 50
BULK = 1 << 20


def test_small_messages_draw_no_window_updates_and_a_bulk_transfer_still_flows() -> None:
    """Before, the reader of 50 small length-prefixed messages (a gossip stream's traffic)
    wrote a WINDOW_UPDATE for each of them (each one a Noise message both sides handle); now
    none, while 1 MiB, four times the initial window, still arrives (credit every half
    window)."""

    async def main() -> None:
        async with open_nodes(2) as (a, b):
            introduce(a, b)
            await a.connect(b.endpoint_id)
            updates = 0
            received: list[bytes] = []
            done = trio.Event()

            async def serve(stream: INetStream) -> None:
                nonlocal updates
                conn: Any = stream.muxed_conn  # Yamux: its private frame writer is counted
                write_frame = conn._write_frame
                muxed: Any = stream.muxed_stream  # a YamuxStream
                ours: int = muxed.stream_id

                async def counted(data: bytes) -> None:
                    # this stream's credit only: the connection also carries other streams
                    # (identify, gossip, the RTT probe) whose opening frames are window updates
                    nonlocal updates
                    _, kind, flags, stream_id, _ = struct.unpack(HEADER, data[:HEADER_SIZE])
                    updates += (
                        stream_id == ours and kind == TYPE_WINDOW_UPDATE and not flags & FLAG_ACK
                    )
                    await write_frame(data)

                conn._write_frame = counted
                for _ in range(MESSAGES):
                    size = (await p2p_host.read_exactly(stream, 1))[0]
                    received.append(await p2p_host.read_exactly(stream, size))
                small_updates = updates
                body = await p2p_host.read_exactly(stream, BULK)
                received.append(bytes([small_updates]) + body[:1])
                done.set()

            b.host.set_stream_handler(PROTOCOL, serve)
            stream = await a.host.new_stream(b.gossip.pubsub.my_id, [PROTOCOL])
            for i in range(MESSAGES):
                await stream.write(bytes([200]) + bytes([i]) * 200)
                await trio.sleep(0.005)  # one message at a time, as gossip arrives
            await stream.write(b"\x07" * BULK)
            with trio.fail_after(60):
                await done.wait()
            assert received[:MESSAGES] == [bytes([i]) * 200 for i in range(MESSAGES)]
            assert received[-1] == bytes([0, 7])  # no update for the small messages
            assert 1 <= updates <= 2 * BULK // (128 << 10)  # the bulk transfer got credit

    trio.run(main)
