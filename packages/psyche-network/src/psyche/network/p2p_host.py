"""The libp2p host: TCP + Noise + Yamux, keyed by the node's identity, gated by the allowlist.

py-libp2p 0.8.1 (pinned) has no peer-id connection gate (its `ConnectionGate` filters IPs), so
the swarm's `add_conn`, which runs right after the Noise handshake has authenticated the remote
peer id (and the muxer is negotiated), is wrapped: a connection from a peer outside the
allowlist is closed before any protocol (gossip, model sharing, ping) sees it. This is
upstream's `AllowlistHook` (reject after handshake) in libp2p terms.

The other bounds py-libp2p does not offer in a usable form are added the same way (`harden`
installs them all): `install_inbound_limits` caps the connections still in their security and
muxer upgrade, per remote address and in total, evicting the oldest as the other listening
sockets do (`psyche.transport`), and gives back the swarm's inbound slot when an
inbound connection closes (py-libp2p holds it until the swarm stops); `install_stream_limits`
caps the inbound streams one peer may hold open (and all peers together), resetting any
beyond. Refusals are logged through one `DropLog` per host: the first of each kind in 10 s,
the rest as one summary line.

Every slot these hold is released in a `finally` or a `with`, whatever raises. The hosts run
without py-libp2p's own resource manager (`build_host`): its connection slots leaked whenever
an upgrade was cancelled (its cleanup awaits a close that raises `Cancelled` before it releases
the slot: an evicted pending upgrade, a dial that lost its race), and whenever the allowlist
refused a connection (the slot it attached to the connection is released only by a connection
the swarm registered); 1000 leaked slots and the host refused every connection, inbound and
outbound. Its caps are the ones above, and `ConnectionConfig`'s (total, per peer).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, runtime_checkable

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.host.ping import PING_LENGTH
from libp2p.network import swarm as libp2p_swarm
from libp2p.network.config import ConnectionConfig
from libp2p.network.exceptions import SwarmException
from libp2p.network.stream.exceptions import StreamEOF, StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import (
    FLAG_SYN,
    TYPE_PING,
    YAMUX_HEADER_FORMAT,
    Yamux,
    YamuxStream,
)

from psyche.core.drop_log import DropLog
from psyche.core.identity import SecretKey
from psyche.network.identity import (
    IdentityError,
    fmt_short,
    libp2p_key_pair,
    peer_id_from_public_key,
    public_key_from_peer_id,
)
from psyche.transport import Admission, ConnectionLimits

logger = logging.getLogger(__name__)

# py-libp2p logs every failed TCP dial as an error. Behind NAT, dialing a peer's private address
# first and then its relay is the normal course; `NetworkConnection.connect` reports a peer it
# cannot reach at all.
logging.getLogger("libp2p.transport.tcp.tcp").setLevel(logging.CRITICAL)

LIBP2P_LOG_INTERVAL_SECS = 10.0
LIBP2P_LOG_KINDS_KEPT = 1024


class RateLimitedLog(logging.Filter):
    """At most `burst` records of one kind (its logger and message template) pass per
    `interval`; the others are counted, and the first that passes after the interval says how
    many were left out. Guaranteed for every logger it is on: however often a peer makes it
    log, a kind costs at most `burst` lines per interval.

    py-libp2p logs per message and per RPC in places a peer drives (a pending queue that
    overflows on every publish, an RPC with a bad signed record, a stream that fails to
    open), some at WARNING or ERROR: measured, one publish per round to a peer that never
    subscribes (a relay) logged a warning on every publish for the whole run. Thread-safe
    (py-libp2p logs from its own threads too); at most `LIBP2P_LOG_KINDS_KEPT` kinds are
    remembered (py-libp2p formats some messages itself, so every peer is a kind). A record
    that reports a trio cancellation as a failure never passes (`_reports_a_cancellation`)."""

    def __init__(
        self,
        interval: float = LIBP2P_LOG_INTERVAL_SECS,
        burst: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.interval = interval
        self.burst = burst
        self._clock = clock
        self._kinds: dict[tuple[str, str], tuple[float, int, int]] = {}
        """(logger, template) -> (interval start, records passed, records left out)"""
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if _reports_a_cancellation(record):
            return False
        key = (record.name, str(record.msg))
        now = self._clock()
        with self._lock:
            since, passed, left_out = self._kinds.get(key, (now, 0, 0))
            if now - since >= self.interval:
                if left_out:
                    record.msg = (
                        f"{record.msg} ({left_out} more like this in the last "
                        f"{now - since:.0f} s not logged)"
                    )
                since, passed, left_out = now, 0, 0
            if passed >= self.burst:
                self._kinds[key] = (since, passed, left_out + 1)
                return False
            if key not in self._kinds and len(self._kinds) >= LIBP2P_LOG_KINDS_KEPT:
                self._kinds.clear()
            self._kinds[key] = (since, passed + 1, left_out)
            return True


def _reports_a_cancellation(record: logging.LogRecord) -> bool:
    """Whether `record` reports a trio cancellation as a failure. py-libp2p 0.8.1's
    `Swarm.add_conn` logs any `BaseException`, `trio.Cancelled` included, as a warning with
    its traceback in the message: a client stopped by SIGINT or SIGTERM while a connection was
    being set up printed a traceback on its way out. A cancellation is how a stop reaches a
    task, not a fault, so such records are not logged."""
    exc_info = record.exc_info[1] if record.exc_info else None
    args = record.args if isinstance(record.args, tuple) else ()
    return any(isinstance(a, trio.Cancelled) for a in (exc_info, *args))


_libp2p_log_limit = RateLimitedLog()


def _is_libp2p(name: str) -> bool:
    return name == "libp2p" or name.startswith("libp2p.")


class _LimitedLoggers(logging.Logger):
    """The logger class from `limit_libp2p_logs` on: a py-libp2p logger made later (some of
    its modules are imported only when first used) gets `RateLimitedLog` too."""

    def __init__(self, name: str, level: int = logging.NOTSET) -> None:
        super().__init__(name, level)
        if _is_libp2p(name):
            self.addFilter(_libp2p_log_limit)


def limit_libp2p_logs() -> None:
    """Put `RateLimitedLog` on every py-libp2p logger, those there are and those made later (a
    logger's filters see only its own records, not its children's, so each gets it);
    idempotent. `build_host` calls it."""
    if logging.getLoggerClass() is logging.Logger:
        logging.setLoggerClass(_LimitedLoggers)
    for name in [n for n in logging.root.manager.loggerDict if _is_libp2p(n)]:
        log = logging.getLogger(name)
        if _libp2p_log_limit not in log.filters:
            log.addFilter(_libp2p_log_limit)


AllowFn = Callable[[bytes], bool]


MAX_CONNECTIONS = 1024
DIAL_TIMEOUT_SECS = 5.0
PING_TIMEOUT_SECS = 5.0
"""One ping (`measure_rtt`)."""
DIRECT_HEAD_START_SECS = 1.5
"""A direct dial's lead over the relayed one when a peer announces both."""
MAX_INBOUND_STREAMS_PER_PEER = 256
MAX_INBOUND_STREAMS = 8192
INBOUND_UPGRADE_LIMITS = ConnectionLimits(max_pending=64, max_pending_per_address=8)
"""Connections in their Noise + Yamux upgrade (py-libp2p's own timeout ends each after 10 s)."""


