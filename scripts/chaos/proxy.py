"""A TCP proxy the chaos harness controls: latency, bandwidth limits and partitions per link.

Every link the harness wants to disturb (a client's coordinator connection, the data server, a
client's libp2p and blob listeners) gets a `Proxy` listening where the dialer is told to connect
and forwarding to the real listener. A connection is attributed to the process that dialed it
(`SourceMap`: the socket's owner found through /proc), so a rule can name both ends of a link:
`net.set(Rule(latency=1.0), src="client-2", dst="server")`, `net.partition("client-3")`.

Rules are read for every chunk, so a change applies to open connections at once; `partition`
also resets the affected connections, as a lost route would.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

logger = logging.getLogger("chaos.proxy")

ANY = "*"
CHUNK = 64 * 1024


@dataclass(frozen=True)
class Rule:
    """One direction of a link: `latency` seconds added to every chunk, at most `bandwidth`
    bytes per second (None: unlimited), `blocked` refuses and resets connections."""

    latency: float = 0.0
    bandwidth: float | None = None
    blocked: bool = False


CLEAR = Rule()


class SourceMap:
    """Which known process owns the local end of a loopback connection (Linux /proc)."""

    def __init__(self) -> None:
        self.pids: dict[int, str] = {}

    def register(self, pid: int, name: str) -> None:
        self.pids[pid] = name

    def forget(self, pid: int) -> None:
        self.pids.pop(pid, None)

    def owner(self, peer: tuple[str, int], local: tuple[str, int]) -> str:
        inode = _socket_inode(peer, local)
        if inode is None:
            return "?"
        target = f"socket:[{inode}]"
        for pid, name in list(self.pids.items()):
            fd_dir = f"/proc/{pid}/fd"
            with contextlib.suppress(OSError):
                for fd in os.listdir(fd_dir):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"{fd_dir}/{fd}") == target:
                            return name
        return "?"


def _hex_endpoint(addr: tuple[str, int]) -> str:
    packed = socket.inet_aton(addr[0])
    return f"{int.from_bytes(packed, 'little'):08X}:{addr[1]:04X}"


def _socket_inode(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The inode of the dialer's socket: local address `peer`, remote address `local`."""
    want_local, want_remote = _hex_endpoint(peer), _hex_endpoint(local)
    with contextlib.suppress(OSError), open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            if parts[1] == want_local and parts[2] == want_remote:
                return int(parts[9])
    return None


@dataclass(eq=False)
class _Conn:
    src: str
    dst: str
    scope: trio.CancelScope
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass
class ProxyNet:
    """Rules for every proxied link, and the open connections to enforce them on."""

    sources: SourceMap = field(default_factory=SourceMap)
    rules: dict[tuple[str, str], Rule] = field(default_factory=dict)
    conns: set[_Conn] = field(default_factory=set)
    accepted: int = 0
    refused: int = 0
    refused_from: dict[str, int] = field(default_factory=dict)
    """Connections refused (blocked, or nothing listening behind the proxy) per source."""

    def set(self, rule: Rule, *, src: str = ANY, dst: str = ANY, both: bool = True) -> None:
        """The rule for traffic from `src` to `dst` (and back, with `both`)."""
        for key in [(src, dst), (dst, src)] if both else [(src, dst)]:
            if rule == CLEAR:
                self.rules.pop(key, None)
            else:
                self.rules[key] = rule
        if rule.blocked:
            self._reset(lambda c: _matches(c, src, dst, both))

    def clear(self) -> None:
        self.rules.clear()

    def partition(self, name: str, *, others: Iterable[str] | None = None) -> None:
        """Cut `name` off from `others` (default: everyone) in both directions."""
        for other in others if others is not None else [ANY]:
            self.set(Rule(blocked=True), src=name, dst=other)

    def heal(self, name: str, *, others: Iterable[str] | None = None) -> None:
        for other in others if others is not None else [ANY]:
            self.set(CLEAR, src=name, dst=other)

    def refuse(self, src: str) -> None:
        self.refused += 1
        self.refused_from[src] = self.refused_from.get(src, 0) + 1

    def rule(self, src: str, dst: str) -> Rule:
        for key in ((src, dst), (src, ANY), (ANY, dst), (ANY, ANY)):
            found = self.rules.get(key)
            if found is not None:
                return found
        return CLEAR

    def _reset(self, which: Callable[[_Conn], bool]) -> None:
        for conn in list(self.conns):
            if which(conn):
                conn.scope.cancel()


