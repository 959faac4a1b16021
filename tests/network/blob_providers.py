"""Blob providers that misbehave, for the blob tests (real sockets on 127.0.0.1)."""

from __future__ import annotations

import trio

from psyche.core.identity import SecretKey
from psyche.network import blob_protocol
from psyche.network.secure_channel import StaticKey, secure_inbound


async def serve_truncated(
    identity: SecretKey, blob: bytes, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """`identity`'s blob side channel (on a port it hands `task_status`), dying halfway
    through the blob: its connection drops."""
    static = StaticKey(identity)

    async def handler(stream: trio.SocketStream) -> None:
        try:
            conn = await secure_inbound(stream, static, lambda peer: True)
            request = await blob_protocol.accept_request(conn, identity, lambda peer: True)
            assert request is not None
            await blob_protocol.send_frame(
                conn, blob_protocol.Reply.Found(len(blob)), blob_protocol.Reply
            )
            await conn.send_all(blob[: len(blob) // 2])
        finally:
            await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])