def build_host(
    secret_key: SecretKey, bind_host: str = "0.0.0.0", announce_host: str | None = None
) -> IHost:
    """TCP only, Noise only, Yamux (py-libp2p's default muxer); QUIC, TLS and SECIO are off.

    Which peers to connect to is Psyche's decision (the run's clients, a few gossip bootstrap
    peers), so py-libp2p's auto-dialer, which dials every peer in its peerstore up to 150
    connections, is switched off, and pruning only starts above upstream's 1024 connections.

    What the host advertises (identify, hole punching) is its listen addresses with the
    wildcard address replaced by `announce_host` (else py-libp2p hands peers `0.0.0.0`, which
    they dial as their own machine); addresses others observed us at are not advertised (the
    port a NAT mapped for one connection is no address to dial; DCUtR predicts its own).

    py-libp2p's loggers get `RateLimitedLog` (`limit_libp2p_logs`): none of its records can
    repeat per message a peer sends or per message published.
    """
    batch_window_updates()
    end_dials_when_their_attempts_end()
    limit_libp2p_logs()
    key_pair = libp2p_key_pair(secret_key)
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_preference="YAMUX",
        enable_tcp=True,
        enable_quic=False,
        enable_mDNS=False,
        enable_upnp=False,
        addrs_factory=partial(_advertised, bind_host, announce_host or bind_host),
        connection_config=ConnectionConfig(
            max_connections=MAX_CONNECTIONS,
            high_watermark=MAX_CONNECTIONS,
            low_watermark=0,
            min_connections=0,
            dial_timeout=DIAL_TIMEOUT_SECS,
        ),
    )

    async def no_auto_connect() -> None:
        return None

    swarm: Any = host.get_network()
    # py-libp2p's INetwork does not declare the auto_connector its Swarm has.
    swarm.auto_connector.maybe_connect = no_auto_connect
    # Its default resource manager leaks a connection slot on every cancelled upgrade and every
    # refused peer (module docstring); the host's own caps replace it.
    swarm.set_resource_manager(None)
    return host


