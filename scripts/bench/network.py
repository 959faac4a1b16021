"""Benchmark psyche.network's bulk and latency paths against raw sockets measured in the same run.

All nodes run in this one process on 127.0.0.1 (one trio loop, like one client), so sender and
receiver share a CPU and the GIL in every measurement, baseline included:

* blob throughput (64 MiB and 83 MB of `bytes`, and a 64 MiB DisTrO result): a raw TCP transfer
  of the same bytes into a preallocated buffer (baseline) against the blob side channel
  (handshake + transfer + BLAKE3 check) and against the whole `NetworkConnection` path
  (start_download -> verified, stored, decoded `DownloadComplete`; the payload's byte fields are
  views into the blob, not copies). Ratio = raw time / blob time (goal >= 0.5).
* gossip: delivery latency of a signed broadcast from one node to all of 6 nodes in a ring
  (up to three hops), against the one-way latency of a small message on a raw socket.
* gossip-mirror: two nodes joined through an in-process relay and then directly (hole punched
  on loopback), gossip's stream on the punched connection: the sender's own broadcasts also
  copied on the relayed connection (what a client does then) against the same without the
  copy: delivery latency and the CPU time of the whole process per broadcast (sender, relay and
  receiver share it).
* paths (a 40 MB blob, the size of a 20M-parameter bf16 model): the encrypted side channel
  (Noise handshake + AES-GCM), a libp2p stream on a direct connection (the carrier that takes
  over where the side channel cannot reach), and a libp2p stream through a circuit relay
  (both peers reserved on an in-process relay, hole punching switched off so the path stays
  relayed), each against a raw socket; the relayed one also against its anchor, a raw socket
  through a plain in-process TCP forwarder (what any relay in this loop costs at least).
* model sharing: a joining node fetching a 20M-parameter bf16 model from 3 peers (config,
  batched ticket requests and parameter blobs), against one raw socket carrying the same bytes;
  each provider serves as a client's cooldown does (its model serialized ahead, where the code
  under test has `SharableModel.serialize_ahead`), so "cold" is fresh connections to it;
  `--only model300` does the same for a 300M-parameter model (600 MB, not in the default run);
  `--only model-processes` (and `model300-processes`) put each provider in a process of its own,
  the baseline a raw socket between processes, and print the joiner's CPU time per byte against
  the raw socket's receive and the load average (there "cold" is the median of `--repeats`
  fetches by a fresh joiner node each, new connections and blob sessions); `--link-mbit 1000` runs it with every node in a network namespace of
  its own behind a 1 Gbit/s token bucket into the joiner (root; `--millions` sets the size).
  `--old-src OLD/packages` runs the same on another checkout's sources first, same sitting.
* crypto: the CPU time per MiB, on one core, of AES-256-GCM decryption (Noise transport
  messages, as the side channel receives them) and BLAKE3 (1 MiB blobs): the work every
  received byte needs besides the socket call (both release the GIL).
* tracker: the CPU cost of one download progress update in the bandwidth tracker (record the
  bytes, read the peer's rate) with a full 15 s window of 64 KiB frames from one peer at
  100 Mbit/s and 1 Gbit/s, against the tracker's old definition (re-sum the window on every
  read) on the same events; CPU time, ratio = old time / new time.

Run: .venv/bin/python scripts/bench/network.py [--repeats N]
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from psyche.network.connection import NetworkConnection
from psyche.network.download import DownloadComplete
from psyche.network.events import MessageReceived
from psyche.network.model_download import ModelDownload
from psyche.network.sharable_model import SharableModel
from psyche.network.stats import BANDWIDTH_AVERAGE_PERIOD_SECS, BandwidthTracker
from psyche.network.testing import (
    connect_pairs,
    only_relayed,
    open_nodes,
    ring,
    serve_model,
    wait_until,
)
from psyche.network.transmittable import DownloadType

MIB = 1 << 20


# ---- baselines ------------------------------------------------------------------------------


async def raw_transfer_seconds(data: bytes) -> float:
    """One TCP connection, sender `send_all`, receiver `recv_into` a preallocated buffer."""
    size = len(data)

    async def sender(stream: trio.SocketStream) -> None:
        await stream.send_all(memoryview(data))
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, sender, listeners)
        elapsed, buf = await timed_receive(port, size)
        nursery.cancel_scope.cancel()
    assert buf == data
    return elapsed


async def timed_receive(port: int, size: int) -> tuple[float, bytearray]:
    """Seconds to connect to `port` on loopback and receive `size` bytes into a buffer, and
    the buffer."""
    start = time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    buf = bytearray(size)
    await receive_exactly(stream, buf)
    elapsed = time.perf_counter() - start
    await stream.aclose()
    return elapsed, buf


async def receive_exactly(stream: trio.SocketStream, buf: bytearray) -> None:
    """Fill the preallocated `buf` from `stream` (the raw baseline's receive)."""
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        got += await stream.socket.recv_into(view[got : got + MIB])


async def raw_one_way_latency(size: int, rounds: int) -> list[float]:
    """Half the round trip of a `size`-byte message echoed over one raw TCP connection."""

    async def echo(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(65536):
            await stream.send_all(data)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    samples = []
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, echo, listeners)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        message = os.urandom(size)
        for _ in range(rounds):
            start = time.perf_counter()
            await stream.send_all(message)
            got = 0
            while got < size:
                got += len(await stream.receive_some(65536))
            samples.append((time.perf_counter() - start) / 2)
        await stream.aclose()
        nursery.cancel_scope.cancel()
    return samples


async def forwarded_transfer_seconds(data: bytes) -> float:
    """`raw_transfer_seconds` through a plain TCP forwarder in the same loop: the floor of
    what relaying the bytes once in user space costs."""
    size = len(data)

    async def sender(stream: trio.SocketStream) -> None:
        await stream.send_all(memoryview(data))
        await stream.aclose()

    async def pipe(src: trio.SocketStream, dst: trio.SocketStream) -> None:
        while chunk := await src.receive_some(MIB):
            await dst.send_all(chunk)
        await dst.aclose()

    async def forward(stream: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", source_port)
        await pipe(upstream, stream)

    sources = await trio.open_tcp_listeners(0, host="127.0.0.1")
    source_port = sources[0].socket.getsockname()[1]
    forwarders = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = forwarders[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, sender, sources)
        await nursery.start(trio.serve_listeners, forward, forwarders)
        elapsed, buf = await timed_receive(port, size)
        nursery.cancel_scope.cancel()
    assert buf == data
    return elapsed


# ---- helpers --------------------------------------------------------------------------------


async def interleaved_medians(
    repeats: int, *measures: Callable[[], Awaitable[float]]
) -> list[float]:
    """Median of each measure, run in turn (a b c a b c ...) so drifting machine load hits the
    baseline and the candidates alike."""
    samples: list[list[float]] = [[] for _ in measures]
    for _ in range(repeats):
        for measure, out in zip(measures, samples, strict=True):
            out.append(await measure())
    return [statistics.median(s) for s in samples]


def row(
    label: str, baseline: float, candidates: list[tuple[str, float]], size: int | None = None
) -> str:
    parts = [f"{label:<24} raw socket {baseline * 1000:8.1f} ms"]
    if size:
        parts[0] += f" ({size / baseline / MIB:6.0f} MiB/s)"
    for name, seconds in candidates:
        speed = f" {size / seconds / MIB:6.0f} MiB/s" if size else ""
        parts.append(f"{name} {seconds * 1000:8.1f} ms{speed} ratio {baseline / seconds:5.2f}")
    return " | ".join(parts)


# ---- blobs ----------------------------------------------------------------------------------


async def bench_blobs(repeats: int) -> list[str]:
    lines = []
    async with open_nodes(2) as (provider, requester):
        for label, size in (("blob 64 MiB", 64 * MIB), ("blob 83 MB", 83_000_000)):
            blob = os.urandom(size)
            lines.append(await bench_one_blob(repeats, label, provider, requester, blob, size))
    from psyche.modeling.serialized_distro import TransmittableDistroResult

    async with open_nodes(2, distro_result_type=TransmittableDistroResult) as (
        provider,
        requester,
    ):
        # What the client really fetches: a DisTrO result (16 tensor pairs, 64 MiB of data).
        payload = distro_result(64 * MIB, 16)
        lines.append(
            await bench_one_blob(repeats, "DisTrO result 64 MiB", provider, requester, payload)
        )
    return lines


def distro_result(total: int, count: int):  # type: ignore[no-untyped-def]
    from psyche.core.batch_id import BatchId
    from psyche.modeling.serialized_distro import (
        SerializableTensor,
        SerializableTensorData,
        SerializedDistroResult,
        TransmittableDistroResult,
    )

    each = total // (2 * count)

    def tensor() -> SerializableTensor:
        return SerializableTensor([each], 0, False, SerializableTensorData.Full(os.urandom(each)))

    results = [SerializedDistroResult(tensor(), tensor(), [64, 64], 4096) for _ in range(count)]
    return TransmittableDistroResult(1, 0, BatchId(0, 15), results)


async def bench_one_blob(
    repeats: int, label: str, provider, requester, payload, expected_len: int | None = None
) -> str:  # type: ignore[no-untyped-def]
    ticket, size = await provider.add_downloadable(payload, f"distro-result_{label}")
    encoded = bytes(provider.store.get(ticket.hash))

    async def raw() -> float:
        return await raw_transfer_seconds(encoded)

    async def transport(t=ticket) -> float:
        start = time.perf_counter()
        got = await requester.blob_transport.fetch(t.addr, t.hash, t.size, lambda n: None)
        elapsed = time.perf_counter() - start
        assert len(got) == t.size
        return elapsed

    async def facade(t=ticket) -> float:
        requester.store.delete_prefix("bench-")
        requester.store.gc()
        start = time.perf_counter()
        download = requester.start_download(t, "bench-blob", DownloadType.DistroResult([]))
        event = await download.finished()
        elapsed = time.perf_counter() - start
        assert isinstance(event, DownloadComplete)
        if expected_len is not None:
            assert len(event.data) == expected_len
        else:
            assert event.data == payload
        return elapsed

    await transport()  # warm up code paths once
    base, side, full = await interleaved_medians(repeats, raw, transport, facade)
    return row(label, base, [("side channel", side), ("NetworkConnection", full)], size)


# ---- paths: side channel, libp2p stream, relay ----------------------------------------------


async def bench_paths(repeats: int) -> list[str]:
    from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS

    from psyche.core.identity import SecretKey
    from psyche.network.identity import peer_id_from_public_key
    from psyche.network.relay import RelayOptions, open_relay
    from psyche.network.ticket import EndpointAddr

    size = 40_000_000  # a 20M-parameter model in bf16
    blob = os.urandom(size)
    keys = [SecretKey.generate() for _ in range(4)]
    members = {k.public_key for k in keys}
    async with (
        open_relay(keys[0].generate(), members.__contains__, RelayOptions("127.0.0.1")) as relay,
        open_nodes(4, keys=keys, relays=tuple(relay.multiaddrs()), reachability="private") as (
            provider,
            requester,
            relayed_provider,
            relayed_requester,
        ),
    ):
        ticket, _ = await provider.add_downloadable(blob, "bench-path")
        await relayed_provider.add_downloadable(blob, "bench-path")
        record = provider.endpoint_addr()
        direct = EndpointAddr(
            record.id, [a for a in record.addrs if "/p2p-circuit" not in str(a.value)]
        )
        requester.address_book._addrs[provider.endpoint_id] = direct
        await requester.connect(provider.endpoint_id)
        # the relayed pair: no hole punching (it would find the direct path on loopback), and
        # the requester knows the provider only through the relay
        for a, b in ((relayed_requester, relayed_provider), (relayed_provider, relayed_requester)):
            a.nat.dcutr._hole_punch_attempts[peer_id_from_public_key(b.endpoint_id)] = (
                MAX_HOLE_PUNCH_ATTEMPTS
            )
        far = relayed_provider.endpoint_addr()
        relayed_requester.address_book._addrs[far.id] = only_relayed(far)
        await relayed_requester.connect(far.id)

        async def side_channel() -> float:
            start = time.perf_counter()
            got = await requester.blob_transport.fetch(
                direct, ticket.hash, ticket.size, lambda n: None
            )
            elapsed = time.perf_counter() - start
            assert len(got) == ticket.size
            return elapsed

        async def on_stream(node, peer: bytes, want_relayed: bool) -> float:  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            session, relayed = await node.blob_streams.open_session(peer)
            assert relayed == want_relayed
            try:
                got = await session.fetch(ticket.hash, ticket.size, lambda n: None)
            finally:
                await session.stream.aclose()
            elapsed = time.perf_counter() - start
            assert len(got) == ticket.size
            return elapsed

        async def libp2p_direct() -> float:
            return await on_stream(requester, provider.endpoint_id, False)

        async def libp2p_relayed() -> float:
            return await on_stream(relayed_requester, far.id, True)

        async def raw() -> float:
            return await raw_transfer_seconds(blob)

        async def forwarded() -> float:
            return await forwarded_transfer_seconds(blob)

        await side_channel()
        await libp2p_direct()
        await libp2p_relayed()
        base, fwd, side, stream, relayed = await interleaved_medians(
            repeats, raw, forwarded, side_channel, libp2p_direct, libp2p_relayed
        )
    label = "blob 40 MB (20M bf16)"
    return [
        row(label, base, [("side channel", side), ("libp2p stream", stream)], size),
        row(label, base, [("libp2p via relay", relayed), ("TCP forwarder", fwd)], size),
        f"{'':<24} relay vs direct libp2p stream: ratio {stream / relayed:5.2f} | relay vs TCP "
        f"forwarder (its anchor): ratio {fwd / relayed:5.2f} | side channel vs libp2p stream: "
        f"{stream / side:5.2f} times faster",
    ]


# ---- gossip ---------------------------------------------------------------------------------


async def next_message(node: NetworkConnection) -> Any:
    """The node's next gossiped message (skipping `PeerConnected`)."""
    while not isinstance(event := await node.next_event(), MessageReceived):
        pass
    return event.message


async def bench_gossip_ring(rounds: int) -> list[str]:
    from psyche.client.round.broadcast import (
        Broadcast,
        BroadcastType,
        Commitment,
        CommitteeProof,
        Finished,
    )
    from psyche.core.merkle_tree import MerkleRoot

    async with open_nodes(6, broadcast_type=Broadcast) as nodes:
        await connect_pairs(nodes, ring(6))
        await wait_until(lambda: all(len(n.neighbors()) >= 2 for n in nodes), timeout=15)
        sender, receivers = nodes[0], nodes[1:]
        samples = []
        size = 0
        for i in range(rounds):
            data_hash = os.urandom(32)
            message = Broadcast(
                i + 1,
                CommitteeProof(),
                Commitment(data_hash, sender.secret_key.sign(data_hash)),
                i,
                BroadcastType.Finished(Finished(MerkleRoot(), False)),
            )
            size = len(sender.gossip.encode(message))
            start = time.perf_counter()
            sender.broadcast(message)
            for node in receivers:
                assert await next_message(node) == message
            samples.append(time.perf_counter() - start)
            await trio.sleep(0.02)
    raw = await raw_one_way_latency(size, rounds)
    base = statistics.median(raw)
    med = statistics.median(samples)
    p90 = statistics.quantiles(samples, n=10)[-1]
    return [
        f"gossip 6 nodes (ring)    raw socket one-way {base * 1000:6.3f} ms | "
        f"all 5 peers received: median {med * 1000:6.2f} ms, p90 {p90 * 1000:6.2f} ms "
        f"({size} B signed) | ratio {base / med:6.4f}"
    ]


async def bench_gossip_mirror(rounds: int) -> list[str]:
    from psyche.client.round.broadcast import (
        Broadcast,
        BroadcastType,
        Commitment,
        CommitteeProof,
        Finished,
    )
    from psyche.core.identity import SecretKey
    from psyche.core.merkle_tree import MerkleRoot
    from psyche.network import p2p_host
    from psyche.network.identity import peer_id_from_public_key
    from psyche.network.relay import RelayOptions, open_relay

    keys = [SecretKey.generate() for _ in range(2)]
    members = {k.public_key for k in keys}
    async with (
        open_relay(SecretKey.generate(), members.__contains__, RelayOptions("127.0.0.1")) as relay,
        open_nodes(
            2,
            keys=keys,
            relays=tuple(relay.multiaddrs()),
            reachability="private",
            broadcast_type=Broadcast,
        ) as (sender, receiver),
    ):
        far = receiver.endpoint_addr()
        sender.address_book._addrs[far.id] = only_relayed(far)
        await sender.connect(far.id)

        def punched() -> bool:
            return all(
                p2p_host.connections_on(sender.host, far.id, path) for path in ("direct", "relayed")
            )

        await wait_until(punched, timeout=30)
        # gossip's stream opened on the relayed connection; move it to the punched one (as a
        # failed stream does in a long run), where the copies are sent
        peer_id = peer_id_from_public_key(far.id)
        await sender.gossip.pubsub.peers[peer_id].reset()

        def broadcast(i: int) -> Broadcast:
            data_hash = os.urandom(32)
            return Broadcast(
                i,
                CommitteeProof(),
                Commitment(data_hash, sender.secret_key.sign(data_hash)),
                i,
                BroadcastType.Finished(Finished(MerkleRoot(), False)),
            )

        with trio.fail_after(15):  # py-libp2p re-opens the stream once a write finds it failed
            while not (
                peer_id in sender.gossip.pubsub.peers
                and not sender.gossip.sends_through_relay(far.id)
            ):
                sender.broadcast(broadcast(0))
                await trio.sleep(0.2)
        await trio.sleep(1)
        while True:  # drop what arrived meanwhile
            try:
                receiver._events_receive.receive_nowait()
            except trio.WouldBlock:
                break
        await wait_until(lambda: len(sender.neighbors()) >= 1, timeout=15)
        assert sender._mirror_targets(), "gossip to the peer does not run on the punched path"
        mirror_targets = sender._mirror_targets

        async def block(mirrored: bool, count: int, first: int) -> tuple[list[float], float]:
            sender._mirror_targets = mirror_targets if mirrored else list  # type: ignore[method-assign]
            latencies = []
            cpu = time.process_time()
            for i in range(first, first + count):
                message = broadcast(i)
                start = time.perf_counter()
                sender.broadcast(message)
                assert await next_message(receiver) == message
                latencies.append(time.perf_counter() - start)
                await trio.sleep(0.05)  # the other copy lands and is dropped
            return latencies, (time.process_time() - cpu) / count

        plain: list[float] = []
        mirrored: list[float] = []
        cpu_plain: list[float] = []
        cpu_mirrored: list[float] = []
        step = 10
        for first in range(1, rounds + 1, step):  # blocks interleaved
            got, cpu = await block(False, step, 2 * first)
            plain += got
            cpu_plain.append(cpu)
            got, cpu = await block(True, step, 2 * first + step)
            mirrored += got
            cpu_mirrored.append(cpu)
        first_by_copy = receiver.gossip.mirrored_first
    med_plain, med_mirrored = statistics.median(plain), statistics.median(mirrored)
    cpu_p, cpu_m = statistics.median(cpu_plain), statistics.median(cpu_mirrored)
    return [
        f"gossip + relayed copy    plain median {med_plain * 1000:6.2f} ms | with the copy "
        f"{med_mirrored * 1000:6.2f} ms ratio {med_plain / med_mirrored:5.2f} | CPU per broadcast "
        f"{cpu_p * 1000:5.2f} ms plain, {cpu_m * 1000:5.2f} ms with the copy (ratio "
        f"{cpu_p / cpu_m:5.2f}) | {first_by_copy} of {len(mirrored)} came first by the copy"
    ]


# ---- bandwidth tracker ----------------------------------------------------------------------


def resumming_update(events: collections.deque[tuple[float, int]], now: float, size: int) -> float:
    """The tracker's old progress update: append, drop what left the window, re-sum it."""
    events.append((now, size))
    while events and now - events[0][0] > BANDWIDTH_AVERAGE_PERIOD_SECS:
        events.popleft()
    seconds = now - events[0][0]
    return sum(n for _, n in events) / seconds if seconds > 0 else 0.0


def tracker_update_seconds(frames_per_sec: int, updates: int, resum: bool) -> float:
    """CPU seconds per progress update, the window first filled with 15 s of frames."""
    frame = 64 * 1024
    clock = [0.0]
    tracker = BandwidthTracker(clock=lambda: clock[0])
    events: collections.deque[tuple[float, int]] = collections.deque()
    peer = b"p" * 32
    warm = int(BANDWIDTH_AVERAGE_PERIOD_SECS * frames_per_sec)
    for i in range(warm):
        clock[0] = i / frames_per_sec
        if resum:
            events.append((clock[0], frame))
        else:
            tracker.add_event(peer, frame)
    start = time.process_time()
    for i in range(warm, warm + updates):
        clock[0] = i / frames_per_sec
        if resum:
            resumming_update(events, clock[0], frame)
        else:
            tracker.add_event(peer, frame)
            tracker.get_peer_bandwidth(peer)
    return (time.process_time() - start) / updates


async def bench_tracker(repeats: int) -> list[str]:
    lines = []
    # One peer sending 64 KiB frames at 100 Mbit/s and at 1 Gbit/s for longer than the window
    # (a 1B-parameter bf16 model, 2 GB, takes 16 s at 1 Gbit/s).
    for label, frames_per_sec in (("peer at 100 Mbit/s", 191), ("peer at 1 Gbit/s", 1907)):
        updates = 1000
        old, new = (
            statistics.median(
                tracker_update_seconds(frames_per_sec, updates, r) for _ in range(repeats)
            )
            for r in (True, False)
        )
        lines.append(
            f"tracker {label:<22} window {int(BANDWIDTH_AVERAGE_PERIOD_SECS * frames_per_sec):>6} "
            f"frames | re-sum {old * 1e6:8.2f} us/update ({old * frames_per_sec:6.1%} of a core) | "
            f"running totals {new * 1e6:6.2f} us/update ({new * frames_per_sec:6.2%}) "
            f"ratio {old / new:7.1f}"
        )
    return lines


# ---- receive-side crypto ---------------------------------------------------------------------


def crypto_cpu_per_mib(repeats: int) -> tuple[float, float]:
    """CPU seconds per MiB (the process's: BLAKE3 may use several threads) of what a joiner does to every byte it receives on
    the side channel besides the socket call: AES-256-GCM `decrypt_into` of full Noise
    transport messages (as `secure_channel` does) and BLAKE3 of 1 MiB blobs (`blob_hash`)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from psyche.network.secure_channel import MAX_NOISE_MESSAGE
    from psyche.network.ticket import blob_hash

    total = 64 * MIB
    aead = AESGCM(os.urandom(32))
    plain = os.urandom(MAX_NOISE_MESSAGE - 16)
    nonce = bytes(12)
    sealed = aead.encrypt(nonce, plain, None)
    out = memoryview(bytearray(len(plain)))
    blob = os.urandom(MIB)
    decrypt, hashing = [], []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(total // len(plain)):
            aead.decrypt_into(nonce, sealed, None, out)
        decrypt.append((time.process_time() - start) / (total // len(plain) * len(plain)) * MIB)
        start = time.process_time()
        for _ in range(total // MIB):
            blob_hash(blob)
        hashing.append((time.process_time() - start) / (total // MIB))
    return statistics.median(decrypt), statistics.median(hashing)


async def bench_crypto(repeats: int) -> list[str]:
    decrypt, hashing = crypto_cpu_per_mib(repeats)
    return [
        f"receive crypto CPU time  AES-256-GCM decrypt {decrypt * 1e3:6.3f} ms CPU/MiB "
        f"({1 / decrypt / 1024:5.2f} GiB/s) | BLAKE3 {hashing * 1e3:6.3f} ms CPU/MiB "
        f"({1 / hashing / 1024:5.2f} GiB/s) | both {(decrypt + hashing) * 1e3:6.3f} ms CPU/MiB"
    ]


# ---- model sharing --------------------------------------------------------------------------


def model_hash(parameters: Any) -> bytes:
    """`psyche.modeling.sharing.model_hash` (torch loads only for the model benchmarks)."""
    from psyche.modeling.sharing import model_hash as hash_parameters

    return hash_parameters(parameters)


def tensor_codec() -> Any:
    from psyche.modeling.sharing import TENSOR_CODEC

    return TENSOR_CODEC


def make_model(num_params: int, num_tensors: int):
    import torch

    g = torch.Generator().manual_seed(0)
    per = num_params // num_tensors
    cols = 1024
    return {
        f"model.layers.{i}.weight": torch.randn(per // cols, cols, generator=g).to(torch.bfloat16)
        for i in range(num_tensors)
    }


def raw_bytes(tensor) -> bytes:
    import torch

    return tensor.reshape(-1).view(torch.int16).numpy().tobytes()


def serve_as_a_client(nursery: trio.Nursery, node: NetworkConnection, model: SharableModel) -> None:
    """`node` serves `model` as a client's cooldown has it serve: serialized ahead where the
    code has `serialize_ahead` (not before 2026-11-28: serialized on request; `--old-src`)."""
    nursery.start_soon(serve_model, node, model)
    ahead = getattr(model, "serialize_ahead", None)
    if ahead is not None:
        nursery.start_soon(ahead, node.add_downloadable, node.model_codec)


async def timed_model_fetch(joiner, ids: list[bytes], expected: bytes) -> float:  # type: ignore[no-untyped-def]
    """Seconds for `joiner` to fetch the whole model from `ids`, its blob store emptied first
    (a warm fetch: connections and the providers' serialized tensors are kept)."""
    elapsed, _ = await timed_model_fetch_cpu(joiner, ids, expected)
    return elapsed


async def timed_model_fetch_cpu(joiner, ids: list[bytes], expected: bytes) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """`timed_model_fetch`, and the CPU seconds this process (event loop and worker threads)
    spent on the fetch: not counting the check of the result."""
    joiner.store.delete_prefix("model-")
    joiner.store.gc()
    cpu = time.process_time()
    start = time.perf_counter()
    got = await ModelDownload(joiner, ids).run()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    assert model_hash(got.parameters) == expected
    return elapsed, cpu


async def bench_model(repeats: int, millions: int = 20) -> list[str]:
    parameters = make_model(millions * 1_000_000, model_tensors(millions))
    flat = b"".join(raw_bytes(t) for t in parameters.values())
    total = len(flat)
    lines = []
    async with open_nodes(4, model_codec=tensor_codec()) as nodes, trio.open_nursery() as nursery:
        *providers, joiner = nodes
        for provider in providers:
            model = SharableModel()
            model.update_parameters(parameters)
            model.update_config("{}", "{}")
            serve_as_a_client(nursery, provider, model)
            joiner.address_book.add(provider.endpoint_addr())
        ids = [p.endpoint_id for p in providers]
        fetch = partial(timed_model_fetch, joiner, ids, model_hash(parameters))

        cold = await fetch()  # opens the 3 peers' blob sessions; providers serialize ahead
        base, warm = await interleaved_medians(repeats, lambda: raw_transfer_seconds(flat), fetch)
        lines.append(
            row(
                f"model {millions}M bf16 ({total / MIB:.0f} MiB)",
                base,
                [("3 peers cold", cold), ("3 peers warm", warm)],
                total,
            )
        )
        nursery.cancel_scope.cancel()
    return lines


# ---- model sharing, one process per node --------------------------------------------------------


async def serve_model_process(millions: int, key_hex: str, joiner_hex: str, bind: str) -> None:
    """A provider in a process of its own (`--serve-model`): prints its signed address record,
    then serves the model until stdin closes; a line `raw HOST PORT` makes it send the model's
    raw bytes once over a plain TCP connection to HOST:PORT (the baseline, between processes
    too)."""
    import sys

    from psyche.core.identity import SecretKey

    parameters = make_model(millions * 1_000_000, model_tensors(millions))
    flat = b"".join(raw_bytes(t) for t in parameters.values())
    key = SecretKey.from_bytes(bytes.fromhex(key_hex))
    async with open_nodes(
        1, keys=[key], allow_each_other=False, model_codec=tensor_codec(), bind_host=bind
    ) as (node,):
        node.set_allowed_peers([bytes.fromhex(joiner_hex)])
        model = SharableModel()
        model.update_parameters(parameters)
        model.update_config("{}", "{}")
        async with trio.open_nursery() as nursery:
            serve_as_a_client(nursery, node, model)
            await wait_until(lambda: bool(node.own_record), 30)
            print(node.own_record.hex(), flush=True)
            stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
            pending = b""
            while chunk := await stdin.receive_some():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    _, host, port = line.decode().split()
                    stream = await trio.open_tcp_stream(host, int(port))
                    _tune(stream.socket)
                    await stream.send_all(memoryview(flat))
                    await stream.aclose()
            nursery.cancel_scope.cancel()


def _tune(sock: Any) -> None:
    """The socket options the blob side channel sets (`blob_transport`), for the baseline."""
    import socket

    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)


def model_tensors(millions: int) -> int:
    # 40 tensors for 20M as before; larger models get tensors of the same ~0.5M-parameter size
    # order as a 300M Llama's (about 2 tensors per million parameters)
    return 40 if millions <= 20 else 2 * millions


async def bench_model_processes(
    repeats: int,
    millions: int = 20,
    *,
    bind: str = "127.0.0.1",
    provider_hosts: list[tuple[str, str]] | None = None,
    label: str = "",
) -> list[str]:
    """`bench_model` with each provider in a process of its own, as on separate machines
    (sharing this machine's cores): the joiner's own costs against one raw socket from a
    provider process. `provider_hosts`: (network namespace, address) of each provider, which
    then runs inside that namespace (`--link-mbit`), this process being in the joiner's.

    Printed: cold (a fresh joiner node each time: new connections and blob sessions, one
    fetch; the first also meets the providers' first serialization) and warm (connections and
    sessions kept) ratios, each the median of `repeats` interleaved with the raw socket (the
    raw socket's median over both), and the joiner's CPU time (event loop and worker threads)
    per byte against the raw socket's receive, each a median. The load average is printed at
    the end: on a shared machine it says what the figures were measured under."""
    import subprocess
    import sys

    from psyche.core.identity import SecretKey

    parameters = make_model(millions * 1_000_000, model_tensors(millions))
    expected = model_hash(parameters)
    total = sum(t.numel() * t.element_size() for t in parameters.values())
    del parameters
    joiner_key = SecretKey.generate()
    keys = [SecretKey.generate() for _ in range(3)]
    hosts = provider_hosts or [("", bind)] * 3
    command = [sys.executable, __file__, "--serve-model", str(millions)]
    providers = [
        subprocess.Popen(
            [
                *(["ip", "netns", "exec", ns] if ns else []),
                *command,
                k.to_bytes().hex(),
                joiner_key.public_key.hex(),
                "--bind",
                host,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k, (ns, host) in zip(keys, hosts, strict=True)
    ]
    cpu_raw: list[float] = []
    cpu_ours: list[float] = []
    cpu_cold: list[float] = []
    raws: list[float] = []
    try:
        records = [
            bytes.fromhex(await trio.to_thread.run_sync(p.stdout.readline))  # type: ignore[union-attr]
            for p in providers
        ]

        def joiner_node() -> Any:
            """The joiner, a fresh node (new connections, no blob sessions) each time: same key."""
            return open_nodes(
                1,
                keys=[joiner_key],
                allow_each_other=False,
                model_codec=tensor_codec(),
                bind_host=bind,
            )

        def introduce(joiner: NetworkConnection) -> None:
            joiner.set_allowed_peers([k.public_key for k in keys])
            for record in records:
                joiner.address_book.add_record(record)

        ids = [k.public_key for k in keys]

        async def fetch_on(joiner: NetworkConnection) -> float:
            elapsed, cpu = await timed_model_fetch_cpu(joiner, ids, expected)
            cpu_ours.append(cpu)
            return elapsed

        async def cold_fetch() -> float:
            async with joiner_node() as (joiner,):
                introduce(joiner)
                elapsed = await fetch_on(joiner)
                cpu_cold.append(cpu_ours.pop())
                return elapsed

        async def raw() -> float:
            listeners = await trio.open_tcp_listeners(0, host=bind)
            port = listeners[0].socket.getsockname()[1]
            _tune(listeners[0].socket)
            buf = bytearray(total)
            cpu = time.process_time()
            start = time.perf_counter()
            providers[0].stdin.write(f"raw {bind} {port}\n")  # type: ignore[union-attr]
            providers[0].stdin.flush()  # type: ignore[union-attr]
            stream = await listeners[0].accept()
            await receive_exactly(stream, buf)
            elapsed = time.perf_counter() - start
            cpu_raw.append(time.process_time() - cpu)
            await stream.aclose()
            await listeners[0].aclose()
            raws.append(elapsed)
            return elapsed

        _, cold = await interleaved_medians(repeats, raw, cold_fetch)
        async with joiner_node() as (joiner,):
            introduce(joiner)
            await fetch_on(joiner)  # connections and sessions up: what follows is warm
            cpu_ours.pop()
            _, warm = await interleaved_medians(repeats, raw, partial(fetch_on, joiner))
    finally:
        stop_providers(providers)
    raw_cpu, warm_cpu = statistics.median(cpu_raw), statistics.median(cpu_ours)
    cold_cpu, base = statistics.median(cpu_cold), statistics.median(raws)
    return [
        row(
            label or f"model {millions}M, 1 process/node",
            base,
            [("3 peers cold", cold), ("3 peers warm", warm)],
            total,
        ),
        f"{'':24} joiner CPU per MiB: raw receive {raw_cpu / total * MIB * 1e3:6.2f} ms | "
        f"cold {cold_cpu / total * MIB * 1e3:6.2f} ms ({cold_cpu / raw_cpu:5.1f}x raw) | "
        f"warm {warm_cpu / total * MIB * 1e3:6.2f} ms ({warm_cpu / raw_cpu:5.1f}x raw) | "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
    ]


def stop_providers(providers: list[Any]) -> None:
    """End provider processes (`--serve-model`): their stdin closed, killed after 30 s."""
    import subprocess

    for p in providers:
        p.stdin.close()
    for p in providers:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


# ---- model sharing over a shaped link -----------------------------------------------------------


def link_benchmark(mbit: int, repeats: int, millions: int, sources: list[tuple[str, str]]) -> None:
    """`--link-mbit`: the joiner and each provider in a network namespace of its own, all on one
    bridge (`tests/netns.py`, 198.18.0.0/15, deleted at the end), the bridge's port towards the
    joiner a token bucket of `mbit` Mbit/s: a joiner whose downlink is the bottleneck, as on a
    real network. The one-process-per-node benchmark runs in the joiner's namespace once per
    source tree in `sources` (label, packages directory or "" for this checkout), in the same
    sitting and on the same link."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[2] / "tests"
    sys.path.insert(0, str(tests))
    import netns

    reason = netns.unavailable()
    if reason is not None:
        sys.exit(f"network: --link-mbit: {reason}")
    with netns.nat_topology(nat_hosts=0, public_hosts=4) as net:
        joiner, *providers = net.public
        netns.run(
            "tc", "-n", net.wan.ns, "qdisc", "add", "dev", "q1", "root", "tbf",
            "rate", f"{mbit}mbit", "burst", "512kb", "latency", "50ms",
        )  # fmt: skip
        where = ",".join(f"{p.ns}={p.ip}" for p in providers)
        for label, packages in sources:
            env = dict(os.environ)
            if packages:
                env["PYTHONPATH"] = ":".join(str(p) for p in sorted(Path(packages).glob("*/src")))
            argv = [
                sys.executable, __file__, "--only", "model-processes", "--repeats", str(repeats),
                "--millions", str(millions), "--bind", joiner.ip, "--providers-in", where,
                "--label", f"{label} {millions}M {mbit} Mbit/s".strip(),
            ]  # fmt: skip
            subprocess.run(net.exec(joiner, argv), env=env, check=True, timeout=900)


def run_old_checkout(packages: Path) -> None:
    """This benchmark, with the same arguments, on another checkout's packages (`--old-src`):
    its sources first on PYTHONPATH, run before this checkout's in the same sitting."""
    import subprocess
    import sys

    argv = sys.argv[1:]
    at = argv.index("--old-src")
    del argv[at : at + 2]
    env = dict(os.environ)
    env["PYTHONPATH"] = ":".join(str(p) for p in sorted(packages.glob("*/src")))
    print(f"--- the packages in {packages}:", flush=True)
    subprocess.run([sys.executable, __file__, *argv], env=env, check=True, timeout=1800)
    print("--- this checkout:", flush=True)


async def main(repeats: int, gossip_rounds: int, only: str | None, args: Any) -> None:
    print(
        f"psyche.network benchmark (median of {repeats}, interleaved; "
        "ratio = raw socket time / our time)",
        flush=True,
    )
    where = [
        (ns, host) for ns, _, host in (p.partition("=") for p in args.providers_in.split(","))
    ] if args.providers_in else None  # fmt: skip
    parts = {
        "blobs": lambda: bench_blobs(repeats),
        "paths": lambda: bench_paths(repeats),
        "gossip": lambda: bench_gossip_ring(gossip_rounds),
        "gossip-mirror": lambda: bench_gossip_mirror(gossip_rounds),
        "tracker": lambda: bench_tracker(repeats),
        "crypto": lambda: bench_crypto(repeats),
        "model": lambda: bench_model(repeats),
        "model-processes": lambda: bench_model_processes(
            repeats, args.millions, bind=args.bind, provider_hosts=where, label=args.label
        ),
        "model300": lambda: bench_model(max(1, repeats // 2), 300),
        "model300-processes": lambda: bench_model_processes(max(1, repeats // 2), 300),
    }
    for name, part in parts.items():
        if only == name or (only is None and not name.startswith("model300")):
            for line in await part():
                print(line, flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gossip-rounds", type=int, default=30)
    parser.add_argument(
        "--only",
        choices=[
            "blobs", "paths", "gossip", "gossip-mirror", "tracker", "crypto", "model", "model-processes", "model300",
            "model300-processes",
        ],
        help="run one part",
    )  # fmt: skip
    parser.add_argument("--millions", type=int, default=20,
                        help="model-processes and --link-mbit: the model's size")  # fmt: skip
    parser.add_argument("--link-mbit", type=int,
                        help="model sharing, one process per node, each in a network namespace "
                        "behind a link of this many Mbit/s into the joiner (needs root)")  # fmt: skip
    parser.add_argument("--old-src", type=Path,
                        help="also run another checkout's packages/ directory first (its sources "
                        "on PYTHONPATH), in the same sitting")  # fmt: skip
    parser.add_argument("--sittings", type=int, default=1,
                        help="with --link-mbit: run the sources in turn this many times")  # fmt: skip
    parser.add_argument("--serve-model", nargs=3, metavar=("MILLIONS", "KEY", "JOINER"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--providers-in", help=argparse.SUPPRESS)
    parser.add_argument("--label", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # shutdown races it reports as errors
    if args.serve_model:
        millions, key, joiner = args.serve_model
        trio.run(serve_model_process, int(millions), key, joiner, args.bind)
    elif args.link_mbit:
        old = [("main", str(args.old_src))] if args.old_src else []
        sources = [*old, ("this", "")] * args.sittings
        link_benchmark(args.link_mbit, args.repeats, args.millions, sources)
    else:
        if args.old_src:
            run_old_checkout(args.old_src)
        trio.run(main, args.repeats, args.gossip_rounds, args.only, args)
