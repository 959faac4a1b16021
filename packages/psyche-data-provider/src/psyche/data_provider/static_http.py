"""A small static file server with HTTP Range support, for hosting a token dataset.

The HTTP data provider needs byte ranges and keep-alive, which `http.server` does not offer. This
server adds both (single ranges: `a-b`, `a-`, `-n`), sends file bodies with `sendfile`, and never
serves anything outside its root. It is bounded against strangers: `http.server` caps a request
line and its headers (64 KiB, 100 headers), a connection that sends or reads nothing for
`idle_timeout` seconds is closed, and connections beyond `max_connections` in total or
`max_per_address` from one address are closed on arrival (one thread each, so this also bounds
threads). Tests and benchmarks run it on loopback; a small run can host
its dataset with `python -m psyche.data_provider.static_http DIR --port N`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import socket
import threading
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """Inclusive `(first, last)` of a single-range header, or None if it cannot be satisfied.

    Raises ValueError for a header that is not a single byte range (served as the whole file).
    """
    m = _RANGE.fullmatch(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        raise ValueError(f"unsupported Range header {header!r}")
    first_text, last_text = m.groups()
    if not first_text:  # suffix range: the last n bytes
        n = int(last_text)
        if n == 0 or size == 0:
            return None
        return max(0, size - n), size - 1
    first = int(first_text)
    last = int(last_text) if last_text else size - 1
    if first >= size or last < first:
        return None
    return first, min(last, size - 1)


class RangeRequestHandler(BaseHTTPRequestHandler):
    """GET/HEAD of files under `server.root`, with single byte ranges and keep-alive."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out as separate writes: without TCP_NODELAY every small response
    # waits for the client's delayed ACK (about 40 ms).
    disable_nagle_algorithm = True
    server: StaticFileServer

    def setup(self) -> None:
        super().setup()
        # The server's `idle_timeout` on the socket: an idle or stalled peer raises TimeoutError,
        # which ends the connection.
        self.connection.settimeout(self.server.idle_timeout)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def resolve(self) -> Path | None:
        relative = unquote(urlsplit(self.path).path).lstrip("/")
        root = self.server.root
        candidate = (root / relative).resolve()
        if candidate != root and root not in candidate.parents:
            return None
        return candidate if candidate.is_file() else None

    def do_HEAD(self) -> None:
        self.serve(send_body=False)

    def do_GET(self) -> None:
        self.serve(send_body=True)

    def send_empty(self, status: HTTPStatus, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def serve(self, send_body: bool) -> None:
        self.server.count_request(self.path)
        path = self.resolve()
        if path is None:
            self.send_empty(HTTPStatus.NOT_FOUND)
            return
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first, last, status = 0, size - 1, HTTPStatus.OK
            header = self.headers.get("Range")
            if header is not None:
                try:
                    span = parse_range(header, size)
                except ValueError:
                    span = (0, size - 1)  # not a byte range we understand: whole file
                else:
                    if span is None:
                        self.send_empty(
                            HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                            {"Content-Range": f"bytes */{size}"},
                        )
                        return
                    status = HTTPStatus.PARTIAL_CONTENT
                first, last = span
            length = max(0, last - first + 1)
            self.send_response(status)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            if status == HTTPStatus.PARTIAL_CONTENT:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.end_headers()
            if send_body and length:
                self.wfile.flush()
                self.connection.sendfile(f, first, length)


class StaticFileServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        address: tuple[str, int] = ("127.0.0.1", 0),
        handler: type[RangeRequestHandler] = RangeRequestHandler,
        *,
        max_connections: int = 64,
        max_per_address: int = 16,
        idle_timeout: float = 30.0,
    ) -> None:
        self.root = Path(root).resolve(strict=True)
        self.requests: list[str] = []
        self.connections_accepted = 0
        self.connections_refused = 0
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._open: dict[socket.socket, str] = {}
        super().__init__(address, handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Admit a connection only under both caps (a refused one is closed at once)."""
        host = str(client_address[0])
        with self._lock:
            from_host = sum(1 for h in self._open.values() if h == host)
            if len(self._open) >= self.max_connections or from_host >= self.max_per_address:
                self.connections_refused += 1
                refused = self.connections_refused
            else:
                self._open[request] = host
                self.connections_accepted += 1
                return True
        if refused == 1 or refused % 100 == 0:
            log.warning("refused %d connections over the caps (latest from %s)", refused, host)
        return False

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Drop every open keep-alive connection (a stopped server must look gone)."""
        with self._lock:
            conns, self._open = list(self._open), {}
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def count_request(self, path: str) -> None:
        with self._lock:
            self.requests.append(path)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        assert isinstance(host, str)  # an AF_INET server's address (bytes only for AF_UNIX)
        return f"http://{host}:{port}"


@contextlib.contextmanager
def serve_directory(
    root: str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = 0,
    handler: type[RangeRequestHandler] = RangeRequestHandler,
    **limits: Any,
) -> Iterator[StaticFileServer]:
    """Serve `root` from a background thread for the duration of the block (`limits`: the
    keyword-only caps of `StaticFileServer`)."""
    server = StaticFileServer(root, (host, port), handler, **limits)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="static-http", daemon=True
    )
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        server.close_connections()
        thread.join()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="directory to serve")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = StaticFileServer(args.root, (args.host, args.port))
    log.info("serving %s on %s", server.root, server.url)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    server.server_close()


if __name__ == "__main__":
    main()