LIBP2P_SET_UP_TIMEOUTS = (
    "inbound_upgrade_timeout",
    "outbound_upgrade_timeout",
    "inbound_stream_protocol_negotiation_timeout",
    "outbound_stream_protocol_negotiation_timeout",
)
"""py-libp2p's timeouts of a connection's upgrade (security, muxer) and of a stream's
protocol negotiation (10 s each), which it reads from the swarm's `ConnectionConfig` each
time it uses them."""


def stretch_set_up_timeouts(host: IHost, stretch: Callable[[float], float]) -> None:
    """Set py-libp2p's `LIBP2P_SET_UP_TIMEOUTS` to `stretch(base)`, `base` being each one's
    value the first time this is called (the network calls it after each sample of its
    event loop's lateness: `loop_lag.LoopLag.stretch`, bounded). A starved process sees a
    peer's answers late at every hop; measured (64 nodes, 4 to a process, loops 0.4 s late
    median, seconds at p99), 1,828 stream negotiations (identify, gossip) timed out at 10 s
    on connections that were alive, and each was tried again."""
    config: Any = getattr(host.get_network(), "connection_config", None)
    if config is None:
        return
    base: dict[str, float] | None = getattr(config, _BASE_TIMEOUTS, None)
    if base is None:
        base = {name: float(getattr(config, name)) for name in LIBP2P_SET_UP_TIMEOUTS}
        setattr(config, _BASE_TIMEOUTS, base)
    for name, secs in base.items():
        setattr(config, name, stretch(secs))


_BASE_TIMEOUTS = "psyche_base_set_up_timeouts"


async def _credit_window_when_half_consumed(self: YamuxStream, *, bytes_read: int = 0) -> None:
    """go-yamux's `sendWindowUpdate` rule (rust-yamux's too), py-libp2p's window auto-tuning
    kept: credit the receive window back once at least half of it has been consumed, in one
    WINDOW_UPDATE, and never otherwise.

    py-libp2p 0.8.1 also credits "partial slack" and, by default, every read
    (`PY_YAMUX_RELEASE_ON_READ`), and its readers read one length-prefixed message in several
    reads: measured in the swarm bench (16 nodes), **392 window updates against 147 data
    frames** written per node per round (95 with the per-read credit off, the partial slack
    left), each one a Noise message to encrypt, send, receive, decrypt and dispatch through
    trio on both sides. The window (256 KiB, growing by auto-tuning) is far larger than any
    gossip, peer-exchange or request message, so those now send none; a bulk transfer still
    gets its credit every half window. The frames on the wire are the same kinds, only fewer,
    as go-yamux peers send them."""
    total = 0
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        consumed = self.target_recv_window - (self.recv_window + buffered)
        if consumed > 0 and consumed >= self._grow_threshold():
            total = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
            self._pending_recv_release = 0
    if total > 0:
        await self.send_window_update(total, skip_lock=True)


def batch_window_updates() -> None:
    """Install `_credit_window_when_half_consumed` as every Yamux stream's credit rule (py-libp2p
    calls it after each read; idempotent)."""
    setattr(YamuxStream, _YAMUX_CREDIT_HOOK, _credit_window_when_half_consumed)


_YAMUX_CREDIT_HOOK = "_auto_tune_and_send_window_update"
"""The `YamuxStream` method py-libp2p 0.8.1 calls after each read (a private name of the
pinned version)."""


