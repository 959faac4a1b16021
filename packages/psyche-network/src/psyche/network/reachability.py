"""Reachability, decided per node: am I publicly reachable, and if not, which relay carries me.

Built from py-libp2p 0.8.1's own pieces (circuit relay v2, DCUtR, AutoNAT, identify), with two
fixes written here because the shipped versions get them wrong:

* **AutoNAT's dial-back** (`DialBackAutoNAT`): py-libp2p's server "dials back" with
  `host.connect`, which returns at once when any connection to the peer exists, and one always
  does (the request arrived on it). Every node with a matching IP would be reported public, a
  firewalled one included. The fix dials the announced address afresh (`Swarm.dial_addr`) and
  closes that probe connection again.
* **Outcomes of hole punching** are only logged by py-libp2p at its own level; `ReportedDCUtR`
  records each attempt and logs one line per outcome.

`NatTraversal` runs, per node:

1. connect to each configured relay (`/ip4/…/tcp/…/p2p/<relay id>`), with backoff while one is
   unreachable;
2. ask the relays to dial us back (AutoNAT v1, one confirmation per relay suffices): *public*
   when a relay reached us, *private* when none could;
3. when not public (or forced private), reserve a slot on every relay (circuit relay v2) and
   announce `<relay address>/p2p/<relay id>/p2p-circuit` among our addresses, so peers can dial
   us through the relay; the reservation is renewed before it expires and remade after the
   connection to the relay comes back;
4. DCUtR runs on every relayed connection, started by the node with the smaller peer id (the
   other answers; `ReportedDCUtR.initiate_hole_punch`): both sides dial each other at once from
   their listen port (TCP simultaneous open through the NATs), and once a direct connection
   verifies, new streams use it; the relayed one stays open as the fallback path.

Every change of reachability or of the relay slots is logged in one line and kept in `status`
(what the client's status output shows); `on_addresses_changed` lets the network re-sign and
re-announce its address record.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.host.autonat.autonat import AutoNATService, AutoNATStatus
from libp2p.host.basic_host import BasicHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport

from psyche.network.identity import fmt_short, public_key_from_peer_id

logger = logging.getLogger(__name__)

AUTONAT_INTERVAL_SECS = 300.0
AUTONAT_TIMEOUT_SECS = 10.0
RELAY_RETRY_MIN_SECS = 1.0
RELAY_RETRY_MAX_SECS = 60.0
RELAY_CHECK_SECS = 2.0
RESERVATION_REFRESH_MARGIN_SECS = 60.0
DIAL_BACK_TIMEOUT_SECS = 5.0
CIRCUIT_ADDR_TTL_SECS = 600
HOLE_PUNCH_DIAL_TIMEOUT_SECS = 3
"""DCUtR's dial timeout (py-libp2p's default is 10 s). Its first step dials the peer's announced
addresses, which a NAT drops without a word, so this wait precedes every hole punch; the punch's
own simultaneous dials answer within a round trip or not at all."""
INITIAL_DECISION_SECS = 10.0
"""How long `NetworkConnection.open` waits for the first verdict and reservations, so that the
first address record the node announces already names its relays."""

# What a relay grants (its own limits are set where it runs: `relay.py`); a client only needs a
# `RelayConfig` to dial circuits and make reservations.
CLIENT_RELAY_LIMITS = RelayLimits(
    duration=0, data=1 << 62, max_circuit_conns=64, max_reservations=1
)


class Reachability(StrEnum):
    UNKNOWN = "unknown"
    PUBLIC = "public"
    PRIVATE = "private"


class ReachabilityMode(StrEnum):
    AUTO = "auto"
    """AutoNAT decides; reservations only when not public."""
    PRIVATE = "private"
    """Reserve relay slots whatever AutoNAT says (e.g. a firewall AutoNAT cannot see)."""
    PUBLIC = "public"
    """Never reserve (the node knows it is reachable)."""


def relay_peer(addr: str) -> bytes:
    """The relay's 32-byte identity from its multiaddr (`…/p2p/<id>`); `ValueError` if none."""
    try:
        peer = multiaddr.Multiaddr(addr).get_peer_id()
    except Exception as e:  # multiaddr's parse errors
        raise ValueError(f"not a multiaddr: {e}") from None
    if not peer:
        raise ValueError("it names no peer (expected …/p2p/<relay id>)")
    try:
        return public_key_from_peer_id(ID.from_base58(peer))
    except ValueError as e:
        raise ValueError(f"the relay id is not an ed25519 key: {e}") from None


