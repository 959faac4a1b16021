"""What peers can make a listening socket hold: connections, buffered bytes and time.

Every listening socket of a node that speaks Psyche's own protocols (the coordinator's and the
data server's `TcpServer`, the blob side channel) admits its connections through an `Admission`
built from a `ConnectionLimits`:

* pending connections (accepted, not yet authenticated) are capped per remote address and in
  total. When either cap is reached the oldest pending connection (of that address, or of all)
  is closed to make room: a flood of strangers evicts itself, and an honest handshake, which
  needs one round trip, completes unless the flood opens `max_pending` connections within it.
* authenticated connections are capped per address and in total. Beyond a cap a new identity is
  refused; identities already connected keep their connections (and may replace them), so
  strangers never push out members that have logged in.

Refusals and drops are logged through a `DropLog` (`psyche.core.drop_log`): the first of each
kind in an interval with its detail, the rest as one summary line, so that a flood cannot flood
the log as well.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import trio

from psyche.core.drop_log import DropLog

MIB = 1 << 20


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds of one listening socket. Defaults fit a run of up to 256 clients (upstream's
    `SOLANA_MAX_NUM_CLIENTS`) with room for reconnects; tests shrink them."""

    max_pending: int = 64
    """Connections accepted but not yet authenticated, in total. When full, the oldest pending
    connection is closed to admit the new one."""

    max_pending_per_address: int = 8
    """Pending connections from one remote address. When full, that address's oldest pending
    connection is closed to admit the new one."""

    max_connections: int = 512
    """Authenticated connections in total. Beyond it a new identity is refused after its
    handshake; an identity that is already connected may still replace its connection."""

    max_connections_per_address: int = 64
    """Authenticated connections from one remote address (several clients may share a host or a
    NAT, so this is looser than `max_pending_per_address`)."""

    handshake_timeout: float = 10.0
    """Seconds from accepting a connection to a verified handshake (upstream waits forever)."""

    frame_timeout: float = 60.0
    """Seconds within which a frame must arrive completely once its first byte has: a peer that
    trickles a frame byte by byte is dropped after this long. Time the application spends
    before asking for the next frame does not count."""

    idle_timeout: float | None = 900.0
    """An authenticated connection on which nothing was received and nothing sent for this many
    seconds is closed (None: never). The coordinator sends its state every tick, so its
    clients are never idle; a data client reconnects on its next request."""

    send_stall_timeout: float = 60.0
    """Seconds a frame being sent may go without a chunk of it (1 MiB) reaching the socket: a
    peer that stops reading is dropped after this long (noticed within twice this: a watchdog
    checks, so that no send pays for a timer)."""

    max_queued_frames: int = 1024
    """Frames queued for one connection; a connection whose queue is full is dropped."""

    max_queued_bytes: int = 16 * MIB
    """Bytes queued for one connection, besides the frame being written. A frame that would
    take a non-empty queue past this is not queued and the connection is dropped (one frame of
    any allowed size always fits)."""

    max_buffered_bytes: int = 256 * MIB
    """The lengths of the large frames (64 KiB and more) being received, all connections
    together. A connection whose frame would go past it waits, its frame timeout running, until
    others' frames have arrived. Memory follows the bytes that arrive, so this is an upper
    bound; each connection may also hold up to 64 KiB of smaller frames."""


class ByteBudget:
    """The lengths of the large frames all connections of a server may be receiving at once.

    A frame takes its whole length before its bytes are read and gives it back when complete,
    so no two frames can each hold part of the budget while waiting for the rest. `acquire`
    waits while the budget is spent; a frame longer than the whole budget is let through when
    nothing else is held, so no frame the caps allow can wait forever."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._released = trio.Event()

    def try_acquire(self, n: int) -> bool:
        if self.used > 0 and self.used + n > self.capacity:
            return False
        self.used += n
        return True

    async def acquire(self, n: int) -> None:
        while not self.try_acquire(n):
            await self._released.wait()

    def release(self, n: int) -> None:
        if n:
            self.used -= n
            self._released.set()
            self._released = trio.Event()


class Refused(Exception):
    """An authenticated connection refused (the message says why): over a cap, or, when
    `permanent`, a key the listener will never admit (a private run's list)."""

    def __init__(self, reason: str, *, permanent: bool = False) -> None:
        super().__init__(reason)
        self.permanent = permanent


class Admission:
    """The connection caps of one listening socket (see the module docstring)."""

    def __init__(self, limits: ConnectionLimits, drops: DropLog) -> None:
        self.limits = limits
        self.drops = drops
        self._pending: dict[trio.CancelScope, str] = {}  # insertion order: oldest first
        self._pending_by_address: Counter[str] = Counter()
        self._established_by_address: Counter[str] = Counter()
        self.established = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    @contextmanager
    def pending_connection(self, address: str) -> Iterator[trio.CancelScope]:
        """Holds a pending slot for the block; the block is cancelled if the connection is
        evicted to admit a newer one (check `scope.cancelled_caught`)."""
        limits = self.limits
        if self._pending_by_address[address] >= limits.max_pending_per_address:
            self._evict(next(s for s, a in self._pending.items() if a == address), "per address")
        if len(self._pending) >= limits.max_pending:
            self._evict(next(iter(self._pending)), "in total")
        with trio.CancelScope() as scope:
            self._pending[scope] = address
            self._pending_by_address[address] += 1
            try:
                yield scope
            finally:
                self._leave_pending(scope)

    def _evict(self, scope: trio.CancelScope, which: str) -> None:
        address = self._pending[scope]
        self._leave_pending(scope)
        scope.cancel()
        self.drops.note(
            "evicted",
            f"pending connections full ({which}): closed the oldest, from {address}",
            logging.INFO,
        )

    def _leave_pending(self, scope: trio.CancelScope) -> None:
        address = self._pending.pop(scope, None)
        if address is not None:
            self._pending_by_address[address] -= 1
            if not self._pending_by_address[address]:
                del self._pending_by_address[address]

    @contextmanager
    def established_connection(self, address: str, *, replacing: bool) -> Iterator[None]:
        """Holds an authenticated slot for the block; raises `Refused` when a cap is reached
        (`replacing`: the identity already has a connection, which this one replaces)."""
        limits = self.limits
        if not replacing:
            if self.established >= limits.max_connections:
                raise Refused(f"{self.established} connections: the server is full")
            if self._established_by_address[address] >= limits.max_connections_per_address:
                raise Refused(f"{limits.max_connections_per_address} connections from {address}")
        self.established += 1
        self._established_by_address[address] += 1
        try:
            yield
        finally:
            self.established -= 1
            self._established_by_address[address] -= 1
            if not self._established_by_address[address]:
                del self._established_by_address[address]


def peer_address(stream: trio.SocketStream) -> tuple[str, str]:
    """(remote address, `host:port`) of an accepted connection."""
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?", "?"
    return str(host), f"{host}:{port}"
