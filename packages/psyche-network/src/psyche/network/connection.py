"""`NetworkConnection`: the one facade the client uses (upstream `NetworkConnection<B, D>`).

It owns, inside one trio nursery: the libp2p host (gated by the allowlist), GossipSub on the
run's topic, the content-addressed blob store with its side-channel server and downloader, the
model-sharing and peer-exchange protocols, the connection monitor and the stats tick. The
application reads `NetworkEvent`s from `next_event()`, awaits the `Download`s it starts and calls
the upstream-named methods. Its message types are parameters (upstream `NetworkConnection<B, D>`):
`broadcast_type`, what gossip carries, and `distro_result_type`, what a blob's DistroResult
variant holds (`transmittable.download_codec`); `model_codec` turns the application's model
parameters into bytes and back (`sharable_model.ParameterCodec`), so that the network never
imports torch.

It is the package's one face for what the application does with peers: gossip (`broadcast`,
`next_event`), DisTrO results (`add_downloadable` to serve one, `download_result` to fetch one,
retrying by itself: `result_downloads`), and P2P model sharing: it answers peers' requests from
`shared_model` by itself, and `model_download` fetches the run's model from peers.

    async with NetworkConnection.open(
        config,
        broadcast_type=Broadcast,
        distro_result_type=TransmittableDistroResult,
        model_codec=TENSOR_CODEC,
    ) as network:
        network.set_allowed_peers(ids_from_coordinator)
        network.broadcast(message)
        event = await network.next_event()
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.tools.anyio_service import background_trio_service

from psyche.core.drop_log import DropLog
from psyche.core.identity import SecretKey
from psyche.network import model_sharing, p2p_host, peer_exchange
from psyche.network.blob_routes import DEFAULT_MAX_FETCHES_PER_PEER, BlobRoutes
from psyche.network.blob_store import DEFAULT_GC_INTERVAL_SECS, BlobStore, remove_staled_tags
from psyche.network.blob_transport import (
    BLOB_LIMITS,
    BLOB_PROTOCOL,
    CONNECT_TIMEOUT_SECS,
    BlobServer,
    Libp2pBlobStreams,
    TcpBlobTransport,
)
from psyche.network.connection_monitor import RTT_PROBE_INTERVAL_SECS, ConnectionMonitor
from psyche.network.dialer import Dialer, MeasuredTimeout
from psyche.network.discovery import AddressBook, LocalDiscovery, sign_address_record
from psyche.network.download import DOWNLOAD_TIMEOUT_SECS, Download, Downloader
from psyche.network.download_manager import INLINE_WORK_BYTES, DownloadManager
from psyche.network.events import MessageReceived, NetworkEvent, PeerConnected
from psyche.network.gossip import (
    GOSSIP_MIRROR_PROTOCOL,
    MAX_NUM_BOOTSTRAP_PEERS,
    Gossip,
    GossipConfig,
    GossipRejected,
    gossip_topic,
)
from psyche.network.identity import fmt_short, peer_id_from_public_key
from psyche.network.interfaces import announce_host, interface_ipv4
from psyche.network.loop_lag import LoopLag
from psyche.network.model_download import ModelDownload
from psyche.network.reachability import (
    NatTraversal,
    ReachabilityMode,
    ReachabilityStatus,
)
from psyche.network.result_downloads import ResultDownloads
from psyche.network.scheduler import DEFAULT_MAX_CONCURRENT_PARAMETER_REQUESTS
from psyche.network.sharable_model import (
    NoModelCodec,
    ParameterCodec,
    SharableModel,
    answer_request,
)
from psyche.network.stats import (
    STATS_INTERVAL_SECS,
    BandwidthTracker,
    NetworkStats,
    P2PEndpointInfo,
    PeerBandwidth,
)
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr, TransportAddr, blob_hash
from psyche.network.transmittable import (
    DownloadType,
    ModelRequestType,
    SharableModelError,
    TicketResult,
    download_codec,
)
from psyche.transport import AllowDynamic, Allowlist, ConnectionLimits

logger = logging.getLogger(__name__)


MAX_BLOB_SIZE = 4 << 30
SHUTDOWN_TIMEOUT_SECS = 5.0
IDLE_TIMEOUT_SECS = 30.0
"""A connection that received nothing at all from its peer this long is dead and closed (QUIC's
idle timeout, upstream's rule; `NetworkConfig.idle_timeout_secs`)."""
DIRECT_PATH_PROBES = 2
DIRECT_PATH_PROBE_SECS = 2.0
"""A stalled direct path gets `DIRECT_PATH_PROBES` pings of this long each
(`_check_direct_path`)."""
MIRROR_TIMEOUT_SECS = 5.0
"""Sending or receiving one mirrored copy (`gossip.GOSSIP_MIRROR_PROTOCOL`)."""
JOINS_UNDER_WAY_MAX = MAX_NUM_BOOTSTRAP_PEERS
"""At most this many gossip joins under way at once (`NetworkConnection.add_peers`): the
client's top-up asks for this many neighbours."""
JOIN_GRACE_SECS = 30.0
"""A connected peer that is not yet a gossip neighbour counts as a join under way for this
long after it connected (stretched by the loop's lateness, `loop_lag`): its gossip stream is
being negotiated (py-libp2p retries that while the peer stays connected)."""


@dataclass(frozen=True)
class NetworkConfig:
    run_id: str
    secret_key: SecretKey | None = None
    """The node identity; random when absent (as upstream)."""
    bind_host: str = "0.0.0.0"
    interface: str | None = None
    """Bind to this interface's IPv4 (`name` or `prefix*`), overriding `bind_host`."""
    port: int = 0
    blob_port: int = 0
    announce_host: str | None = None
    """The address peers should dial (a public IP behind a port-forwarding NAT)."""
    bootstrap_peers: tuple[EndpointAddr, ...] = ()
    local_discovery_dir: Path | None = None
    gossip: GossipConfig = field(default_factory=GossipConfig)
    gc_interval_secs: float = DEFAULT_GC_INTERVAL_SECS
    stats_interval_secs: float = STATS_INTERVAL_SECS
    rtt_probe_interval_secs: float = RTT_PROBE_INTERVAL_SECS
    rtt_probe_timeout_secs: float = p2p_host.PING_TIMEOUT_SECS
    """One RTT probe's timeout before it grows with the probes measured (`probe_timeouts`)."""
    idle_timeout_secs: float = IDLE_TIMEOUT_SECS
    """Close a connection that received nothing from its peer this long (found at the first RTT
    probe that fails after it: at most an RTT probe interval and two probe timeouts later)."""
    download_timeout_secs: float = DOWNLOAD_TIMEOUT_SECS
    connect_timeout_secs: float = CONNECT_TIMEOUT_SECS
    max_blob_size: int = MAX_BLOB_SIZE
    blob_limits: ConnectionLimits = BLOB_LIMITS
    """Connection caps and timeouts of the blob provider (side channel and libp2p streams)."""
    max_downloads_per_peer: int = DEFAULT_MAX_FETCHES_PER_PEER
    """Blob fetches from one provider at a time."""
    relays: tuple[str, ...] = ()
    """Circuit relays to use (`/ip4/…/tcp/…/p2p/<relay id>`): when this node is not publicly
    reachable it reserves a slot on each and announces itself through them (`reachability`)."""
    reachability: ReachabilityMode = ReachabilityMode.AUTO
    """`auto`: AutoNAT through the relays decides whether to reserve; `private`/`public`: as
    set."""


class PeerUnreachable(ConnectionError):
    """A peer that announces only a relay path while this node has no relay to take it."""


class AddressUnknown(LookupError):
    """No address is known for a run member yet (its record has not reached us): no dial was
    made, so this is no failed dial; a join waits for the address (`NetworkConnection.add_peers`)."""


class NetworkConnection:
    def __init__(
        self,
        config: NetworkConfig,
        secret_key: SecretKey,
        host: IHost,
        allowlist: Allowlist,
        broadcast_type: Any,
        distro_result_type: Any,
        bind_host: str,
        model_codec: ParameterCodec | None = None,
    ) -> None:
        self.config = config
        self.secret_key = secret_key
        self.host = host
        self.allowlist = allowlist
        self.broadcast_type = broadcast_type
        self.codec = download_codec(distro_result_type)
        self.model_codec: ParameterCodec = model_codec or NoModelCodec()
        self.shared_model = SharableModel()
        """The model this node serves to peers that ask (`model_sharing`): the application
        updates it (`update_parameters` after a cooldown, `clear_cache` on RoundTrain)."""
        self.store = BlobStore()
        self.address_book = AddressBook(on_changed=self._address_changed)
        self._joining: set[bytes] = set()
        """Run members `add_peers` asked for whose join failed (no address known yet, or the
        dial failed): joined again as soon as their addresses change (`_address_changed`),
        not at the application's next top-up."""
        self.local_discovery = (
            LocalDiscovery(config.local_discovery_dir) if config.local_discovery_dir else None
        )
        self.connection_monitor = ConnectionMonitor()
        self.bandwidth_tracker = BandwidthTracker(clock=trio.current_time)
        self.stats = NetworkStats(endpoint_id=secret_key.public_key)
        self.bytes_served = 0
        self._events_send, self._events_receive = trio.open_memory_channel[NetworkEvent](
            float("inf")
        )
        self._nursery: trio.Nursery | None = None
        self.announce_host = announce_host(bind_host, config.announce_host)
        self.blob_server = BlobServer(
            secret_key,
            self.store.get,
            self._allowed,
            limits=config.blob_limits,
            on_served=self._on_served,
            model_answers=model_sharing.SideChannelAnswers(self._answer_model_request),
        )
        self.blob_transport = TcpBlobTransport(
            secret_key,
            self.store.get,
            self._allowed,
            bind_host=bind_host,
            port=config.blob_port,
            announce_host=self.announce_host,
            connect_timeout=config.connect_timeout_secs,
            server=self.blob_server,
        )
        self.blob_streams = Libp2pBlobStreams(host, self.blob_server, self.connect)
        self.blob_routes = BlobRoutes(
            self.blob_transport,
            self.blob_streams,
            max_per_peer=config.max_downloads_per_peer,
            on_direct_stalled=self._on_direct_stalled,
        )
        self.downloader = Downloader(self.store, self.blob_routes, self._resolve, self._allowed)
        self.downloads = DownloadManager(
            self.store,
            self.downloader,
            self.codec,
            self.connection_monitor,
            self.bandwidth_tracker,
            self.stats,
            self._spawn,
            max_blob_size=config.max_blob_size,
            timeout_secs=config.download_timeout_secs,
        )
        self.result_downloads = ResultDownloads(self.start_download, self._spawn)
        self.download_result = self.result_downloads.start
        """Fetch a DisTrO result's blob, retrying by itself (`result_downloads`): the `Download`
        resolves once, with the decoded result or the failure after which nothing more is
        tried."""
        self.gossip = Gossip(
            host,
            secret_key,
            gossip_topic(config.run_id),
            broadcast_type,
            self._allowed,
            config.gossip,
        )
        self._own_record = b""
        self.record_changed = trio.Event()
        """Set (and replaced) each time `own_record` changes."""
        self.nat = NatTraversal(
            host,
            list(config.relays),
            self._direct_libp2p_addrs,
            mode=config.reachability,
            on_addresses_changed=self._addresses_changed,
        )
        self.connection_drops: DropLog = p2p_host.drop_log()
        """Connections the libp2p host refused or dropped, by kind (`counts`)."""
        self.loop_lag = LoopLag()
        """How late this process's event loop runs; connection set-up timeouts (the dial's and
        py-libp2p's upgrade and stream negotiation) and RTT probes are stretched by it
        (`loop_lag` module doc), bounded."""
        self.dialer = Dialer(self._dial, config.connect_timeout_secs, stretch=self.loop_lag.stretch)
        self._paths: dict[bytes, str] = {}
        self._connected_at: dict[bytes, float] = {}
        """Connected peers -> when they connected (`joins_under_way`)."""
        self._probing: set[bytes] = set()
        self.probe_timeouts = MeasuredTimeout(config.rtt_probe_timeout_secs)
        """How long an RTT probe may take, sized from the probes that succeeded (a loaded
        machine answers late, which is no dead connection)."""
        self._checking_direct: set[bytes] = set()

    # ------------------------------------------------------------------------------------------
    # lifecycle

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        config: NetworkConfig,
        *,
        broadcast_type: Any,
        distro_result_type: Any,
        model_codec: ParameterCodec | None = None,
        allowlist: Allowlist | None = None,
    ) -> AsyncIterator[NetworkConnection]:
        secret_key = config.secret_key or SecretKey.generate()
        bind_host = interface_ipv4(config.interface) if config.interface else config.bind_host
        host = p2p_host.build_host(
            secret_key, bind_host, announce_host(bind_host, config.announce_host)
        )
        network = cls(
            config,
            secret_key,
            host,
            allowlist if allowlist is not None else AllowDynamic(),
            broadcast_type,
            distro_result_type,
            bind_host,
            model_codec,
        )
        p2p_host.harden(host, network._may_connect, network.connection_drops)
        host.get_network().register_notifee(
            p2p_host.ConnectionNotifee(network._on_connected, network._on_disconnected)
        )
        host.set_stream_handler(
            p2p_host.protocol(model_sharing.MODEL_SHARING_PROTOCOL), network._serve_model_sharing
        )
        host.set_stream_handler(
            p2p_host.protocol(model_sharing.MODEL_SHARING_VERSIONED_PROTOCOL),
            network._serve_model_sharing_versioned,
        )
        host.set_stream_handler(
            p2p_host.protocol(model_sharing.MODEL_SHARING_BATCH_PROTOCOL),
            network._serve_model_sharing_batch,
        )
        host.set_stream_handler(
            p2p_host.protocol(peer_exchange.PEER_EXCHANGE_PROTOCOL), network._serve_peer_exchange
        )
        host.set_stream_handler(p2p_host.protocol(BLOB_PROTOCOL), network.blob_streams.handle)
        host.set_stream_handler(
            p2p_host.protocol(GOSSIP_MIRROR_PROTOCOL), network._serve_gossip_mirror
        )
        listen = p2p_host.listen_multiaddr(bind_host, config.port)
        try:
            # Exit order matters: our tasks stop first, then the host closes its connections
            # (while pubsub still runs to hear about it), then the gossip services stop.
            async with (
                background_trio_service(network.gossip.pubsub),
                background_trio_service(network.gossip.router),
                host.run([listen]),
                trio.open_nursery() as nursery,
            ):
                network._nursery = nursery
                try:
                    await network.gossip.pubsub.wait_until_ready()
                    await network.gossip.pubsub.subscribe(network.gossip.topic)
                    await nursery.start(network.blob_transport.serve)
                    nursery.start_soon(network.connection_drops.run)
                    nursery.start_soon(network.gossip.drops.run)
                    await nursery.start(network.nat.run)
                    if config.relays:
                        # The first record we announce should already name our relays.
                        await network.nat.wait_decided()
                    network._publish_own_address()
                    nursery.start_soon(network._pump_gossip)
                    nursery.start_soon(network._stats_loop)
                    nursery.start_soon(network._gc_loop)
                    nursery.start_soon(network._rtt_loop)
                    nursery.start_soon(network._follow_loop_lag)
                    nursery.start_soon(network.blob_routes.run)
                    nursery.start_soon(network.result_downloads.run)
                    # Bootstrap peers seed the address book; we dial those already allowed (the
                    # rest once the coordinator admits them and the client calls add_peers).
                    for peer in config.bootstrap_peers:
                        network.address_book.add(peer)
                    for peer in config.bootstrap_peers:  # all of them, not `add_peers`' few
                        if network._allowed(peer.id):
                            network._spawn(network._connect_logged, peer.id)
                    logger.info("Our endpoint ID: %s", network.endpoint_id.hex())
                    yield network
                finally:
                    network._nursery = None
                    nursery.cancel_scope.cancel()
                    # py-libp2p's host.run only cancels the swarm's tasks, which leaves dialed
                    # sockets open until garbage collection; close connections explicitly.
                    with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_TIMEOUT_SECS):
                        await p2p_host.close_all_connections(host)
        finally:
            network.gossip.close()

    def shutdown(self) -> None:
        """Stop every network task; the `open` block ends (its body is cancelled)."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _spawn(self, fn: Any, *args: Any) -> bool:
        """Start `fn(*args)` in the network's nursery; False once the network has shut down."""
        if self._nursery is None:
            logger.debug("network is shut down; not starting %s", getattr(fn, "__name__", fn))
            return False
        self._nursery.start_soon(fn, *args)
        return True

    # ------------------------------------------------------------------------------------------
    # identity and peers

    @property
    def endpoint_id(self) -> bytes:
        return self.secret_key.public_key

    def _direct_libp2p_addrs(self) -> list[str]:
        return p2p_host.transport_addrs(self.host, self.announce_host)

    def endpoint_addr(self) -> EndpointAddr:
        """Our addresses: direct libp2p ones, then through each relay that holds a slot for
        us (`…/p2p-circuit`, announced only while we are not publicly reachable), then the
        blob side channel."""
        libp2p_addrs = self._direct_libp2p_addrs() + self.nat.relayed_addrs()
        return EndpointAddr(
            self.endpoint_id,
            [TransportAddr.Libp2p(a) for a in libp2p_addrs] + self.blob_transport.local_addrs(),
        )

    @property
    def own_record(self) -> bytes:
        """Our signed address record as last announced (it changes with our relay slots)."""
        return self._own_record

    def _publish_own_address(self) -> None:
        addr = self.endpoint_addr()
        self._own_record = sign_address_record(self.secret_key, addr)
        self.address_book.add_record(self._own_record)
        self.record_changed.set()
        self.record_changed = trio.Event()
        if self.local_discovery is not None:
            self.local_discovery.publish(self.secret_key, addr)

    def _addresses_changed(self) -> None:
        if self._nursery is not None:
            self._publish_own_address()

    @property
    def reachability(self) -> ReachabilityStatus:
        """Public or private, the relays and their slots, hole punches (for status output)."""
        return self.nat.status

    def add_relays(self, addrs: Iterable[str]) -> None:
        """Use more relays (e.g. the ones the coordinator announces)."""
        for addr in addrs:
            self.nat.add_relay(addr)

    def _allowed(self, peer: bytes) -> bool:
        return peer == self.endpoint_id or self.allowlist.allowed(peer)

    def _may_connect(self, peer: bytes) -> bool:
        """Run members, and our relays (which speak no application protocol to us)."""
        return self._allowed(peer) or peer in self.nat.relay_ids

    def set_allowed_peers(self, peers: Iterable[bytes]) -> None:
        """Replace the allowlist (the client calls this on every coordinator state) and drop
        connections to peers no longer in the run, and what the blob routes hold for them
        (`BlobRoutes.forget`, closing their kept side-channel sessions).

        The blob routes forget a peer here, when it leaves the run, not when its libp2p
        connection drops (`_on_disconnected`): a member's disconnect is often brief (it is
        redialed), its side-channel sessions run on TCP connections of their own, and what
        is remembered about it (a side channel that failed, an older provider, a stalled
        direct path) is not rebuilt by a reconnect but learned again only by failing again.
        A member gone for good leaves the coordinator's set, and so is forgotten here."""
        if not isinstance(self.allowlist, AllowDynamic):
            raise TypeError("set_allowed_peers needs an AllowDynamic allowlist")
        self.allowlist.set(peers)
        self._joining = {p for p in self._joining if self._allowed(p)}
        for peer in self.connection_monitor.connected_peers():
            if not self._allowed(peer):
                self._spawn(p2p_host.disconnect, self.host, peer)
        for peer in self.blob_routes.peers():
            if not self._allowed(peer):
                self._spawn(self.blob_routes.forget, peer)

    def neighbors(self) -> list[bytes]:
        """The peers we gossip with (upstream: iroh-gossip's active view): `Gossip.neighbors`."""
        return self.gossip.neighbors()

    def connected_peers(self) -> list[bytes]:
        return self.connection_monitor.connected_peers()

    def add_peers(self, peers: Iterable[bytes]) -> None:
        """Connect to these run members in the background (upstream: gossip `join_peers`);
        peers already connected, being dialed, or whose last dials failed a moment ago
        (`dialer`) are skipped. A join that fails is tried again by itself as soon as the
        peer's addresses change (its record arrives from the coordinator or a peer, or names a
        new relay slot): two members behind NAT that start together each ask for the other
        before the other's record has reached them, and waiting for the application's next
        top-up (6-10 s, then the dial back-off) cost the run's first rounds.

        At most `JOINS_UNDER_WAY_MAX` joins are under way at once (`joins_under_way`: dials in
        flight, and peers connected a moment ago whose gossip stream is not yet open); the
        peers beyond are not dialed now (the application's next top-up chooses again). The
        client tops its neighbours up every 6 s while it has fewer than 3, and a neighbour
        counts once its gossip stream is open: on a starved machine (32 nodes, each
        process getting 0.03 of a core) set-ups and stream negotiations took longer than
        that, every top-up dialed 3 more peers, and the nodes held 11-18 connections with no
        gossip stream on any of them, each one's set-up and streams more work for loops
        that could not keep up with the first 3."""
        connected = set(self.connection_monitor.connected_peers())
        room = JOINS_UNDER_WAY_MAX - len(self.joins_under_way())
        for peer in map(bytes, peers):
            if peer == self.endpoint_id or peer in connected:
                continue
            if self.dialer.dialing(peer) or self.dialer.backed_off(peer):
                self._joining.add(peer)
                continue
            if room <= 0:
                continue
            room -= 1
            self._spawn(self._connect_logged, peer)

    def joins_under_way(self) -> set[bytes]:
        """Peers being dialed, and peers that connected less than `JOIN_GRACE_SECS` (stretched
        by the loop's lateness) ago and are not yet gossip neighbours."""
        grace = self.loop_lag.stretch(JOIN_GRACE_SECS)
        now = trio.current_time()
        neighbors = set(self.neighbors())
        recent = {
            p for p, at in self._connected_at.items() if now - at < grace and p not in neighbors
        }
        return recent | set(self.dialer.in_flight())

    def _address_changed(self, peer: bytes) -> None:
        """New addresses are new information. py-libp2p forgets what it learned from the old
        ones: the peerstore's addresses (it dials one address per transport, which may be a
        stale one) and its negative cache (which refuses a peer whose addresses all failed
        for a minute; `Swarm.unblock_peer` is meant for a peer whose addresses changed). A
        failed join is made again at once, past the dial back-off."""
        if peer in self.connection_monitor.connected_peers() or self.dialer.dialing(peer):
            return
        peer_id = peer_id_from_public_key(peer)
        self.host.get_peerstore().clear_addrs(peer_id)
        swarm: Any = self.host.get_network()
        swarm.unblock_peer(peer_id)
        if peer in self._joining and self._allowed(peer):
            self._spawn(self._connect_logged, peer)

    async def _connect_logged(self, peer: bytes) -> None:
        try:
            await self.connect(peer)
        except AddressUnknown as e:
            self._joining.add(peer)
            logger.info("peer %s: %s; joining it once it is learned", fmt_short(peer), e)
        except Exception as e:
            if self._allowed(peer):  # (a peer that left the run is not joined again)
                self._joining.add(peer)
            logger.warning("Failed to join gossip peer %s: %s", fmt_short(peer), e)
        else:
            self._joining.discard(peer)

    async def connect(self, peer: bytes) -> None:
        """Make sure a libp2p connection to `peer` exists, finding its address if needed (from
        connected peers: `peer_exchange`); a dial already under way is joined, and set-ups are
        paced (`dialer`). `AddressUnknown` when no address is known: no dial is made, so the
        peer is not backed off."""
        if peer in self.connection_monitor.connected_peers():
            return
        if not self._allowed(peer):
            raise PermissionError(f"{fmt_short(peer)} is not in the allowlist")
        unknown = not self.dialer.dialing(peer) and self._known_libp2p_addr(peer) is None
        if unknown and await self._ask_for_record(peer) is None:
            raise AddressUnknown(f"no known address for {fmt_short(peer)}")
        await self.dialer.connect(peer)

    def _known_libp2p_addr(self, peer: bytes) -> EndpointAddr | None:
        addr = self._resolve(peer)
        return addr if addr is not None and addr.libp2p_addrs() else None

    async def _dial(self, peer: bytes, base_timeout: float) -> None:
        addr = self._known_libp2p_addr(peer)
        if addr is None:
            raise AddressUnknown(f"no known address for {fmt_short(peer)}")
        relayed = any(p2p_host.is_circuit(a) for a in addr.libp2p_addrs())
        can_relay = bool(self.nat.relay_ids)
        # a relayed peer gets the direct attempt's head start on top of the timeout
        timeout = base_timeout + (p2p_host.DIRECT_HEAD_START_SECS if relayed and can_relay else 0.0)
        try:
            with trio.fail_after(timeout):
                await p2p_host.connect(
                    self.host,
                    peer,
                    addr.libp2p_addrs(),
                    dial_circuit=self.nat.dial_circuit if can_relay else None,
                )
        except Exception as e:
            if relayed and not can_relay:
                raise PeerUnreachable(
                    f"{fmt_short(peer)} is behind NAT (reachable only through a relay) and "
                    "this node uses no relay (relays disabled)"
                ) from e
            if isinstance(e, trio.TooSlowError):
                raise ConnectionError(
                    f"{fmt_short(peer)} did not answer within {timeout:.1f} s (at "
                    f"{', '.join(addr.libp2p_addrs())})"
                ) from None
            raise

    def _resolve(self, peer: bytes) -> EndpointAddr | None:
        addr = self.address_book.get(peer)
        if addr is None and self.local_discovery is not None:
            record = self.local_discovery.resolve(peer)
            if record is not None:
                addr = self.address_book.add_record(record)
        return addr

    async def _ask_for_record(self, peer: bytes) -> EndpointAddr | None:
        for other in self.connection_monitor.connected_peers():
            await self._exchange_records(other, [peer])
            addr = self._known_libp2p_addr(peer)
            if addr is not None:
                return addr
        return None

    # ------------------------------------------------------------------------------------------
    # gossip

    def broadcast(self, message: Any) -> None:
        """Sign and gossip `message` in the background; raises now if it is too large."""
        data = self.gossip.encode(message)
        self._spawn(self._publish, data)

    async def _publish(self, data: bytes) -> None:
        try:
            await self.gossip.publish_raw(data)
        except Exception as e:
            logger.warning("gossip publish failed: %s", e)
        for peer, conn in self._mirror_targets():
            self._spawn(self._mirror, peer, conn, data)

    def _mirror_targets(self) -> list[tuple[bytes, INetConn]]:
        """The peers our own gossip is also sent to on the relay (`gossip` module doc), each
        with its relayed connection: those with a relayed connection whose gossip stream is
        not on one (it is on a punched connection, which may be dead without our knowing yet,
        or on one we closed as dead and not yet re-opened)."""
        targets = []
        for peer in self.connection_monitor.connected_peers():
            relayed = p2p_host.connections_on(self.host, peer, "relayed")
            if relayed and not self.gossip.sends_through_relay(peer):
                targets.append((peer, relayed[0]))
        return targets

    async def _mirror(self, peer: bytes, conn: INetConn, data: bytes) -> None:
        try:
            with trio.fail_after(MIRROR_TIMEOUT_SECS):
                stream = await p2p_host.new_stream_on(
                    self.host, conn, [p2p_host.protocol(GOSSIP_MIRROR_PROTOCOL)]
                )
                try:
                    await stream.write(data)
                    await stream.close()  # the receiver closes its half once it has read it
                except BaseException:
                    await p2p_host.reset_quietly(stream)
                    raise
        except Exception as e:  # the gossiped copy may still arrive
            logger.debug("mirroring gossip to %s failed: %s", fmt_short(peer), e)

    async def _serve_gossip_mirror(self, stream: INetStream) -> None:
        peer = await p2p_host.stream_peer(stream, self._allowed)
        if peer is None:
            return
        try:
            with trio.fail_after(MIRROR_TIMEOUT_SECS):
                data = await p2p_host.read_to_end(stream, self.config.gossip.max_message_size)
            if self.gossip.deliver_mirrored(peer, data):
                logger.debug("gossip from %s came first by its relayed copy", fmt_short(peer))
            await stream.close()
        except (GossipRejected, p2p_host.ReadLimitExceeded) as e:
            self.gossip.drops.note(
                "mirrored copy rejected", f"dropping mirrored gossip from {fmt_short(peer)}: {e}"
            )
            await p2p_host.reset_quietly(stream)
        except Exception as e:  # a slow or vanished peer
            logger.debug("mirrored gossip from %s not received: %s", fmt_short(peer), e)
            await p2p_host.reset_quietly(stream)

    async def _pump_gossip(self) -> None:
        async for received in self.gossip.received:
            self._events_send.send_nowait(MessageReceived(received.sender, received.message))

    # ------------------------------------------------------------------------------------------
    # blobs

    async def add_downloadable(self, data: Any, tag: str) -> tuple[BlobTicket, int]:
        """Store the encoded payload under `tag` and return a ticket naming us as its provider."""
        encoded = self.codec.encode(data)
        if len(encoded) < INLINE_WORK_BYTES:
            digest = blob_hash(encoded)
        else:
            digest = await trio.to_thread.run_sync(blob_hash, encoded)
        outcome = self.store.put(digest, encoded, tag)
        ticket = BlobTicket(self.endpoint_addr(), BlobFormat.Raw, outcome.hash, outcome.size)
        logger.debug(
            "blob added for upload with hash %s, %d bytes", fmt_short(outcome.hash), outcome.size
        )
        return ticket, outcome.size

    def start_download(
        self,
        ticket: BlobTicket,
        tag: str,
        download_type: DownloadType,
        max_size: int | None = None,
    ) -> Download:
        """Fetch the ticket's blob in the background; the `Download` resolves with
        `DownloadComplete` (the decoded payload) or `DownloadFailed`.

        The blob is tagged first, so once downloaded it is kept and served to other peers.
        `max_size`: the largest blob the caller can use (the client passes the largest result
        its run can produce); a ticket announcing more fails at once, `permanent`.
        """
        self.address_book.add(ticket.addr)
        self.store.set_tag(tag, ticket.hash)
        return self.downloads.start(ticket, tag, download_type, max_size)

    def remove_staled_tags(self, target_distro_result_step: int) -> int:
        removed = remove_staled_tags(self.store, target_distro_result_step)
        logger.debug("Untagged %d blobs", removed)
        return removed

    def _on_served(self, requester: bytes, num_bytes: int) -> None:
        self.bytes_served += num_bytes

    async def _gc_loop(self) -> None:
        while True:
            await trio.sleep(self.config.gc_interval_secs)
            dropped = self.store.gc()
            if dropped:
                logger.debug("blob GC dropped %d untagged blobs", dropped)

    # ------------------------------------------------------------------------------------------
    # model sharing

    async def request_model_blob_ticket(
        self, peer: bytes, request: ModelRequestType
    ) -> tuple[BlobTicket, int | None]:
        """Ask `peer` for the ticket of a model config or parameter (one stream per request):
        (the ticket, the version of the model it is of: the peer's claim). The configuration
        is asked on the blob side channel first, where the answer waits for no libp2p
        connection to be set up; over libp2p when that cannot answer."""
        if isinstance(request, ModelRequestType.Config):
            answered = await model_sharing.config_on_side_channel(
                self.blob_routes, self.address_book.get(peer)
            )
            if answered is not None:
                return answered
        await self.connect(peer)
        ticket, version = await model_sharing.request_ticket(self.host, peer, request)
        self.address_book.add(ticket.addr)
        return ticket, version

    async def request_model_blob_tickets(self, peer: bytes, names: list[str]) -> list[TicketResult]:
        """Ask `peer` for the tickets of many parameters at once (one result per name): on the
        blob side channel first (no libp2p connection needed), else in one libp2p stream."""
        answered = await model_sharing.tickets_on_side_channel(
            self.blob_routes, self.address_book.get(peer), names
        )
        if answered is not None:
            return answered
        await self.connect(peer)
        results = await model_sharing.request_tickets(self.host, peer, names)
        for result in results:
            if isinstance(result, TicketResult.Ok):
                self.address_book.add(result.value.addr)
        return results

    def model_download(
        self,
        peers: Iterable[bytes],
        *,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT_PARAMETER_REQUESTS,
        expected_version: int | None = None,
    ) -> ModelDownload:
        """The run's model of `expected_version` (`SharableModel.version`) from `peers`
        (`ModelDownload.run`), decoded with `model_codec`."""
        return ModelDownload(
            self, peers, max_concurrent=max_concurrent, expected_version=expected_version
        )

    async def _answer_model_request(self, request: ModelRequestType) -> TicketResult:
        try:
            return await answer_request(
                request, self.shared_model, self.add_downloadable, self.model_codec
            )
        except Exception as e:  # a peer's request must never take the node down
            self.connection_drops.note(
                "model-sharing request not answered",
                f"cannot answer model-sharing request {request}: {e}",
            )
            refused: TicketResult = TicketResult.Err(SharableModelError.SerializationError(str(e)))
            return refused

    async def _serve_model_sharing(self, stream: INetStream) -> None:
        await model_sharing.serve(stream, self._allowed, self._answer_model_request)

    async def _serve_model_sharing_versioned(self, stream: INetStream) -> None:
        await model_sharing.serve_versioned(stream, self._allowed, self._answer_model_request)

    async def _serve_model_sharing_batch(self, stream: INetStream) -> None:
        await model_sharing.serve_batch(stream, self._allowed, self._answer_model_request)

    # ------------------------------------------------------------------------------------------
    # peer exchange

    async def _serve_peer_exchange(self, stream: INetStream) -> None:
        await peer_exchange.serve(stream, self._allowed, self.address_book)

    async def _exchange_records(self, peer: bytes, wanted: list[bytes]) -> None:
        await peer_exchange.exchange_records(
            self.host, peer, wanted, self.address_book, self.config.connect_timeout_secs
        )

    # ------------------------------------------------------------------------------------------
    # connection monitor and stats

    def _on_connected(self, peer: bytes, remote_addr: str) -> None:
        if peer in self.nat.relay_ids:
            return
        was_connected = peer in self._paths
        self._joining.discard(peer)
        self.connection_monitor.on_connected(peer, remote_addr)
        self._note_path(peer)
        p2p_host.watch_received(self.host, peer)
        if not was_connected and peer in self._paths:
            self._connected_at[peer] = trio.current_time()
            self._events_send.send_nowait(PeerConnected(peer))
        self._spawn(self._probe_rtt, peer)
        self._spawn(self._exchange_records, peer, [])

    def _on_disconnected(self, peer: bytes) -> None:
        if peer in self.nat.relay_ids:
            return
        self.connection_monitor.on_disconnected(peer)
        self._note_path(peer)
        if peer not in self._paths:
            self._connected_at.pop(peer, None)

    def _note_path(self, peer: bytes) -> None:
        """Log, once per change, how we are connected to a peer (direct, relayed, not)."""
        paths = p2p_host.connection_paths(self.host, peer)
        path = "direct" if "direct" in paths else "relayed" if paths else "disconnected"
        if self._paths.get(peer, "disconnected") == path:
            return
        self._paths[peer] = path
        if path == "disconnected":
            del self._paths[peer]
        how = {"direct": "directly", "relayed": "through a relay"}.get(path)
        logger.info("peer %s: %s", fmt_short(peer), f"connected {how}" if how else "disconnected")

    def peer_paths(self) -> dict[bytes, str]:
        """`direct` or `relayed` for every connected peer."""
        return dict(self._paths)

    async def _probe_rtt(self, peer: bytes) -> None:
        """Ping `peer` (one probe per peer at a time: the probe on connecting and the periodic
        one would otherwise count one slow moment twice). A probe that times out closes
        nothing by itself: the connection is dropped (`_drop_if_silent`) only when it also
        received nothing at all for `idle_timeout_secs`, as upstream's QUIC connections close
        on their idle timeout. Before, two unanswered probes in a row (10-20 s) closed it: at
        32 nodes on two loaded cores the processes stalled, answers came late, live
        connections were closed and redialed (298 in two minutes), and the redials added to
        the load that made the answers late, so the meshes never formed. Each probe gets
        `probe_timeouts`, grown from the probes that succeeded; a late answer still counts as
        life (it is something received)."""
        if peer in self._probing:
            return
        self._probing.add(peer)
        try:
            await self._probe_rtt_once(peer)
        finally:
            self._probing.discard(peer)

    async def _probe_rtt_once(self, peer: bytes) -> None:
        timeout = self.loop_lag.stretch(self.probe_timeouts.timeout())
        start = trio.current_time()
        try:
            rtt = await p2p_host.measure_rtt(self.host, peer, timeout)
        except Exception as e:
            logger.debug("rtt probe to %s failed: %s", fmt_short(peer), e)
            if isinstance(e, trio.TooSlowError):
                self.probe_timeouts.took(timeout)
            await self._drop_if_silent(peer)
            return
        self.probe_timeouts.took(trio.current_time() - start)
        self.connection_monitor.on_rtt(peer, rtt)

    async def _drop_if_silent(self, peer: bytes) -> None:
        """After a failed probe: when the probed connection received nothing for
        `idle_timeout_secs` it is dead without having been closed (a path that lost its
        packets, a peer that hangs): close it, the direct one when a relayed one carries on
        beside it, else the peer's connections, dialed again so the next connect finds
        another path (the relay)."""
        try:
            silent = p2p_host.silent_secs(p2p_host.probed_connection(self.host, peer))
        except ConnectionError:
            return
        if silent < self.config.idle_timeout_secs:
            return
        what = f"nothing received for {silent:.0f} s"
        if await self._close_dead_direct_path(peer, what):
            return
        logger.info("peer %s: %s; dropping the connection", fmt_short(peer), what)
        await p2p_host.disconnect(self.host, peer)
        self._spawn(self._connect_logged, peer)

    async def _close_dead_direct_path(self, peer: bytes, why: str) -> bool:
        """Close the direct connections to `peer` when a relayed one stays open beside them
        (a punched path that died): the relayed one carries on, nothing to dial. False when
        there is no relayed connection to fall back on."""
        direct = p2p_host.connections_on(self.host, peer, "direct")
        if not direct or not p2p_host.connections_on(self.host, peer, "relayed"):
            return False
        logger.info(
            "peer %s: %s on the direct connection; closing it, the relay carries on",
            fmt_short(peer),
            why,
        )
        await p2p_host.close_connections(direct)
        self._note_path(peer)
        return True

    def _on_direct_stalled(self, peer: bytes) -> None:
        self._spawn(self._check_direct_path, peer)

    async def _check_direct_path(self, peer: bytes) -> None:
        """A fetch stalled on the direct connection to `peer`: ping on that connection now
        (`DIRECT_PATH_PROBES` tries, `DIRECT_PATH_PROBE_SECS` each) rather than at the next
        RTT probe, and close it (the relay carries on: nothing is closed without one) if none
        is answered and nothing else arrived on it meanwhile: a late answer is life."""
        if peer in self._checking_direct:
            return
        self._checking_direct.add(peer)
        start = trio.current_time()
        try:
            for _ in range(DIRECT_PATH_PROBES):
                direct = p2p_host.connections_on(self.host, peer, "direct")
                if not direct:
                    return
                try:
                    await p2p_host.measure_rtt(
                        self.host, peer, DIRECT_PATH_PROBE_SECS, conn=direct[0]
                    )
                    return
                except Exception as e:
                    logger.debug("direct-path ping to %s failed: %s", fmt_short(peer), e)
            direct = p2p_host.connections_on(self.host, peer, "direct")
            if direct and p2p_host.silent_secs(direct[0]) >= trio.current_time() - start:
                what = f"no answer to {DIRECT_PATH_PROBES} pings"
                await self._close_dead_direct_path(peer, what)
        finally:
            self._checking_direct.discard(peer)

    async def _follow_loop_lag(self) -> None:
        """Sample the event loop's lateness and stretch py-libp2p's set-up timeouts by it."""
        await self.loop_lag.run(
            lambda: p2p_host.stretch_set_up_timeouts(self.host, self.loop_lag.stretch)
        )

    async def _rtt_loop(self) -> None:
        while True:
            await trio.sleep(self.config.rtt_probe_interval_secs)
            async with trio.open_nursery() as probes:
                for peer in self.connection_monitor.connected_peers():
                    probes.start_soon(self._probe_rtt, peer)

    async def _stats_loop(self) -> None:
        while True:
            self.stats.connection_info = self.remote_infos()
            self.stats.reachability = self.nat.status.summary()
            self.stats.peer_paths = self.peer_paths()
            self.stats.bandwidth_history.append(self.bandwidth_tracker.get_total_bandwidth())
            await trio.sleep(self.config.stats_interval_secs)

    def remote_infos(self) -> list[P2PEndpointInfo]:
        infos = [P2PEndpointInfo(self.endpoint_id, None, 0.0, 0.0)]
        for data in self.connection_monitor.get_all_connections():
            latency = data.latency()
            bandwidth = (
                data.bandwidth.value if isinstance(data.bandwidth, PeerBandwidth.Measured) else 0.0
            )
            infos.append(
                P2PEndpointInfo(
                    data.endpoint_id,
                    data.selected_path,
                    bandwidth,
                    float("inf") if latency is None else latency,
                )
            )
        return infos

    def clear_bandwidth_tracking(self) -> None:
        self.bandwidth_tracker.clear()
        self.connection_monitor.clear_all_bandwidth()

    # ------------------------------------------------------------------------------------------
    # events

    async def next_event(self) -> NetworkEvent:
        return await self._events_receive.receive()

    def __aiter__(self) -> NetworkConnection:
        return self

    async def __anext__(self) -> NetworkEvent:
        return await self.next_event()
