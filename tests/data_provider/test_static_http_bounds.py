"""The static Range server bounds what strangers can hold: connections over the caps are closed on
arrival, and a connection that goes quiet is closed after the idle timeout (real sockets on
loopback; every wait has a generous deadline and nothing depends on how fast the machine is)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx

from psyche.data_provider.static_http import serve_directory

DEADLINE = 30.0


def _closed_by_peer(sock: socket.socket) -> bool:
    """Wait until the server closes `sock` (reads EOF or a reset), up to the deadline."""
    sock.settimeout(DEADLINE)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _read_reply(sock: socket.socket, body_length: int) -> bytes:
    """One whole response: its headers and `body_length` bytes of body (headers and body may
    arrive in separate segments: the body is sent with sendfile after the headers)."""
    sock.settimeout(DEADLINE)
    reply = b""
    while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < body_length:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed after {reply!r}"
        reply += chunk
    return reply


def _wait_for(predicate, what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_connections_over_the_per_address_cap_are_closed(tmp_path: Path) -> None:
    (tmp_path / "data.bin").write_bytes(b"x" * 100)
    with serve_directory(
        tmp_path, max_connections=10, max_per_address=3, idle_timeout=60
    ) as server:
        host, port = server.server_address[:2]
        held = [socket.create_connection((host, port)) for _ in range(3)]
        try:
            _wait_for(lambda: server.connections_accepted == 3, "three admitted connections")
            extra = socket.create_connection((host, port))
            with extra:
                assert _closed_by_peer(extra)
            assert server.connections_refused == 1
            # The held connections were kept and still serve requests.
            held[0].sendall(b"GET /data.bin HTTP/1.1\r\nHost: x\r\nRange: bytes=0-3\r\n\r\n")
            reply = _read_reply(held[0], body_length=4)
            assert reply.startswith(b"HTTP/1.1 206")
            assert reply.endswith(b"\r\n\r\nxxxx")
        finally:
            for sock in held:
                sock.close()
        # Once they close, a new connection is admitted again (exactly at the cap).
        _wait_for(lambda: not server._open, "the held connections to be released")
        response = httpx.get(f"{server.url}/data.bin", headers={"Range": "bytes=0-0"})
        assert response.status_code == 206


def test_connections_over_the_total_cap_are_closed(tmp_path: Path) -> None:
    with serve_directory(tmp_path, max_connections=2, max_per_address=5, idle_timeout=60) as server:
        host, port = server.server_address[:2]
        held = [socket.create_connection((host, port)) for _ in range(2)]
        try:
            _wait_for(lambda: server.connections_accepted == 2, "two admitted connections")
            with socket.create_connection((host, port)) as extra:
                assert _closed_by_peer(extra)
            assert server.connections_refused == 1
        finally:
            for sock in held:
                sock.close()


def test_an_idle_connection_is_closed_after_the_timeout(tmp_path: Path) -> None:
    with serve_directory(tmp_path, idle_timeout=0.5) as server:
        host, port = server.server_address[:2]
        with socket.create_connection((host, port)) as silent:
            assert _closed_by_peer(silent)
        _wait_for(lambda: not server._open, "the idle connection to be released")


def test_a_slow_request_line_is_closed_after_the_timeout(tmp_path: Path) -> None:
    with serve_directory(tmp_path, idle_timeout=0.5) as server:
        host, port = server.server_address[:2]
        with socket.create_connection((host, port)) as slow:
            slow.sendall(b"GET /data")  # never finished
            assert _closed_by_peer(slow)