def end_dials_when_their_attempts_end() -> None:
    """Stop py-libp2p's dial loop from waiting 0.25 s after its last address (idempotent).

    `Swarm.dial_peer` (0.8.1) starts a dial to one address, then waits `_HAPPY_EYEBALLS_DELAY`
    (0.25 s) or until that dial has *failed* before the next address, and it waits after the
    last address too: a dial that succeeds in 5 ms returns after 250 ms, unless the peer's
    connection cap (`max_connections_per_peer`) is reached first. Every dial, a joiner's to its
    model providers and a client's to each gossip neighbour, paid it.

    The cap is not the lever: at 1, `add_conn` trims a peer's older connection whenever a
    second one arrives, and a client keeps a relayed connection beside a hole-punched direct
    one on purpose (`reachability`: the fallback path a stalled fetch moves to). With the delay
    at 0 a dial returns when its attempts are over; what it attempts is unchanged: it picks at
    most one address per transport class (ours: TCP, and a circuit address once one is in the
    peerstore), and a circuit address it also dials was dialed 0.25 s after a successful TCP
    one before as well (the cap of 3 did not stop it), now at once. `connect` still gives the
    direct path its head start over the relay (`DIRECT_HEAD_START_SECS`)."""
    setattr(libp2p_swarm, _HAPPY_EYEBALLS_DELAY, 0.0)


_HAPPY_EYEBALLS_DELAY = "_HAPPY_EYEBALLS_DELAY"
"""`libp2p.network.swarm`'s wait between dial attempts (a private name of the pinned version)."""


def _advertised(
    bind_host: str, announce: str, candidates: list[multiaddr.Multiaddr]
) -> list[multiaddr.Multiaddr]:
    out: list[multiaddr.Multiaddr] = []
    for addr in candidates:
        parts = str(addr).split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            if parts[2] not in ("0.0.0.0", bind_host):
                continue  # an address a peer observed us at
            parts[2] = announce
            addr = multiaddr.Multiaddr("/".join(parts))
        if addr not in out:
            out.append(addr)
    return out


def peer_key(peer_id: ID) -> bytes | None:
    """The Psyche identity behind a libp2p peer id, or None for a non-ed25519 peer."""
    try:
        return public_key_from_peer_id(peer_id)
    except IdentityError:
        return None


def drop_log() -> DropLog:
    """Where a host logs what it refuses and drops (run its `run` for the periodic summary)."""
    return DropLog(logger, "libp2p host: refused or dropped connections")


def harden(host: IHost, allowed: AllowFn, drops: DropLog | None = None) -> DropLog:
    """Every bound of this module on `host`: the allowlist gate, the inbound upgrade caps and
    the per-peer stream caps, logged through `drops` (a new `drop_log()` if None), which is
    returned."""
    drops = drops or drop_log()
    install_allowlist_gate(host, allowed, drops)
    install_inbound_limits(host, drops=drops)
    install_stream_limits(host)
    return drops


def install_allowlist_gate(host: IHost, allowed: AllowFn, drops: DropLog) -> None:
    """Close a connection from a peer `allowed` refuses before the swarm registers it; logged
    through `drops`, so a flood of strangers logs one line per interval.

    The gate is the swarm's `add_conn`, after the muxer, not the security step right after
    Noise: a refusal there would fail the dialer's muxer negotiation, which py-libp2p counts as
    a failed dial and blocks the peer for 60 s (its negative cache), so a member refused once
    (a peer that had not yet heard it joined) could not connect for a minute."""
    swarm: Any = host.get_network()
    add_conn = swarm.add_conn

    async def gated_add_conn(muxed_conn: Any, direction: str = "unknown") -> Any:
        key = peer_key(muxed_conn.peer_id)
        if key is None or not allowed(key):
            drops.note(
                "not in allowlist",
                f"refusing {direction} connection from {muxed_conn.peer_id}: not in allowlist",
                logging.INFO,
            )
            with contextlib.suppress(Exception):
                await muxed_conn.close()
            raise SwarmException("not in allowlist")
        return await add_conn(muxed_conn, direction)

    swarm.add_conn = gated_add_conn


class _Inbound:
    """One inbound connection's handler: the raw stream it upgrades, and the muxed connection
    once the upgrade succeeded."""

    __slots__ = ("muxed", "stream", "upgraded")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.muxed: Any = None
        self.upgraded = trio.Event()


