"""Figures of three attacks on psyche.network (issue 24, items 1, 4 and 5), each against a quiet
baseline measured in the same run, all nodes in this one process on 127.0.0.1 (VmRSS is the
whole process's: victim and attacker together; the attacker holds only sockets, or the junk
blob it offers, which is counted in "before").

* silent-flood: 2000 TCP connections from 127.0.0.1 that never send a byte (50 held at once,
  the host evicting the older ones) at a client's libp2p host; then a member dials in. Figures:
  whether it got in and how long its dial took, against the same dial before the flood.
* junk-result: a member offers a 512 MiB blob of random bytes as its result; the requester
  downloads it as a client would (with the bound configs/tiny-cpu's run sets: 7599 bytes, when
  this code has one). Figures: seconds to the outcome, VmRSS before / peak / after.
* gossip-pump: a member writes 64 MiB into a gossip stream to a relay for at most 20 s.
  Figures: bytes it got written, seconds, against a quiet window of the same length.

    .venv/bin/python scripts/bench/network_attacks.py [--old-src OLD/packages]

`--old-src` runs the same attacks on another checkout's psyche-network first (its packages
first on PYTHONPATH) and then on this one's.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
FLOOD = 2000
HELD = 50
JUNK = 512 * MIB
TINY_BOUND = 7599
"""`Trainer.max_payload_size()` of configs/tiny-cpu's run (its model; DisTrO chunk 16, top-k 8,
1-bit values)."""
PUMP = 64 * MIB
PUMP_SECS = 20.0


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def sampled_peak(stop: trio.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        await trio.sleep(0.02)


def tcp_port(multiaddr: str) -> int:
    parts = multiaddr.split("/")
    return int(parts[parts.index("tcp") + 1])


async def timed_dial(member, victim) -> str:  # type: ignore[no-untyped-def]
    from psyche.network import p2p_host
    from psyche.network.testing import introduce

    introduce(member, victim)
    start = time.perf_counter()
    try:
        with trio.fail_after(15):
            await member.connect(victim.endpoint_id)
    except Exception as e:
        return f"refused ({type(e).__name__}) after {time.perf_counter() - start:.2f} s"
    took = time.perf_counter() - start
    await p2p_host.disconnect(member.host, victim.endpoint_id)
    await trio.sleep(0.5)
    return f"in, {took:.2f} s"


def this_checkouts_flood() -> Any:
    """`psyche.network.testing.silent_flood` of this checkout, whichever `psyche.network` is
    measured (the previous one has no such helper)."""
    path = REPO / "packages/psyche-network/src/psyche/network/testing.py"
    spec = importlib.util.spec_from_file_location("_this_checkouts_testing", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.silent_flood


async def flood_then_dial() -> str:
    from psyche.network.testing import open_nodes

    silent_flood = this_checkouts_flood()

    async with open_nodes(2) as (victim, member):
        quiet = await timed_dial(member, victim)
        port = tcp_port(str(victim.host.get_transport_addrs()[0]))
        before, peak, stop = rss(), [rss()], trio.Event()
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampled_peak, stop, peak)
            await silent_flood(port, FLOOD, HELD)
            flood_secs = time.perf_counter() - start
            await trio.sleep(1.0)
            stop.set()
        after = rss()
        attacked = await timed_dial(member, victim)
        return (
            f"| silent-flood | quiet dial: {quiet} | {FLOOD} connections in {flood_secs:.1f} s; "
            f"then the member's dial: {attacked} | {mb(before)} / {mb(peak[0])} / {mb(after)} |"
        )


async def junk_result() -> str:
    from psyche.network.download import DownloadComplete
    from psyche.network.testing import introduce, open_nodes
    from psyche.network.ticket import BlobFormat, BlobTicket, blob_hash
    from psyche.network.transmittable import DownloadType

    async with open_nodes(2) as (provider, requester):
        introduce(requester, provider)
        junk = os.urandom(JUNK)
        digest = await trio.to_thread.run_sync(blob_hash, junk)
        provider.store.put(digest, junk, "offered")
        ticket = BlobTicket(provider.endpoint_addr(), BlobFormat.Raw, digest, JUNK)
        bounded = "max_size" in inspect.signature(requester.start_download).parameters
        extra = (TINY_BOUND,) if bounded else ()
        before, peak, stop = rss(), [rss()], trio.Event()
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampled_peak, stop, peak)
            download = requester.start_download(
                ticket, "downloaded-distro-result-x_1", DownloadType.DistroResult([]), *extra
            )
            outcome = await download.finished()
            took = time.perf_counter() - start
            await trio.sleep(1.0)
            stop.set()
        after = rss()
        what = "decoded" if isinstance(outcome, DownloadComplete) else outcome.error[:60]
        kept = "kept" if requester.store.has(digest) else "not kept"
        return (
            f"| junk-result ({JUNK // MIB} MiB) | {what}; {kept}; served "
            f"{provider.bytes_served / MIB:.0f} MiB | {took:.2f} s | "
            f"{mb(before)} / {mb(peak[0])} / {mb(after)} |"
        )


async def gossip_pump() -> str:
    from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11

    from psyche.core.identity import SecretKey
    from psyche.network.identity import peer_id_from_public_key
    from psyche.network.reachability import relay_peer
    from psyche.network.relay import RelayOptions, open_relay
    from psyche.network.testing import open_nodes, wait_until

    key = SecretKey.generate()
    async with (
        open_relay(
            SecretKey.generate(), lambda k: k == key.public_key, RelayOptions("127.0.0.1")
        ) as relay,
        open_nodes(1, keys=[key], relays=tuple(relay.multiaddrs()), reachability="private") as (
            member,
        ),
    ):
        await wait_until(lambda: member.reachability.relayed_addrs() != [], 30)
        cpu0 = time.process_time()
        await trio.sleep(2.0)
        quiet_cpu = (time.process_time() - cpu0) / 2.0
        relay_id = peer_id_from_public_key(relay_peer(relay.multiaddrs()[0]))
        stream = await member.host.new_stream(relay_id, [PROTOCOL_ID_V11])
        chunk, sent = bytes(64 * 1024), 0
        start, cpu0 = time.perf_counter(), time.process_time()
        with trio.move_on_after(PUMP_SECS):
            try:
                while sent < PUMP:
                    await stream.write(chunk)
                    sent += len(chunk)
            except Exception:
                pass
        took = time.perf_counter() - start
        cpu = (time.process_time() - cpu0) / took
        return (
            f"| gossip-pump | {sent / MIB:.2f} MiB written in {took:.2f} s | process CPU "
            f"{cpu:.2f} s/s (quiet {quiet_cpu:.2f} s/s) |"
        )


def mb(n: int) -> str:
    return f"{n / 1e6:.0f}"


async def main() -> None:
    import psyche.network

    print(f"psyche.network from {Path(psyche.network.__file__).parent}")
    print("| attack | figures | | MB before / peak / after |")
    print("|---|---|---|---|")
    for attack in (flood_then_dial, junk_result, gossip_pump):
        print(await attack(), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old-src", type=Path, help="another checkout's packages/ directory")
    args = parser.parse_args()
    if args.old_src is not None:
        env = dict(os.environ)
        env["PYTHONPATH"] = ":".join(str(p) for p in sorted(args.old_src.glob("*/src")))
        subprocess.run([sys.executable, __file__], env=env, check=False, timeout=900)
    trio.run(main)
