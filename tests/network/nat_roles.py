"""The nodes of the NAT tests and benchmarks, one process each, run inside a namespace of
`tests/netns.py` (`python tests/network/nat_roles.py --workdir DIR --role ROLE ...`).

They meet through files in `DIR` (each waits for the files it needs, so all may start at once):
the relay writes its address to `relay`, the provider its signed address record and its blob's
hash and size to `provider.json`; a requester prints one JSON line
with what it measured. Identities are test keys (`key(n)`); the provider allows keys
1..`members`; the relay serves anyone (only namespaces reach it).

* `relay`: a circuit relay on the public segment (`psyche.network.relay`);
* `provider`: a `NetworkConnection` holding one blob of `--size` bytes (seeded random bytes);
* `requester` (`--mode bench`): connects to the provider (through its relay), waits up to
  `--punch-wait` s for hole punching to make the path direct, then fetches the blob
  `--repeats` times on libp2p streams, timing each;
* `requester` (`--mode fallback`): connects, waits for the direct path, gossips `before` (and
  waits for the provider to have it), writes `direct`, waits for the test to cut that path (file
  `blocked`), gossips `after` at once, then downloads the blob as a client does
  (`start_download`: routes, attempt timeouts, retries) and reports the route it took. The
  provider writes each message it receives to `received-<message>` (JSON: how many messages
  came first by their mirrored copy on the relay).
* `raw-sink` / `raw-source`: a raw TCP transfer of the same bytes (the benchmarks' baseline).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import netns

MIB = 1 << 20
PROVIDER_KEY = 1
RELAY_PORT = 20002
RAW_PORT = 20900


def key(number: int):  # type: ignore[no-untyped-def]
    from psyche.core.identity import SecretKey

    return SecretKey.from_bytes(number.to_bytes(32, "big"))


def blob(size: int) -> bytes:
    return random.Random(16).randbytes(size)


def wait_file(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear in {timeout} s")
        time.sleep(0.05)


async def role_relay(workdir: Path) -> None:
    import trio

    from psyche.network.relay import RelayOptions, open_relay

    options = RelayOptions(announce_host=netns.WAN_IP, port=RELAY_PORT)
    async with open_relay(key(1000), lambda k: True, options) as relay:
        (workdir / "relay").write_text(relay.multiaddrs()[0])
        await trio.sleep_forever()


def open_node(workdir: Path, number: int):  # type: ignore[no-untyped-def]
    from psyche.network.connection import NetworkConfig, NetworkConnection

    wait_file(workdir / "relay")
    config = NetworkConfig(
        run_id="nat",
        secret_key=key(number),
        relays=((workdir / "relay").read_text(),),
    )
    return NetworkConnection.open(config, broadcast_type=bytes, distro_result_type=bytes)


async def role_provider(workdir: Path, members: int, size: int) -> None:
    from psyche.network.events import MessageReceived

    async with open_node(workdir, PROVIDER_KEY) as node:
        node.set_allowed_peers(key(n).public_key for n in range(1, members + 1))
        ticket, _ = await node.add_downloadable(blob(size), "blob")
        info = {"record": node.own_record.hex(), "hash": ticket.hash.hex(), "size": ticket.size}
        (workdir / "provider.json").write_text(json.dumps(info))
        async for event in node:
            if isinstance(event, MessageReceived):
                said = {"mirrored_first": node.gossip.mirrored_first}
                (workdir / f"received-{event.message.decode()}").write_text(json.dumps(said))


async def role_requester(
    workdir: Path, number: int, mode: str, repeats: int, punch_wait: float
) -> None:
    import trio

    from psyche.network.discovery import verify_address_record
    from psyche.network.download import DownloadComplete
    from psyche.network.p2p_host import connection_paths
    from psyche.network.ticket import BlobFormat, BlobTicket
    from psyche.network.transmittable import DownloadType

    await trio.to_thread.run_sync(wait_file, workdir / "provider.json")
    info = json.loads((workdir / "provider.json").read_text())
    record = bytes.fromhex(info["record"])
    ticket = BlobTicket(
        verify_address_record(record), BlobFormat.Raw, bytes.fromhex(info["hash"]), info["size"]
    )
    provider = key(PROVIDER_KEY).public_key
    result: dict[str, object] = {}
    async with open_node(workdir, number) as node:
        node.set_allowed_peers([provider, node.endpoint_id])
        node.address_book.add_record(record)
        start = time.perf_counter()
        await node.connect(provider)
        result["connect_secs"] = time.perf_counter() - start
        result["first_paths"] = connection_paths(node.host, provider)
        result["punched_after_secs"] = None
        with trio.move_on_after(punch_wait):
            while "direct" not in connection_paths(node.host, provider):
                await trio.sleep(0.05)
            result["punched_after_secs"] = time.perf_counter() - start - result["connect_secs"]
        if mode == "fallback":
            await gossip_on_the_direct_connection(node, provider, workdir)
            (workdir / "direct").write_text(str(result["punched_after_secs"]))
            await trio.to_thread.run_sync(wait_file, workdir / "blocked")
            node.broadcast(b"after")
            start = time.perf_counter()
            with trio.fail_after(120):
                done = await node.start_download(
                    ticket, "blob", DownloadType.DistroResult([])
                ).finished()
            result["download_secs"] = time.perf_counter() - start
            result["complete"] = isinstance(done, DownloadComplete) and bytes(done.data) == blob(
                len(done.data)
            )
            result["route"] = node.blob_routes.routes.get(provider)
            result["direct_suspected"] = node.blob_routes.direct_suspected(provider)
            with trio.move_on_after(30):  # the pings that follow the stall close it
                while "direct" in connection_paths(node.host, provider):
                    await trio.sleep(0.1)
            result["paths_after"] = connection_paths(node.host, provider)
        else:
            await trio.sleep(0.5)
            times, paths = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                session, relayed = await node.blob_streams.open_session(provider)
                try:
                    got = await session.fetch(ticket.hash, ticket.size, lambda n: None)
                finally:
                    await session.stream.aclose()
                times.append(time.perf_counter() - t0)
                paths.append("relayed" if relayed else "direct")
                assert len(got) == ticket.size
            result["fetch_secs"], result["paths"] = times, paths
    print(json.dumps(result), flush=True)


async def gossip_on_the_direct_connection(node: Any, peer: bytes, workdir: Path) -> None:
    """Move gossip's stream to `peer` onto the punched connection and see a message arrive on it.

    py-libp2p keeps one gossip stream per peer, opened on the first connection (here the relayed
    one), and opens it again, on the direct connection it prefers, whenever that stream fails
    (a reset, a muxer error): in a long run gossip ends up on the punched path. Resetting the
    stream here makes that happen now (both sides re-open theirs)."""
    import trio

    from psyche.network.identity import peer_id_from_public_key
    from psyche.network.p2p_host import is_relayed

    pubsub = node.gossip.pubsub
    pid = peer_id_from_public_key(peer)
    await pubsub.peers[pid].reset()
    first_on_direct = None
    with trio.fail_after(60):  # re-opened streams and the mesh form on heartbeats
        for attempt in itertools.count():
            stream = pubsub.peers.get(pid)
            if stream is not None and not is_relayed(stream.muxed_conn):
                first_on_direct = attempt if first_on_direct is None else first_on_direct
                if any(
                    int(f.name.rsplit("-", 1)[1]) >= first_on_direct
                    for f in workdir.glob("received-before-*")
                ):
                    return
            node.broadcast(f"before-{attempt}".encode())
            await trio.sleep(1)


def role_raw_sink(workdir: Path, size: int, count: int) -> None:
    """Accept `count` connections on the public segment, each bringing `size` bytes; print the
    seconds each took from its first byte."""
    with socket.create_server((netns.WAN_IP, RAW_PORT)) as server:
        (workdir / "sink-ready").write_text("")
        samples = []
        view = memoryview(bytearray(size))
        for _ in range(count):
            conn, _ = server.accept()
            with conn:
                got = conn.recv_into(view[:1])
                start = time.perf_counter()
                while got < size and (n := conn.recv_into(view[got : got + MIB])):
                    got += n
                samples.append(time.perf_counter() - start)
                conn.sendall(b"k")
    print(json.dumps({"raw_secs": samples}), flush=True)


def role_raw_source(size: int, count: int) -> None:
    data = blob(size)
    for _ in range(count):
        with socket.create_connection((netns.WAN_IP, RAW_PORT)) as conn:
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--role", required=True)
    parser.add_argument("--mode", default="bench", choices=["bench", "fallback"])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--number", type=int, default=2)
    parser.add_argument("--size", type=int, default=40_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--punch-wait", type=float, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    import trio

    match args.role:
        case "relay":
            trio.run(role_relay, args.workdir)
        case "provider":
            trio.run(role_provider, args.workdir, args.members, args.size)
        case "requester":
            trio.run(
                role_requester, args.workdir, args.number, args.mode, args.repeats, args.punch_wait
            )
        case "raw-sink":
            role_raw_sink(args.workdir, args.size, args.repeats)
        case "raw-source":
            role_raw_source(args.size, args.repeats)


if __name__ == "__main__":
    main()