def install_inbound_limits(
    host: IHost,
    limits: ConnectionLimits = INBOUND_UPGRADE_LIMITS,
    drops: DropLog | None = None,
) -> DropLog:
    """Cap the inbound connections still being upgraded (security, then muxer): per remote
    address and in total, the oldest evicted when full; and end each inbound connection's
    handler when its connection closes. Returns the drop log (run its `run` for the periodic
    summary).

    py-libp2p's handler of an inbound connection holds one of the swarm's inbound slots
    (`max_connections` of them) and, once the upgrade succeeded, waits for the swarm to stop:
    every inbound connection ever accepted kept its slot, and after `max_connections` of them
    (members reconnecting over a long run) the host refused every inbound connection. The
    handler is ended here when its connection closes, which releases the slot."""
    swarm: Any = host.get_network()
    upgrade = swarm.upgrade_inbound_raw_conn
    handle = swarm._do_handle_inbound_connection
    drops = drops or drop_log()
    admission = Admission(limits, drops)
    handlers: dict[int, _Inbound] = {}

    async def limited_upgrade(raw_conn: Any, maddr: Any) -> Any:
        try:
            remote = raw_conn.get_remote_address()
        except Exception:
            remote = None
        address = str(remote[0]) if remote else "relayed"
        with admission.pending_connection(address) as pending:
            muxed = await upgrade(raw_conn, maddr)
            inbound = handlers.get(id(getattr(raw_conn, "stream", None)))
            if inbound is not None and inbound.stream is raw_conn.stream:
                inbound.muxed = muxed
                inbound.upgraded.set()
            return muxed
        if pending.cancelled_caught:  # evicted for a newer connection
            with contextlib.suppress(Exception):
                await raw_conn.close()
        raise SwarmException(f"inbound upgrade from {address} evicted")

    async def handle_until_closed(read_write_closer: Any, maddr: Any, failure_event: Any) -> None:
        inbound = _Inbound(read_write_closer)
        handlers[id(read_write_closer)] = inbound
        try:
            async with trio.open_nursery() as nursery:

                async def end_when_closed() -> None:
                    await inbound.upgraded.wait()
                    closed = getattr(inbound.muxed, "event_closed", None)
                    if closed is not None:  # Yamux (the only muxer these hosts use)
                        await closed.wait()
                        nursery.cancel_scope.cancel()

                nursery.start_soon(end_when_closed)
                await handle(read_write_closer, maddr, failure_event)
                nursery.cancel_scope.cancel()
        finally:
            del handlers[id(read_write_closer)]

    swarm.upgrade_inbound_raw_conn = limited_upgrade
    swarm._do_handle_inbound_connection = handle_until_closed
    swarm.psyche_inbound_admission = admission
    return drops


