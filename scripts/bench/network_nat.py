"""Benchmark NAT traversal in real network namespaces (`tests/netns.py`; needs root, `ip`, `nft`).

Topology: a circuit relay (`psyche.network.relay`) on the public segment; a provider behind a
"cone" NAT (it keeps source ports, so TCP hole punching can work); requesters behind a second
cone NAT and behind a port-randomizing NAT (no hole punch gets through). Every node is its own
process, as in a run. Measured:

* hole punching, cone to cone: over `--trials` fresh requesters (new identity each), how many
  ended on a direct connection, and how long from the relayed connection to the direct one;
* a 40 MB blob (a 20M-parameter bf16 model) over a libp2p stream on the punched (direct)
  connection and through the relay (from behind the port-randomizing NAT), against a raw TCP
  socket between the provider's namespace and the public segment (the same veth links and one
  NAT), measured in the same run. Ratio = raw socket time / our time.

Run as root: .venv/bin/python scripts/bench/network_nat.py [--trials N] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import netns

SIZE = 40_000_000
MIB = 1 << 20
PROVIDER_KEY = 1
RAW_PORT = 20900


# ---- roles (each runs in its own process, inside a namespace) -------------------------------


def key(number: int):  # type: ignore[no-untyped-def]
    from psyche.core.identity import SecretKey

    return SecretKey.from_bytes(number.to_bytes(32, "big"))


def blob() -> bytes:
    import random

    return random.Random(16).randbytes(SIZE)


async def role_relay(workdir: Path) -> None:
    import trio

    from psyche.network.relay import RelayOptions, open_relay

    options = RelayOptions(announce_host=netns.WAN_IP, port=20002)
    async with open_relay(key(1000), lambda k: True, options) as relay:
        (workdir / "relay").write_text(relay.multiaddrs()[0])
        await trio.sleep_forever()


async def open_node(workdir: Path, number: int):  # type: ignore[no-untyped-def]
    from psyche.network.connection import NetworkConfig, NetworkConnection

    relay = (workdir / "relay").read_text()
    config = NetworkConfig(run_id="bench", secret_key=key(number), relays=(relay,))
    return NetworkConnection.open(config, broadcast_type=bytes, distro_result_type=bytes)


async def role_provider(workdir: Path, members: int) -> None:
    import trio

    async with await open_node(workdir, PROVIDER_KEY) as node:
        node.set_allowed_peers(key(n).public_key for n in range(1, members + 2))
        ticket, _ = await node.add_downloadable(blob(), "bench")
        info = {"record": node.own_record.hex(), "hash": ticket.hash.hex(), "size": ticket.size}
        (workdir / "provider.json").write_text(json.dumps(info))
        await trio.sleep_forever()


async def role_requester(workdir: Path, number: int, repeats: int, punch_wait: float) -> None:
    """Connect to the provider (its record names its relay), wait up to `punch_wait` s for a
    direct path, then fetch the blob `repeats` times on a libp2p stream; print one JSON line."""
    import trio

    from psyche.network.p2p_host import connection_paths

    info = json.loads((workdir / "provider.json").read_text())
    provider = key(PROVIDER_KEY).public_key
    async with await open_node(workdir, number) as node:
        node.set_allowed_peers([provider, node.endpoint_id])
        node.address_book.add_record(bytes.fromhex(info["record"]))
        start = time.perf_counter()
        await node.connect(provider)
        connected = time.perf_counter() - start
        first_path = connection_paths(node.host, provider)
        punched_after = None
        with trio.move_on_after(punch_wait):
            while "direct" not in connection_paths(node.host, provider):
                await trio.sleep(0.05)
            punched_after = time.perf_counter() - start - connected
        await trio.sleep(0.5)
        times, paths = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            session, relayed = await node.blob_streams.open_session(provider)
            try:
                got = await session.fetch(bytes.fromhex(info["hash"]), info["size"], lambda n: None)
            finally:
                await session.stream.aclose()
            times.append(time.perf_counter() - t0)
            paths.append("relayed" if relayed else "direct")
            assert len(got) == info["size"]
        result = {
            "connect_secs": connected,
            "first_path": first_path,
            "punched_after_secs": punched_after,
            "fetch_secs": times,
            "paths": paths,
        }
        print(json.dumps(result), flush=True)


def role_raw_sink(workdir: Path) -> None:
    """Accept one connection on the public segment and read `SIZE` bytes; print the seconds."""
    import socket

    with socket.create_server((netns.WAN_IP, RAW_PORT)) as server:
        (workdir / "sink-ready").write_text("")
        samples = []
        buf = bytearray(SIZE)
        view = memoryview(buf)
        while True:
            conn, _ = server.accept()
            with conn:
                first = conn.recv_into(view[:1])
                start = time.perf_counter()
                got = first
                while got < SIZE:
                    n = conn.recv_into(view[got : got + MIB])
                    if not n:
                        break
                    got += n
                samples.append(time.perf_counter() - start)
                conn.sendall(b"k")
            if len(samples) >= int((workdir / "raw-count").read_text()):
                break
    print(json.dumps({"raw_secs": samples}), flush=True)


def role_raw_source(workdir: Path) -> None:
    import socket

    data = blob()
    count = int((workdir / "raw-count").read_text())
    for _ in range(count):
        with socket.create_connection((netns.WAN_IP, RAW_PORT)) as conn:
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)


# ---- orchestration ----------------------------------------------------------------------------


def spawn(net, host, workdir: Path, *args: str) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    argv = net.exec(host, [sys.executable, __file__, "--workdir", str(workdir), *args])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def wait_file(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear")
        time.sleep(0.1)


def result_of(proc: subprocess.Popen[str], timeout: float) -> dict:  # type: ignore[type-arg]
    out, _ = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"no result (exit {proc.returncode})")
    return json.loads(lines[-1])


def orchestrate(trials: int, repeats: int) -> None:
    reason = netns.unavailable()
    if reason is not None:
        sys.exit(f"network_nat: {reason}")
    with tempfile.TemporaryDirectory() as tmp, netns.nat_topology(3, symmetric=[3]) as net:
        workdir = Path(tmp)
        provider_host, cone, symmetric = net.nat
        started = [spawn(net, net.wan, workdir, "--role", "relay")]
        try:
            wait_file(workdir / "relay")
            started.append(
                spawn(
                    net, provider_host, workdir, "--role", "provider", "--members", str(trials + 2)
                )
            )
            wait_file(workdir / "provider.json")

            # raw socket baseline over the same links: provider's namespace -> public segment
            (workdir / "raw-count").write_text(str(repeats))
            sink = spawn(net, net.wan, workdir, "--role", "raw-sink")
            wait_file(workdir / "sink-ready")
            spawn(net, provider_host, workdir, "--role", "raw-source").wait(120)
            raw = statistics.median(result_of(sink, 60)["raw_secs"])

            punches = []
            direct_times: list[float] = []
            for trial in range(trials):
                requester = spawn(
                    net, cone, workdir, "--role", "requester", "--number", str(trial + 2),
                    "--repeats", str(repeats if trial == 0 else 1), "--punch-wait", "30",
                )  # fmt: skip
                result = result_of(requester, 180)
                punches.append(result)
                if trial == 0:
                    direct_times = [
                        t
                        for t, p in zip(result["fetch_secs"], result["paths"], strict=True)
                        if p == "direct"
                    ]
            last = spawn(
                net, symmetric, workdir, "--role", "requester", "--number", str(trials + 2),
                "--repeats", str(repeats), "--punch-wait", "10",
            )  # fmt: skip
            relayed = result_of(last, 240)
        finally:
            for proc in started:
                proc.kill()
                proc.wait()

    ok = [p for p in punches if p["punched_after_secs"] is not None]
    print(f"NAT traversal in namespaces (2 cone NATs, 1 port-randomizing NAT; median of {repeats})")
    print(
        f"hole punch cone<->cone: {len(ok)}/{len(punches)} direct; time from the relayed "
        "connection to the direct one: "
        + (
            f"median {statistics.median(p['punched_after_secs'] for p in ok):.2f} s, "
            f"max {max(p['punched_after_secs'] for p in ok):.2f} s"
            if ok
            else "n/a"
        )
        + f"; connect through the relay: median "
        f"{statistics.median(p['connect_secs'] for p in punches):.2f} s"
    )
    print(
        f"hole punch through the port-randomizing NAT: "
        f"{'direct' if relayed['punched_after_secs'] is not None else 'failed (stays relayed)'}"
    )

    def line(label: str, seconds: float) -> str:
        return (
            f"  {label:<28} {seconds * 1000:8.1f} ms {SIZE / seconds / MIB:6.0f} MiB/s "
            f"ratio {raw / seconds:5.2f}"
        )

    print(f"blob 40 MB: raw socket provider->public segment {raw * 1000:.1f} ms "
          f"({SIZE / raw / MIB:.0f} MiB/s)")  # fmt: skip
    if direct_times:
        print(line("libp2p stream, punched path", statistics.median(direct_times)))
    relay_times = [
        t for t, p in zip(relayed["fetch_secs"], relayed["paths"], strict=True) if p == "relayed"
    ]
    if relay_times:
        print(line("libp2p stream via the relay", statistics.median(relay_times)))
    if direct_times and relay_times:
        print(
            f"  relay vs punched path: ratio "
            f"{statistics.median(direct_times) / statistics.median(relay_times):5.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--members", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--number", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--punch-wait", type=float, default=30, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    if args.role is None:
        orchestrate(args.trials, args.repeats)
        return
    import trio

    match args.role:
        case "relay":
            trio.run(role_relay, args.workdir)
        case "provider":
            trio.run(role_provider, args.workdir, args.members)
        case "requester":
            trio.run(role_requester, args.workdir, args.number, args.repeats, args.punch_wait)
        case "raw-sink":
            role_raw_sink(args.workdir)
        case "raw-source":
            role_raw_source(args.workdir)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