def circuit_addr(relay_addr: str) -> str:
    """Our address through `relay_addr`, as we announce it (no `/p2p/<our id>` suffix)."""
    return f"{relay_addr}/p2p-circuit"


@dataclass
class RelayState:
    addr: str
    state: str = "connecting"
    """connecting | connected | reserved | unreachable"""
    detail: str = ""
    expires: float | None = None
    dial_back: bool | None = None
    """Whether this relay reached us on our announced address (AutoNAT), if it answered."""


@dataclass
class ReachabilityStatus:
    reachability: Reachability = Reachability.UNKNOWN
    relays: dict[bytes, RelayState] = field(default_factory=dict)
    hole_punches: int = 0
    hole_punches_direct: int = 0

    def relayed_addrs(self) -> list[str]:
        return [circuit_addr(r.addr) for r in self.relays.values() if r.state == "reserved"]

    def summary(self) -> str:
        relays = ", ".join(
            f"{fmt_short(rid)} {r.state}{f' ({r.detail})' if r.detail else ''}"
            for rid, r in self.relays.items()
        )
        punches = f"; hole punches {self.hole_punches_direct}/{self.hole_punches} direct"
        return (
            f"reachability {self.reachability}"
            + (f"; relays: {relays}" if relays else "; no relays")
            + (punches if self.hole_punches else "")
        )


class DialBackAutoNAT(AutoNATService):
    """py-libp2p's AutoNAT with a real dial-back (see the module docstring)."""

    def __init__(self, host: IHost, serve: bool = True, confirmations: int | None = None) -> None:
        # py-libp2p's AutoNATService types its host as BasicHost (what `new_host` builds), its
        # factory as IHost.
        if not isinstance(host, BasicHost):
            raise TypeError(f"AutoNAT needs a BasicHost, not {type(host).__name__}")
        super().__init__(host, serve=serve, confirmations=confirmations)

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        network: Any = self.host.get_network()
        for raw in addrs:
            try:
                with trio.fail_after(DIAL_BACK_TIMEOUT_SECS):
                    conn = await network.dial_addr(multiaddr.Multiaddr(raw), peer_id)
            except Exception as e:
                logger.debug("AutoNAT dial-back to %s at %s failed: %s", peer_id, raw, e)
                continue
            with contextlib.suppress(Exception):
                await conn.close()
            return bytes(raw)
        return None


class ReportedDCUtR(DCUtRProtocol):
    """DCUtR whose outcomes are counted and logged once per attempt, and which keeps the relayed
    connection open beside the punched one.

    py-libp2p closes the relayed connection 60 s after a punch succeeds. Kept, it is the path a
    payload takes at once when the punched one dies without a word (a NAT that drops the
    mapping): `BlobRoutes` moves a fetch that stalls on the direct connection to it within
    seconds, where dialling the relay again after the dead connection is noticed by pings
    costs 10 to 20 s, more than a round (iroh keeps its relay path for the same reason). New
    streams prefer the direct connection, so the relayed one stays idle: one circuit per
    punched peer on the relay, no traffic."""

    def __init__(self, host: IHost, on_outcome: Callable[[ID, bool], None]) -> None:
        super().__init__(host, dial_timeout=HOLE_PUNCH_DIAL_TIMEOUT_SECS)
        self._on_outcome = on_outcome

    def _schedule_relay_close(self, peer_id: ID) -> None:
        return None  # the relayed connection stays as the fallback path (see the class doc)

    async def initiate_hole_punch(self, peer_id: ID) -> bool:
        """Only the node with the smaller peer id starts a hole punch; the other answers.

        py-libp2p drives a punch from both ends of every relayed connection, and two clients
        that meet through the relay start theirs within the same second. Each side then dials
        as the responder of its own session at the same moment as the other's: in ten e2e NAT
        runs, 2 of the 4 punches made twice at once failed (25 s each, then a retry), while the
        12 made once all succeeded within 4 s of the relayed connection."""
        if self.host.get_id().to_bytes() > peer_id.to_bytes():
            return False
        return await super().initiate_hole_punch(peer_id)

    async def _perform_hole_punch(
        self, peer_id: ID, addrs: list[Any], as_responder: bool = False
    ) -> bool:
        try:
            success = await super()._perform_hole_punch(peer_id, addrs, as_responder)
        except Exception:
            self._on_outcome(peer_id, False)
            raise
        self._on_outcome(peer_id, success)
        return success


