"""A circuit relay (v2) for a run's members: what lets clients behind NAT reach each other.

py-libp2p 0.8.1's relay (`CircuitV2Protocol` with the hop role) on a host of its own, keyed by
the relay's identity and gated like every Psyche host: a connection from a peer that `allowed`
refuses is closed right after its Noise handshake, so only run members can reserve a slot, be
reached through one, or ask for anything else; the same host answers AutoNAT dial-back requests
(`reachability.DialBackAutoNAT`), so the members learn whether they are reachable at all.

    async with open_relay(secret_key, allowed=is_member, options=RelayOptions(port=4001)) as relay:
        print(relay.multiaddrs())  # what clients take as --iroh-relay

The centralized server runs one (`psyche-server run`, on by default, members = the run's
clients and the clients that sent it a Join); `psyche-server relay` runs one on its own for
Solana runs (members = its `--authorized-keys`). `allowed` is asked again every
`MEMBERSHIP_SWEEP_SECS`: a key it no longer allows loses its connections and its slot.

Bounds: at most `max_reservations` members hold a slot (`RelayOptions`), each reachable through
at most `max_circuits_per_peer` circuits at once; circuits have no time or byte limit of their
own (py-libp2p's defaults, 1 hour and 1 GiB, would cut a training run's connections); inbound
upgrades and streams per peer are capped as on every host (`p2p_host`); what a member sends on
the gossip streams the relay drains is capped per member (`GossipDrain`). Bytes pass through
the relay encrypted end to end (the two members' own Noise session runs inside the circuit).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.pubsub.gossipsub import PROTOCOL_ID as GOSSIP_V10
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as GOSSIP_V11
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.tools.anyio_service import background_trio_service

from psyche.core.drop_log import DropLog
from psyche.core.identity import SecretKey
from psyche.network import p2p_host
from psyche.network.identity import fmt_short
from psyche.network.interfaces import announce_host
from psyche.network.reachability import DialBackAutoNAT

logger = logging.getLogger(__name__)

DEFAULT_RELAY_PORT = 0
REPORT_INTERVAL_SECS = 10.0
SHUTDOWN_TIMEOUT_SECS = 5.0
MEMBERSHIP_SWEEP_SECS = 1.0
"""How often the relay asks `allowed` again about the peers connected to it."""
DRAIN_BURST_BYTES = 64 * 1024
DRAIN_BYTES_PER_SEC = 1024
"""What one member may send on the gossip streams the relay drains: a burst, then this rate. A
member's gossip to the relay is its subscription announcements (the relay subscribes to
nothing, so no message is ever sent to it): tens of bytes an epoch."""
DRAIN_READ_BYTES = 4096


@dataclass(frozen=True)
class RelayOptions:
    bind_host: str = "0.0.0.0"
    port: int = DEFAULT_RELAY_PORT
    announce_host: str | None = None
    """The address members dial (a public IP when the relay sits behind port forwarding)."""
    max_reservations: int = 1024
    max_circuits_per_peer: int = 64
    reservation_ttl_secs: int = 3600


def relay_limits(options: RelayOptions) -> RelayLimits:
    # duration 0: no time limit per circuit; the byte limit must be set (py-libp2p treats 0 as
    # "no bytes at all"), so it is set beyond anything a run moves.
    return RelayLimits(
        duration=0,
        data=1 << 62,
        max_circuit_conns=options.max_circuits_per_peer,
        max_reservations=options.max_reservations,
        reservation_ttl=options.reservation_ttl_secs,
    )


class Relay:
    def __init__(
        self,
        host: IHost,
        protocol: CircuitV2Protocol,
        announce: str,
        allowed: Callable[[bytes], bool],
        drops: DropLog,
    ) -> None:
        self.host = host
        self.protocol = protocol
        self.announce = announce
        self.allowed = allowed
        self.drops = drops
        self.gossip = GossipDrain(allowed, drops)

    @property
    def endpoint_id(self) -> bytes:
        from psyche.network.identity import public_key_from_peer_id

        return public_key_from_peer_id(self.host.get_id())

    def multiaddrs(self) -> list[str]:
        """Where members reach this relay, each ending in `/p2p/<relay id>`."""
        peer = self.host.get_id().to_base58()
        return [f"{a}/p2p/{peer}" for a in p2p_host.transport_addrs(self.host, self.announce)]

    def reservations(self) -> int:
        manager: Any = self.protocol.resource_manager
        manager._clean_expired()
        return len(manager._reservations)

    def circuits(self) -> int:
        return sum(1 for _, dst in self.protocol._active_relays.values() if dst is not None)

    async def enforce_membership(self) -> int:
        """Close the connections of every peer `allowed` no longer admits (a member that left
        the run) and drop its slot; returns how many peers were cut off."""
        swarm: Any = self.host.get_network()
        manager: Any = self.protocol.resource_manager
        leaving = [
            (peer_id, list(conns))
            for peer_id, conns in swarm.connections.items()
            if (key := p2p_host.peer_key(peer_id)) is None or not self.allowed(key)
        ]
        for peer_id, conns in leaving:
            manager._reservations.pop(peer_id, None)
            key = p2p_host.peer_key(peer_id)
            if key is not None:
                self.gossip.forget(key)
            logger.info("relay: %s is no longer a member: closing its connections", peer_id)
            await p2p_host.close_connections(conns)
        return len(leaving)

    async def enforce_membership_loop(self) -> None:
        while True:
            await self.enforce_membership()
            await trio.sleep(MEMBERSHIP_SWEEP_SECS)

    async def report(self) -> None:
        """Log the number of reservations and circuits when it changes (at most every 10 s)."""
        last = (0, 0)
        while True:
            await trio.sleep(REPORT_INTERVAL_SECS)
            now = (self.reservations(), self.circuits())
            if now != last:
                logger.info("relay: %d reservations, %d circuits", *now)
                last = now


class GossipDrain:
    """Accepts the gossip streams members open to the relay and discards what they carry, at
    most `burst` bytes and then `rate` bytes a second per member (a token bucket shared by all
    of a member's streams). A stream that finds its member's budget spent is reset, and so is
    every new one until the budget has refilled; the first of each interval is logged.

    Members' gossip opens a stream to every connected peer, the relay included; refusing it
    would make py-libp2p report an error on every member, and draining it without a bound let
    one member push gigabytes through the relay's CPU."""

    def __init__(
        self,
        allowed: Callable[[bytes], bool],
        drops: DropLog,
        *,
        burst: int = DRAIN_BURST_BYTES,
        rate: float = DRAIN_BYTES_PER_SEC,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._allowed = allowed
        self._drops = drops
        self.burst = burst
        self.rate = rate
        self._clock = clock
        self._budgets: dict[bytes, tuple[float, float]] = {}  # key -> (tokens, as of when)
        self.drained: dict[bytes, int] = {}
        """Bytes drained per member (for stats and tests)."""
        self.resets = 0

    def _tokens(self, key: bytes) -> float:
        tokens, since = self._budgets.get(key, (float(self.burst), self._clock()))
        now = self._clock()
        tokens = min(float(self.burst), tokens + (now - since) * self.rate)
        self._budgets[key] = (tokens, now)
        return tokens

    def _take(self, key: bytes, n: int) -> None:
        tokens, now = self._budgets[key]
        self._budgets[key] = (tokens - n, now)

    def forget(self, key: bytes) -> None:
        """A peer that left: its budget and count go (they are per connected member)."""
        self._budgets.pop(key, None)
        self.drained.pop(key, None)

    async def handle(self, stream: INetStream) -> None:
        key = await p2p_host.stream_peer(stream, self._allowed)
        if key is None:
            return
        try:
            while True:
                budget = int(self._tokens(key))
                if budget <= 0:
                    self.resets += 1
                    self._drops.note(
                        "gossip over budget",
                        f"relay: {fmt_short(key)} sent more gossip than the relay drains "
                        f"({self.burst} bytes, then {self.rate:g} bytes/s); resetting its streams",
                    )
                    return
                # reserved before the read (a member's streams share its bucket), and what the
                # read did not use given back after it
                reserved = min(budget, DRAIN_READ_BYTES)
                self._take(key, reserved)
                data = await stream.read(reserved)
                self._take(key, len(data) - reserved)
                if not data:
                    return
                self.drained[key] = self.drained.get(key, 0) + len(data)
        except Exception:
            return
        finally:
            await p2p_host.reset_quietly(stream)


@asynccontextmanager
async def open_relay(
    secret_key: SecretKey,
    allowed: Callable[[bytes], bool],
    options: RelayOptions = RelayOptions(),
) -> AsyncIterator[Relay]:
    """Run a relay for the block; `allowed(key)` says who may use it (the run's members)."""
    announce = announce_host(options.bind_host, options.announce_host)
    host = p2p_host.build_host(secret_key, options.bind_host, announce)
    drops = p2p_host.harden(host, allowed)
    protocol = CircuitV2Protocol(host, relay_limits(options), allow_hop=True)
    DialBackAutoNAT(host, serve=True, confirmations=1)
    relay = Relay(host, protocol, announce, allowed, drops)
    for gossip_protocol in (GOSSIP_V11, GOSSIP_V10):
        host.set_stream_handler(gossip_protocol, relay.gossip.handle)
    # py-libp2p's hop handler logs the end of every reservation stream as an error; the
    # relay's own report (reservations, circuits) says what matters.
    logging.getLogger("libp2p.relay.circuit_v2.protocol").setLevel(logging.CRITICAL)
    listen = p2p_host.listen_multiaddr(options.bind_host, options.port)
    async with host.run([listen]), background_trio_service(protocol), trio.open_nursery() as n:
        n.start_soon(drops.run)
        n.start_soon(relay.report)
        n.start_soon(relay.enforce_membership_loop)
        logger.info("relay listening at %s", ", ".join(relay.multiaddrs()))
        try:
            yield relay
        finally:
            n.cancel_scope.cancel()
            with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_TIMEOUT_SECS):
                await p2p_host.close_all_connections(host)


__all__ = ["GossipDrain", "Relay", "RelayOptions", "open_relay", "relay_limits"]