def install_stream_limits(
    host: IHost,
    per_peer: int = MAX_INBOUND_STREAMS_PER_PEER,
    total: int = MAX_INBOUND_STREAMS,
) -> None:
    """Reset inbound streams beyond `per_peer` open at once from one peer, or `total` from
    all peers together (before protocol negotiation, so a refused stream costs nothing)."""
    swarm: Any = host.get_network()
    handle = swarm.common_stream_handler
    open_streams: dict[Any, int] = {}
    counts = {"total": 0, "refused": 0}

    async def limited(stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        if open_streams.get(peer, 0) >= per_peer or counts["total"] >= total:
            counts["refused"] += 1
            if counts["refused"] == 1 or counts["refused"] % 1000 == 0:
                logger.warning(
                    "refusing inbound streams from %s: %d open (%d refused so far)",
                    peer,
                    open_streams.get(peer, 0),
                    counts["refused"],
                )
            await reset_quietly(stream)
            return
        open_streams[peer] = open_streams.get(peer, 0) + 1
        counts["total"] += 1
        try:
            await handle(stream)
        finally:
            counts["total"] -= 1
            open_streams[peer] -= 1
            if not open_streams[peer]:
                del open_streams[peer]

    swarm.common_stream_handler = limited
    swarm.psyche_stream_counts = counts


class ConnectionNotifee(INotifee):
    """Forwards connection events to plain callbacks (the connection monitor)."""

    def __init__(
        self,
        on_connected: Callable[[bytes, str], None],
        on_disconnected: Callable[[bytes], None],
    ) -> None:
        self._on_connected = on_connected
        self._on_disconnected = on_disconnected

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        key = peer_key(conn.muxed_conn.peer_id)
        if key is not None:
            self._on_connected(key, _remote_addr(conn))

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        key = peer_key(conn.muxed_conn.peer_id)
        if key is not None and not network.get_connections(conn.muxed_conn.peer_id):
            self._on_disconnected(key)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


@runtime_checkable
class _RemoteAddressed(Protocol):
    """What py-libp2p's muxers have and its IMuxedConn does not declare."""

    def get_remote_address(self) -> tuple[str, int] | None: ...


def _remote_addr(conn: INetConn) -> str:
    muxed = conn.muxed_conn
    try:
        remote = muxed.get_remote_address() if isinstance(muxed, _RemoteAddressed) else None
    except Exception:
        remote = None
    return f"{remote[0]}:{remote[1]}" if remote else "?"


def is_relayed(conn: Any) -> bool:
    """Whether a (muxed or swarm) connection runs through a relay (`/p2p-circuit`)."""
    try:
        addrs = conn.get_transport_addresses() or []
    except Exception:
        return False
    return any("/p2p-circuit" in str(a) for a in addrs)


def connection_paths(host: IHost, peer: bytes) -> list[str]:
    """`direct` or `relayed` for each open connection to `peer`."""
    conns = host.get_network().get_connections(peer_id_from_public_key(peer))
    return ["relayed" if is_relayed(c) else "direct" for c in conns]


def connections_on(host: IHost, peer: bytes, path: str) -> list[INetConn]:
    """The open connections to `peer` that are `direct` or `relayed`."""
    conns = host.get_network().get_connections(peer_id_from_public_key(peer))
    return [c for c in conns if ("relayed" if is_relayed(c) else "direct") == path]


async def new_stream_on(
    host: IHost, conn: INetConn, protocols: list[TProtocol], timeout: float = DIAL_TIMEOUT_SECS
) -> INetStream:
    """A stream on this very connection (`host.new_stream` picks one itself: a direct one over
    a relayed one), its protocol negotiated as `host.new_stream` does."""
    from libp2p.protocol_muxer.multiselect_client import MultiselectClient
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

    with trio.fail_after(timeout):
        stream = await conn.new_stream()
        try:
            protocol = await MultiselectClient().select_one_of(
                protocols, MultiselectCommunicator(stream), int(max(1, timeout))
            )
        except BaseException:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.reset()
            raise
    stream.set_protocol(protocol)
    return stream


async def close_connections(conns: list[INetConn]) -> None:
    for conn in conns:
        try:
            await conn.close()
        except Exception as e:
            logger.debug("closing a connection: %s", e)


def listen_multiaddr(host: str, port: int) -> multiaddr.Multiaddr:
    return multiaddr.Multiaddr(f"/ip4/{host}/tcp/{port}")


def transport_addrs(host: IHost, announce: str) -> list[str]:
    """Listening multiaddrs without `/p2p`, their IPv4 host replaced by `announce` (the bound
    address itself unless an announce override, e.g. a NAT's public IP, says otherwise; the
    blob side channel announces the same host)."""
    out = []
    for addr in host.get_transport_addrs():
        parts = str(addr).split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            parts[2] = announce
        out.append("/".join(parts))
    return out


CircuitDialFn = Callable[[str, bytes], Awaitable[None]]


def is_circuit(addr: str) -> bool:
    return "/p2p-circuit" in addr


async def connect(
    host: IHost, peer: bytes, addrs: list[str], dial_circuit: CircuitDialFn | None = None
) -> None:
    """Connect to `peer`: its direct addresses first and, when it also announces relayed ones
    (`…/p2p-circuit`) and `dial_circuit` can use them, through a relay after
    `DIRECT_HEAD_START_SECS` (or at once when the direct dial has failed). The first
    connection made wins; the other attempts are cancelled."""
    peer_id = peer_id_from_public_key(peer)
    if host.get_network().get_connections(peer_id):
        return
    direct = [multiaddr.Multiaddr(a) for a in addrs if not is_circuit(a)]
    relayed = [a for a in addrs if is_circuit(a)] if dial_circuit is not None else []
    if not relayed:
        await host.connect(PeerInfo(peer_id, direct))
        return
    errors: list[Exception] = []
    direct_over = trio.Event()

    async with trio.open_nursery() as nursery:

        async def attempt(dial: Callable[[], Awaitable[None]], after: trio.Event | None) -> None:
            if after is not None:
                with trio.move_on_after(DIRECT_HEAD_START_SECS):
                    await after.wait()
            try:
                await dial()
            except Exception as e:
                errors.append(e)
            else:
                nursery.cancel_scope.cancel()  # the first connection wins

        async def dial_direct() -> None:
            try:
                await host.connect(PeerInfo(peer_id, direct))
            finally:
                direct_over.set()

        if direct:
            nursery.start_soon(attempt, dial_direct, None)
        else:
            direct_over.set()
        for addr in relayed:
            assert dial_circuit is not None
            nursery.start_soon(attempt, partial(dial_circuit, addr, peer), direct_over)
    if not host.get_network().get_connections(peer_id):
        raise SwarmException(f"cannot reach {fmt_short(peer)}: {'; '.join(map(str, errors))}")


async def disconnect(host: IHost, peer: bytes) -> None:
    try:
        await host.disconnect(peer_id_from_public_key(peer))
    except Exception as e:
        logger.debug("disconnect %s: %s", peer.hex()[:10], e)


async def close_all_connections(host: IHost) -> None:
    """Close every connection at once (the swarm closes them one by one), then the swarm."""
    swarm: Any = host.get_network()

    async def close(conn: Any) -> None:
        with contextlib.suppress(Exception):
            await conn.close()

    async with trio.open_nursery() as nursery:
        for conns in list(swarm.connections.values()):
            for conn in list(conns):
                nursery.start_soon(close, conn)
    await swarm.close()


def probed_connection(host: IHost, peer: bytes) -> INetConn:
    """The connection `measure_rtt` pings when given none: the peer's direct one, else a
    relayed one (ConnectionError when there is none)."""
    conns = host.get_network().get_connections(peer_id_from_public_key(peer))
    if not conns:
        raise ConnectionError(f"not connected to {fmt_short(peer)}")
    return sorted(conns, key=is_relayed)[0]


class _ReceiveClock:
    """A secure connection's `read`, wrapped to note when it last returned bytes: anything the
    peer sent (a data frame, a window update, a ping or its answer, however late)."""

    __slots__ = ("_read", "at")

    def __init__(self, read: Callable[..., Awaitable[bytes]]) -> None:
        self._read = read
        self.at = trio.current_time()

    async def __call__(self, n: int | None = None) -> bytes:
        data = await self._read(n)
        self.at = trio.current_time()
        return data


def _receive_clock(conn: INetConn) -> _ReceiveClock:
    muxed: Any = conn.muxed_conn  # IMuxedConn does not declare the `secured_conn` it has
    secured = muxed.secured_conn
    clock = secured.read
    if not isinstance(clock, _ReceiveClock):
        clock = _ReceiveClock(clock)
        # The muxer's reader looks `read` up on every frame, so it takes effect at once.
        secured.read = clock
    return clock


def watch_received(host: IHost, peer: bytes) -> None:
    """Start noting when each connection to `peer` last received anything (`silent_secs`);
    idempotent, so call it whenever a connection to the peer opens."""
    for conn in host.get_network().get_connections(peer_id_from_public_key(peer)):
        _receive_clock(conn)


def silent_secs(conn: INetConn) -> float:
    """Seconds since `conn` last received anything from its peer (since it was first watched,
    `watch_received`, when nothing came yet): QUIC's idle time, which upstream's connections
    close on, where an RTT probe's timeout only says the answer is late."""
    return trio.current_time() - _receive_clock(conn).at


async def measure_rtt(
    host: IHost, peer: bytes, timeout: float = PING_TIMEOUT_SECS, conn: INetConn | None = None
) -> float:
    """One round trip in seconds, timed here, on `conn` when given, else on the peer's direct
    connection (a relayed one if it has none).

    On a Yamux connection (every connection these hosts make) it is one Yamux ping frame,
    which the peer's muxer answers itself (as QUIC's path RTT, which upstream reads, costs no
    stream): py-libp2p's ping protocol opened a stream and negotiated it per probe, about a
    fifth of an idle node's CPU with a probe per peer every 5 s, and on a loaded machine the
    negotiation stalled where the muxer still answered. Other muxers get the ping protocol."""
    conn = conn or probed_connection(host, peer)
    muxed = conn.muxed_conn
    with trio.fail_after(timeout):
        if isinstance(muxed, Yamux):
            return await _yamux_ping(muxed)
        stream = await new_stream_on(host, conn, [PING_PROTOCOL_ID], timeout)
        try:
            payload = os.urandom(PING_LENGTH)
            start = trio.current_time()
            await stream.write(payload)
            echoed = await read_exactly(stream, PING_LENGTH)
            rtt = trio.current_time() - start
        finally:
            await stream.close()
    if echoed != payload:
        raise ValueError("ping payload mismatch")
    return rtt


PING_EVENT_RECHECK_SECS = 0.25
"""While a ping waits, how often it looks whether py-libp2p's own RTT loop replaced the muxer's
ping event (`_yamux_ping`)."""


async def _yamux_ping(muxed: Yamux) -> float:
    """A Yamux ping (SYN) and its answer (ACK), through the muxer's own ping bookkeeping: its
    reader sets the *current* `_ping_event` on any ACK.

    py-libp2p's RTT loop pings the same way every 30 s and replaces `_ping_event` with its own
    event. An answer that came after that set the loop's event, not ours, and the probe waited
    out its timeout on a live connection: the longer answers took (a loaded machine), the
    likelier, and two such probes in a row closed the connection (measured: 167 connections
    dropped in 3 minutes of a 16-node swarm at load 15, each one redialed, its gossip streams
    and mesh rebuilt). The wait follows whichever event is current: any ACK after our SYN
    answers it."""
    if muxed.event_shutting_down.is_set():
        raise ConnectionError("connection closed")
    answered = trio.Event()
    muxed._ping_event = answered
    muxed._ping_id += 1
    await muxed._write_frame(
        struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_PING, FLAG_SYN, 0, muxed._ping_id)
    )
    start = muxed._ping_sent_time = trio.current_time()
    while not answered.is_set():
        with trio.move_on_after(PING_EVENT_RECHECK_SECS):
            await answered.wait()
        answered = muxed._ping_event if not answered.is_set() else answered
    return trio.current_time() - start


