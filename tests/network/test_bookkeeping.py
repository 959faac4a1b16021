"""Pure bookkeeping: blob store and tags, bandwidth, peer ranking, progress mapping, discovery."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from psyche.core.identity import SecretKey
from psyche.core.signed_message import SignedMessageError
from psyche.network.blob_store import BlobStore, gc_interval_from_env, remove_staled_tags
from psyche.network.connection_monitor import (
    ConnectionChanged,
    ConnectionLatencyChanged,
    ConnectionMonitor,
)
from psyche.network.discovery import (
    AddressBook,
    LocalDiscovery,
    sign_address_record,
    verify_address_record,
)
from psyche.network.download import (
    DownloadError,
    DownloadFailed,
    DownloadState,
    PartComplete,
    Progress,
    ProgressError,
    ProviderFailed,
    TryProvider,
    track_progress,
)
from psyche.network.latency_sorted import LatencySorted
from psyche.network.peer_manager import (
    PeerManager,
    PeersUnreachable,
    blob_ticket_param_request_task,
)
from psyche.network.stats import BandwidthTracker, PeerBandwidth
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr, TransportAddr, blob_hash
from psyche.network.transmittable import DownloadType, ModelRequestType
from psyche.transport import AllowDynamic

A, B, C, D = (bytes([i]) * 32 for i in range(1, 5))


def test_store_tags_and_gc() -> None:
    store = BlobStore()
    kept = store.add_bytes(b"kept", "distro-result_5")
    loose = store.add_bytes(b"loose")
    assert kept.hash == blob_hash(b"kept")
    assert kept.size == 4
    assert store.get(loose.hash) == b"loose"
    assert store.gc() == 1
    assert store.get(loose.hash) is None
    assert store.get(kept.hash) == b"kept"
    # a tag may name a blob before it arrives (a download in flight survives GC)
    store.set_tag("distro-result_6", blob_hash(b"later"))
    store.put(blob_hash(b"later"), b"later")
    assert store.gc() == 0
    assert len(store) == 2


def test_remove_staled_tags_follows_upstream() -> None:
    store = BlobStore()
    for name in ("model-a", "model-config", "distro-result_3", "distro-result_4", "odd", "x_y"):
        store.add_bytes(name.encode(), name)
    removed = remove_staled_tags(store, 4)
    assert removed == 3  # two model- tags and step 3
    assert set(store.tags()) == {"distro-result_4", "odd", "x_y"}
    assert store.gc() == 3


def test_gc_interval_env() -> None:
    assert gc_interval_from_env({}) == 10.0
    assert gc_interval_from_env({"BLOBS_GC_INTERVAL_MILLIS": "250"}) == 0.25
    assert gc_interval_from_env({"BLOBS_GC_INTERVAL_MILLIS": "soon"}) == 10.0


def test_bandwidth_tracker_window() -> None:
    now = [100.0]
    tracker = BandwidthTracker(15.0, clock=lambda: now[0])
    assert tracker.get_peer_bandwidth(A) == PeerBandwidth.NotMeasured()
    tracker.add_event(A, 1000)
    assert tracker.get_peer_bandwidth(A) == PeerBandwidth.Measured(0.0)  # no time elapsed
    now[0] = 102.0
    tracker.add_event(A, 3000)
    assert tracker.get_peer_bandwidth(A) == PeerBandwidth.Measured(2000.0)
    now[0] = 116.0
    tracker.add_event(A, 0)  # drops the event older than 15 s
    assert tracker.get_peer_bandwidth(A) == PeerBandwidth.Measured(3000 / 14.0)
    tracker.add_event(B, 10)
    assert tracker.get_total_bandwidth() == pytest.approx(3000 / 14.0)
    tracker.clear()
    assert tracker.get_total_bandwidth() == 0.0


def monitor_with(
    latencies: dict[bytes, float], bandwidths: dict[bytes, PeerBandwidth]
) -> ConnectionMonitor:
    monitor = ConnectionMonitor()
    for peer in {*latencies, *bandwidths}:
        monitor.on_connected(peer, "127.0.0.1:1")
        if peer in latencies:
            monitor.on_rtt(peer, latencies[peer])
        if peer in bandwidths:
            monitor.update_peer_bandwidth(peer, bandwidths[peer])
    return monitor


def test_connection_monitor_events_and_disconnect() -> None:
    events = []
    monitor = ConnectionMonitor(events.append)
    monitor.on_connected(A, "10.0.0.1:1")
    assert monitor.get_latency(A) is None
    monitor.on_rtt(A, 0.010)
    monitor.on_rtt(A, 0.050)  # within 50 ms: no event
    monitor.on_rtt(A, 0.120)
    assert [type(e) for e in events] == [ConnectionChanged, ConnectionLatencyChanged]
    monitor.update_peer_bandwidth(A, PeerBandwidth.Measured(5.0))
    monitor.on_disconnected(A)
    data = monitor.get_connection(A)
    assert data is not None
    assert data.selected_path is None
    assert not data.connected
    assert data.bandwidth == PeerBandwidth.Measured(5.0)
    monitor.on_connected(A, "10.0.0.1:2")  # bandwidth survives a reconnect
    assert monitor.get_bandwidth(A) == PeerBandwidth.Measured(5.0)
    monitor.clear_all_bandwidth()
    assert monitor.get_bandwidth(A) == PeerBandwidth.NotMeasured()


def test_latency_sorted_is_stable_and_deduplicated() -> None:
    monitor = monitor_with({B: 0.2, C: 0.1}, {})
    sorted_nodes = LatencySorted([A, B, C, A, D], monitor).find_providers()
    assert sorted_nodes == [C, B, A, D]  # unknown latency last, insertion order among ties


def test_peer_manager_ranks_by_bandwidth_then_latency() -> None:
    monitor = monitor_with(
        {A: 0.3, B: 0.1, C: 0.2, D: 0.05},
        {
            A: PeerBandwidth.Measured(100.0),
            B: PeerBandwidth.Measured(50.0),
            C: PeerBandwidth.NotMeasured(),
            D: PeerBandwidth.Measured(0.0),
        },
    )
    manager = PeerManager(monitor)
    manager.set_peers([D, C, B, A])
    assert [manager.get_next_peer() for _ in range(5)] == [A, B, C, D, None]
    manager.report_success(B)
    manager.report_success(B)
    assert list(manager.available_peers) == [B]


def test_peer_manager_drops_failing_peers_then_gives_up() -> None:
    exhausted = []
    manager = PeerManager(
        ConnectionMonitor(), max_errors_per_peer=2, on_exhausted=lambda: exhausted.append(1)
    )
    manager.set_peers([A, B])
    assert (manager.get_next_peer(), manager.get_next_peer()) == (A, B)
    for peer in (A, A, B):
        manager.report_blob_ticket_request_error(peer)  # a failing peer goes back in the pool
    assert list(manager.available_peers) == [B]
    assert not exhausted
    manager.report_blob_ticket_request_error(B)
    assert list(manager.available_peers) == []
    assert exhausted == [1]


def test_request_task_tries_other_peers_and_budgets_attempts() -> None:
    ticket = BlobTicket(EndpointAddr(B, []), BlobFormat.Raw, blob_hash(b"p"), 1)

    async def main() -> None:
        manager = PeerManager(ConnectionMonitor())
        manager.set_peers([A, B])
        asked = []

        async def request(peer: bytes, req: ModelRequestType) -> BlobTicket:
            asked.append(peer)
            if peer == A:
                raise ConnectionError("down")
            return ticket

        got, _req, peer = await blob_ticket_param_request_task(
            ModelRequestType.Parameter("w"), request, manager
        )
        assert got == ticket
        assert peer == B
        assert asked == [A, B]
        assert manager.errors_per_peer[A] == 1

        async def hang(peer: bytes, req: ModelRequestType) -> BlobTicket:
            await trio.sleep_forever()
            raise AssertionError

        manager.set_peers([A])
        start = trio.current_time()
        with pytest.raises(PeersUnreachable):
            await blob_ticket_param_request_task(
                ModelRequestType.Config(), hang, manager, max_attempts=7
            )
        # 5 requests time out after 10 s each, then A is dropped: no peer is left, so no
        # attempt waits for one
        assert trio.current_time() - start == pytest.approx(5 * 10.1)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_track_progress_maps_items_like_upstream() -> None:
    ticket = BlobTicket(EndpointAddr(A, []), BlobFormat.Raw, blob_hash(b"x"), 100)
    kind = DownloadType.DistroResult([B])
    state = DownloadState(ticket, "distro-result_1", kind)
    first = track_progress(state, TryProvider(A))
    assert not isinstance(first, DownloadFailed)
    assert (first.downloaded_size_delta, first.all_done) == (0, False)
    progress = [track_progress(state, Progress(n)) for n in (40, 30, 100)]
    assert [u.downloaded_size_delta for u in progress] == [40, 0, 70]  # saturating
    assert not isinstance(track_progress(state, ProviderFailed(A, "x")), DownloadFailed)
    done = track_progress(state, PartComplete())
    assert not isinstance(done, DownloadFailed)
    assert done.all_done
    assert done.downloaded_size == 100
    failed = track_progress(state, DownloadError())
    assert isinstance(failed, DownloadFailed)
    assert failed.error == "Download error"
    assert track_progress(state, ProgressError("boom")).error == "boom"  # type: ignore[union-attr]


def test_allow_dynamic() -> None:
    allow = AllowDynamic([A])
    assert allow.allowed(A)
    assert not allow.allowed(B)
    allow.force_allow(C)
    allow.set([B])
    assert allow.allowed(B)
    assert allow.allowed(C)
    assert not allow.allowed(A)
    allow.clear()
    assert not allow.allowed(B)
    assert allow.allowed(C)


def test_address_records_are_self_signed(tmp_path) -> None:
    key, other = SecretKey.generate(), SecretKey.generate()
    addr = EndpointAddr(
        key.public_key,
        [TransportAddr.Libp2p("/ip4/10.1.2.3/tcp/4001"), TransportAddr.BlobTcp("10.1.2.3:4002")],
    )
    record = sign_address_record(key, addr)
    assert verify_address_record(record) == addr
    with pytest.raises(ValueError, match="signed by the endpoint it describes"):
        sign_address_record(other, addr)
    from psyche.core.signed_message import SignedMessage

    forged = SignedMessage.sign_and_encode(other, addr, EndpointAddr)
    with pytest.raises(SignedMessageError):
        verify_address_record(forged)
    book = AddressBook()
    assert book.add_record(forged) is None
    assert key.public_key not in book
    assert book.add_record(record) == addr
    assert book.records() == [record]

    discovery = LocalDiscovery(tmp_path)
    discovery.publish(key, addr)
    raw = discovery.resolve(key.public_key)
    assert raw is not None
    local = verify_address_record(raw)
    assert local.libp2p_addrs() == ["/ip4/127.0.0.1/tcp/4001"]
    assert local.blob_addrs() == ["127.0.0.1:4002"]
    assert discovery.resolve(other.public_key) is None
    (tmp_path / other.public_key.hex()).write_text("not json")
    assert discovery.resolve(other.public_key) is None


def test_rebroadcast_loop_sends_one_bumped_broadcast_per_interval() -> None:
    from psyche.client.round.broadcast import (
        Broadcast,
        BroadcastType,
        Commitment,
        CommitteeProof,
        Finished,
        Rebroadcaster,
        rebroadcast_periodically,
    )
    from psyche.core.merkle_tree import MerkleRoot

    data = BroadcastType.Finished(Finished(MerkleRoot(), True))
    rebroadcaster = Rebroadcaster()
    for step in (1, 2):
        rebroadcaster.add(
            Broadcast(step, CommitteeProof(), Commitment(bytes(32), bytes(64)), 0, data)
        )
    sent: list[Broadcast] = []

    async def main() -> None:
        with trio.move_on_after(35):
            await rebroadcast_periodically(rebroadcaster, sent.append)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [(b.step, b.nonce) for b in sent] == [(2, 1), (1, 1), (2, 2)]


def test_choose_gossip_peers_tops_up_to_three() -> None:
    import random

    from psyche.network.gossip import choose_gossip_peers

    everyone = [A, B, C, D, bytes([9]) * 32]
    rng = random.Random(0)
    assert choose_gossip_peers(everyone, [], bytes(32), rng) == []  # not a participant
    chosen = choose_gossip_peers(everyone, [B], A, rng)
    assert len(chosen) == 2
    assert A not in chosen
    assert B not in chosen
    assert choose_gossip_peers(everyone, [B, C, D], A, rng) == []