def _matches(conn: _Conn, src: str, dst: str, both: bool) -> bool:
    def one(a: str, b: str) -> bool:
        return (a in (ANY, conn.src)) and (b in (ANY, conn.dst))

    return one(src, dst) or (both and one(dst, src))


class _Pacer:
    """Releases each chunk `latency` after it arrived, no faster than `bandwidth`."""

    def __init__(self) -> None:
        self.next_free = 0.0

    async def wait(self, arrived: float, size: int, rule: Rule) -> None:
        release = arrived + rule.latency
        if rule.bandwidth:
            start = max(release, self.next_free)
            self.next_free = start + size / rule.bandwidth
            release = self.next_free
        delay = release - trio.current_time()
        if delay > 0:
            await trio.sleep(delay)


@dataclass
class Proxy:
    """Listens on `listen` (host, port) and forwards every connection to `target`; `dst` names
    the process behind it for the rules."""

    net: ProxyNet
    dst: str
    target: tuple[str, int]
    listen: tuple[str, int] = ("127.0.0.1", 0)

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.listen[1], host=self.listen[0])
        port = listeners[0].socket.getsockname()[1]
        self.listen = (self.listen[0], port)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started(port)

    async def _handle(self, inbound: trio.SocketStream) -> None:
        peer = inbound.socket.getpeername()
        local = inbound.socket.getsockname()
        src = self.net.sources.owner((peer[0], peer[1]), (local[0], local[1]))
        net = self.net
        if net.rule(src, self.dst).blocked or net.rule(self.dst, src).blocked:
            net.refuse(src)
            await _abort(inbound)
            return
        try:
            outbound = await trio.open_tcp_stream(*self.target)
        except OSError:
            net.refuse(src)
            await _abort(inbound)
            return
        net.accepted += 1
        with trio.CancelScope() as scope:
            conn = _Conn(src, self.dst, scope)
            net.conns.add(conn)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, inbound, outbound, src, self.dst, conn, True)
                    nursery.start_soon(self._pump, outbound, inbound, self.dst, src, conn, False)
            finally:
                net.conns.discard(conn)
        # Cancelled by a partition: reset both sides (RST), as a lost route would.
        await _abort(inbound)
        await _abort(outbound)

    async def _pump(
        self,
        source: trio.SocketStream,
        sink: trio.SocketStream,
        src: str,
        dst: str,
        conn: _Conn,
        up: bool,
    ) -> None:
        send, receive = trio.open_memory_channel[tuple[float, bytes]](math.inf)
        pacer = _Pacer()

        async def deliver() -> None:
            async for arrived, data in receive:
                await pacer.wait(arrived, len(data), self.net.rule(src, dst))
                try:
                    await sink.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    conn.scope.cancel()
                    return
                if up:
                    conn.bytes_up += len(data)
                else:
                    conn.bytes_down += len(data)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await sink.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(deliver)
            try:
                while True:
                    data = await source.receive_some(CHUNK)
                    if not data:
                        break
                    if self.net.rule(src, dst).blocked:
                        conn.scope.cancel()
                        return
                    send.send_nowait((trio.current_time(), data))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                conn.scope.cancel()
            finally:
                send.close()


async def _abort(stream: trio.SocketStream) -> None:
    """Close with a reset (SO_LINGER 0), so the other side sees the link fail, not a clean EOF."""
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        await stream.aclose()