class NatTraversal:
    """One node's relays, reservations, AutoNAT verdict and hole punching (see module doc)."""

    def __init__(
        self,
        host: IHost,
        relays: list[str],
        announced_addrs: Callable[[], list[str]],
        *,
        mode: ReachabilityMode = ReachabilityMode.AUTO,
        on_addresses_changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.host = host
        self.mode = mode
        self._announced = announced_addrs
        self._on_addresses_changed = on_addresses_changed
        self.status = ReachabilityStatus()
        self._wake = trio.Event()
        self._decided = trio.Event()
        self.circuit = CircuitV2Protocol(host, CLIENT_RELAY_LIMITS, allow_hop=False)
        self.transport = CircuitV2Transport(
            host,
            self.circuit,
            RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT, limits=CLIENT_RELAY_LIMITS),
        )
        self.dcutr = ReportedDCUtR(host, self._on_hole_punch)
        self.autonat = DialBackAutoNAT(host, serve=False, confirmations=1)
        for addr in relays:
            self.add_relay(addr)

    # public ------------------------------------------------------------------------------------

    @property
    def relay_ids(self) -> set[bytes]:
        return set(self.status.relays)

    def add_relay(self, addr: str) -> bool:
        """Use one more relay (a multiaddr ending in `/p2p/<id>`); False if already known."""
        peer = relay_peer(addr)
        if peer in self.status.relays:
            return False
        self.status.relays[peer] = RelayState(addr)
        self._nudge()
        return True

    def relayed_addrs(self) -> list[str]:
        return self.status.relayed_addrs()

    async def wait_decided(self, timeout: float = INITIAL_DECISION_SECS) -> None:
        """Until the first verdict (and reservations, when needed) or `timeout`."""
        with trio.move_on_after(timeout):
            await self._decided.wait()

    async def dial_circuit(self, relayed: str, peer: bytes) -> None:
        """Connect to `peer` through the relay named in `relayed` (`…/p2p-circuit`)."""
        from psyche.network.identity import peer_id_from_public_key

        target = peer_id_from_public_key(peer)
        full = multiaddr.Multiaddr(f"{relayed}/p2p/{target}")
        # in the peerstore, the transport dials it straight away (else it warns, then does)
        self.host.get_peerstore().add_addrs(target, [full], CIRCUIT_ADDR_TTL_SECS)
        await self.transport.dial(full)

    # running -----------------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        from libp2p.tools.anyio_service import background_trio_service

        async with (
            background_trio_service(self.circuit),
            background_trio_service(self.dcutr),
            trio.open_nursery() as nursery,
        ):
            self._nursery = nursery
            if not self.status.relays:
                self._decide()
                logger.info(
                    "no relays: reachability unknown; peers behind NAT cannot be reached from "
                    "here, and if this node is behind NAT, no peer can reach it"
                )
            task_status.started()
            known: set[bytes] = set()
            while True:
                for peer in list(self.status.relays):
                    if peer not in known:
                        known.add(peer)
                        nursery.start_soon(self._keep_relay, peer)
                await self._wake.wait()
                self._wake = trio.Event()

    def _nudge(self) -> None:
        self._wake.set()

    async def _keep_relay(self, peer: bytes) -> None:
        """Stay connected to one relay; check reachability through it; hold a reservation on
        it while we are not public."""
        from psyche.network.identity import peer_id_from_public_key

        relay = self.status.relays[peer]
        relay_id = peer_id_from_public_key(peer)
        delay = RELAY_RETRY_MIN_SECS
        next_check = -math.inf
        while True:
            try:
                if not self.host.get_network().get_connections(relay_id):
                    with trio.fail_after(DIAL_BACK_TIMEOUT_SECS * 2):
                        await self.host.connect(
                            PeerInfo(relay_id, [multiaddr.Multiaddr(relay.addr)])
                        )
                    if relay.state in ("connecting", "unreachable"):
                        self._set_relay(peer, "connected")
                    next_check = -math.inf  # a new connection: ask again
                now = trio.current_time()
                if now >= next_check:
                    await self._check_reachability(peer, relay_id)
                    next_check = now + AUTONAT_INTERVAL_SECS
                if self._wants_relay():
                    if relay.state != "reserved" or (
                        relay.expires is not None
                        and relay.expires - now < RESERVATION_REFRESH_MARGIN_SECS
                    ):
                        await self._reserve(peer, relay_id)
                elif relay.state == "reserved":
                    self._set_relay(peer, "connected")  # public now: stop announcing it
                delay = RELAY_RETRY_MIN_SECS
                await trio.sleep(RELAY_CHECK_SECS)
            except Exception as e:
                detail = str(e) or type(e).__name__
                if relay.state != "unreachable" or relay.detail != detail:
                    self._set_relay(peer, "unreachable", detail)
                if all(r.state == "unreachable" for r in self.status.relays.values()):
                    self._decided.set()  # unreachable relays must not hold up the start-up
                await trio.sleep(delay)
                delay = min(RELAY_RETRY_MAX_SECS, delay * 2)

    async def _check_reachability(self, peer: bytes, relay_id: ID) -> None:
        if self.mode != ReachabilityMode.AUTO:
            self._decide()
            return
        addrs = [multiaddr.Multiaddr(a).to_bytes() for a in self._announced()]
        try:
            with trio.fail_after(AUTONAT_TIMEOUT_SECS):
                await self.autonat.query_server(relay_id, addrs)
        except Exception as e:
            logger.debug("AutoNAT query to relay %s failed: %s", fmt_short(peer), e)
            self.autonat.dial_results[relay_id] = False
        self.status.relays[peer].dial_back = self.autonat.dial_results.get(relay_id)
        self.autonat.update_status()
        self._decide()

    def _decide(self) -> None:
        match self.mode:
            case ReachabilityMode.PRIVATE:
                verdict = Reachability.PRIVATE
            case ReachabilityMode.PUBLIC:
                verdict = Reachability.PUBLIC
            case _:
                verdict = {
                    AutoNATStatus.PUBLIC: Reachability.PUBLIC,
                    AutoNATStatus.PRIVATE: Reachability.PRIVATE,
                }.get(self.autonat.get_status(), Reachability.UNKNOWN)
        if verdict != self.status.reachability:
            self.status.reachability = verdict
            how = "AutoNAT through the relays" if self.mode == ReachabilityMode.AUTO else "set"
            logger.info("reachability: %s (%s)", verdict, how)
        if not self._wants_relay() or not self.status.relays:
            self._decided.set()

    def _wants_relay(self) -> bool:
        return self.status.reachability != Reachability.PUBLIC

    async def _reserve(self, peer: bytes, relay_id: ID) -> None:
        stream = await self.host.new_stream(relay_id, [HOP_PROTOCOL])
        try:
            ok = await self.transport.reserve(stream, relay_id, self._nursery)
        finally:
            with contextlib.suppress(Exception):
                await stream.close()
        if not ok:
            raise ConnectionError("the relay refused the reservation")
        expires = self.transport._reservations.get(relay_id)
        relay = self.status.relays[peer]
        relay.expires = trio.current_time() + max(0.0, (expires or 0) - _wall_now())
        if relay.state != "reserved":
            self._set_relay(peer, "reserved")
        self._decided.set()

    def _set_relay(self, peer: bytes, state: str, detail: str = "") -> None:
        relay = self.status.relays[peer]
        was_announced = relay.state == "reserved"
        relay.state, relay.detail = state, detail
        if state != "reserved":
            relay.expires = None
        logger.info("relay %s: %s%s", fmt_short(peer), state, f" ({detail})" if detail else "")
        if was_announced != (state == "reserved"):
            self._on_addresses_changed()

    def _on_hole_punch(self, peer_id: ID, success: bool) -> None:
        self.status.hole_punches += 1
        self.status.hole_punches_direct += int(success)
        try:
            who = fmt_short(public_key_from_peer_id(peer_id))
        except ValueError:
            who = str(peer_id)
        if success:
            logger.info("hole punch with %s: direct connection established", who)
        else:
            logger.info("hole punch with %s: failed, staying on the relay", who)

    _nursery: trio.Nursery


def _wall_now() -> float:
    import time

    return time.time()


__all__ = [
    "INITIAL_DECISION_SECS",
    "DialBackAutoNAT",
    "NatTraversal",
    "Reachability",
    "ReachabilityMode",
    "ReachabilityStatus",
    "RelayState",
    "circuit_addr",
    "relay_peer",
]
