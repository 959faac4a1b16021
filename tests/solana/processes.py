"""Helpers of the Solana end-to-end tests: real processes, their logs, and a TCP proxy that can
take an RPC endpoint away and bring it back.

* `Processes`: starts commands with their output in `<dir>/<name>.log`, waits for log lines, and
  at the end interrupts, then kills, every process it started (and its process group).
* `Proxy`: forwards a loopback port to another; `down()` closes the listener and every
  forwarded connection (clients see the endpoint vanish), `up()` listens on the same port again.
* `json_events(text, name)`: the JSON log lines of a `--logs json` client.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from ..processes import REPO, Processes, free_port, json_events, wait_event

__all__ = ["REPO", "Processes", "Proxy", "free_port", "json_events", "wait_event"]


class Proxy:
    """A loopback TCP forwarder whose listening port can go away and come back."""

    def __init__(self, target_port: int, port: int = 0) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.connections = 0

    def __enter__(self) -> Proxy:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Stop listening and cut every forwarded connection (both sides see it close)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
                self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
