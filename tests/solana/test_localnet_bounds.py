"""The localnet JSON-RPC server refuses a request body over its cap before reading any of it."""

from __future__ import annotations

import socket

from psyche.solana.localnet.ledger import Ledger
from psyche.solana.localnet.server import MAX_REQUEST_BYTES, LocalnetThread


def test_a_body_claiming_a_gigabyte_is_refused_without_being_read() -> None:
    with LocalnetThread(Ledger()) as net:
        host, port = net.rpc_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            raw.sendall(
                b"POST / HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 1073741824\r\n\r\n"
            )
            # Nothing of the body is sent: the answer cannot wait for it.
            reply = b""
            while b"\r\n\r\n" not in reply:
                chunk = raw.recv(4096)
                assert chunk, reply
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 413"), reply
        assert MAX_REQUEST_BYTES < 1 << 30
