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
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "network")]

import netns  # noqa: E402
from nat_roles import wait_file  # noqa: E402

ROLES = TESTS / "network" / "nat_roles.py"
"""The nodes (relay, provider, requesters, raw-socket ends), shared with the NAT tests."""
SIZE = 40_000_000
MIB = 1 << 20


# ---- orchestration ----------------------------------------------------------------------------


def spawn(net, host, workdir: Path, *args: str) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    argv = net.exec(host, [sys.executable, str(ROLES), "--workdir", str(workdir), *args])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


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
    args = parser.parse_args()
    orchestrate(args.trials, args.repeats)


if __name__ == "__main__":
    main()