async def read_exactly(stream: INetStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.read(n - len(buf))
        if not chunk:
            raise StreamEOF()
        buf += chunk
    return bytes(buf)


class ReadLimitExceeded(ValueError):
    pass


async def read_to_end(stream: INetStream, limit: int) -> bytes:
    """Everything until the peer half-closes; more than `limit` bytes is an error (upstream's
    `read_to_end(limit)`)."""
    buf = bytearray()
    while True:
        try:
            chunk = await stream.read(limit + 1 - len(buf))
        except StreamEOF:
            break
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise ReadLimitExceeded(f"more than {limit} bytes")
    return bytes(buf)


def protocol(name: str) -> TProtocol:
    return TProtocol(name)


async def reset_quietly(stream: INetStream) -> None:
    with contextlib.suppress(Exception):
        await stream.reset()


async def request(
    host: IHost, peer: bytes, protocol_name: str, data: bytes, response_limit: int
) -> bytes:
    """One exchange on a fresh stream to `peer`: write `data`, half-close, read the answer (at
    most `response_limit` bytes) until the peer closes."""
    stream = await host.new_stream(peer_id_from_public_key(peer), [protocol(protocol_name)])
    try:
        await stream.write(data)
        await stream.close()
        return await read_to_end(stream, response_limit)
    finally:
        await reset_quietly(stream)


async def stream_peer(stream: INetStream, allowed: AllowFn) -> bytes | None:
    """The remote key of an inbound stream if it may talk to us; otherwise the stream is reset
    and None returned (the protocol handlers' re-check of the allowlist)."""
    peer = peer_key(stream.muxed_conn.peer_id)
    if peer is None or not allowed(peer):
        await reset_quietly(stream)
        return None
    return peer


async def serve_member(
    stream: INetStream, allowed: AllowFn, what: str, handle: Callable[[], Awaitable[None]]
) -> None:
    """Run `handle()` on an inbound stream from a run member (others are reset unheard); when it
    fails (a malformed or hostile request, or the peer went away), the stream is reset and one
    line logged: `dropping <what> from <peer>`."""
    peer = await stream_peer(stream, allowed)
    if peer is None:
        return
    try:
        await handle()
    except Exception as e:
        logger.info("dropping %s from %s: %s", what, fmt_short(peer), e)
        await reset_quietly(stream)


__all__ = [
    "ConnectionNotifee",
    "ReadLimitExceeded",
    "StreamError",
    "build_host",
    "connect",
    "connection_paths",
    "disconnect",
    "drop_log",
    "harden",
    "install_allowlist_gate",
    "install_inbound_limits",
    "install_stream_limits",
    "is_circuit",
    "is_relayed",
    "limit_libp2p_logs",
    "listen_multiaddr",
    "measure_rtt",
    "peer_key",
    "probed_connection",
    "protocol",
    "read_exactly",
    "read_to_end",
    "request",
    "reset_quietly",
    "silent_secs",
    "stream_peer",
    "stretch_set_up_timeouts",
    "transport_addrs",
    "watch_received",
]
