"""A client across hosts (`--main-host`; `psyche.client.setup.hosts`, `sidecar`), in two network
namespaces the test builds (`tests/netns.py`: two hosts on one private segment, 198.18.0.0/15,
no route out, deleted after):

* host A runs the client's ranks 0 .. n-1 (tests/client/workers_leader.py `hosts`: DP=2n, n
  local ranks, the ranks' TCP store at A's address); host B runs `psyche-client sidecar
  --main-host A --world-size 2n --start-rank n --num-local-ranks n`, whose ranks join over gloo
  between the namespaces;
* 2 hosts x 2 ranks (DP=4) trains and applies a step: its payload bytes (DisTrO not
  sign-quantized, so every bit of the trained gradients shows), its loss and its parameters are
  those of a one-rank client, bit for bit. Each rank trains one of the one-rank client's
  micro-batches, and the ranks' gradients are added in rank order (`ParallelDims.
  reduce_gradients`), as the one-rank client accumulates its micro-batches: an all-reduce adds
  in an order of its own (gloo's ring starts each chunk at another rank) and differed in the last
  bits with four ranks;
* a rank on host B is SIGKILLed mid-training: the client stops with one line within a bounded
  time (its sidecar reports the death through the store), the sidecar exits 1, no process is
  left in either namespace;
* a client killed on host A takes host B's sidecar and rank with it;
* a frozen host B (SIGSTOP: nothing exits, no socket closes) is noticed by its silent heartbeat
  (these two with one rank per host, n = 1: what they check does not depend on n).

Needs root with `ip` and `nft` (`.ci/run` installs them); skips with the reason elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .. import netns
from ..timing import scaled
from .leaders import LEADER, Leader, pid_alive, wait_until

pytestmark = [pytest.mark.slow]

WHY_NOT = netns.unavailable()


class NamespacedLeader(Leader):
    """workers_leader.py `hosts` inside host A's namespace."""

    def __init__(
        self,
        net: netns.Topology,
        host: netns.Host,
        model_dir: Path,
        log: Path,
        per_host: int,
        silence_secs: float | None,
    ) -> None:
        self.log = log
        self.out = open(log, "wb")  # noqa: SIM115 (closed in stop)
        argv = [sys.executable, str(LEADER), "hosts", str(model_dir), host.ip, str(per_host)]
        if silence_secs is not None:
            argv.append(str(silence_secs))
        self.proc = subprocess.Popen(
            net.exec(host, argv),
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def start_sidecar(
    net: netns.Topology, host: netns.Host, main: netns.Host, log: Path, per_host: int
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "psyche.cli.client", "sidecar", "--main-host", main.ip,
        "--world-size", str(2 * per_host), "--start-rank", str(per_host),
        "--num-local-ranks", str(per_host), "--device", "cpu", "--cpu-threads", "1",
    ]  # fmt: skip
    return subprocess.Popen(
        net.exec(host, argv),
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def namespace_pids(host: netns.Host) -> list[int]:
    listed = netns.run("ip", "netns", "pids", host.ns, check=False).stdout.split()
    return [int(p) for p in listed if pid_alive(int(p))]


@dataclass
class Client:
    """The client across the test's two hosts: ranks 0 .. n-1 on A, the sidecar's on B."""

    a: netns.Host
    b: netns.Host
    leader: NamespacedLeader
    sidecar: subprocess.Popen[bytes]
    sidecar_log: Path


@pytest.fixture
def client(request: pytest.FixtureRequest, model_dir: Path, tmp_path: Path) -> Iterator[Client]:
    """Started in two fresh namespaces with `request.param` ranks per host (1 unless the test
    asks, indirectly), and the product's heartbeat silence unless the test is marked
    `silence_secs(S)` (a wait of S seconds on the tuning machine); whatever is left is killed,
    and the namespaces deleted, at the end."""
    if WHY_NOT is not None:
        pytest.skip(WHY_NOT)
    per_host = getattr(request, "param", 1)
    marker = request.node.get_closest_marker("silence_secs")
    silence = None if marker is None else scaled(marker.args[0])
    with netns.nat_topology(nat_hosts=0, public_hosts=2) as net:
        a, b = net.public
        log = tmp_path / "sidecar.log"
        sidecar = start_sidecar(net, b, a, log, per_host)  # first: it waits for the store
        leader = NamespacedLeader(net, a, model_dir, tmp_path / "leader.log", per_host, silence)
        try:
            yield Client(a, b, leader, sidecar, log)
        finally:
            for pid in namespace_pids(b):  # a frozen host's processes too
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            leader.stop()
            if sidecar.poll() is None:
                os.killpg(sidecar.pid, signal.SIGKILL)
            sidecar.wait()


@pytest.mark.parametrize("client", [2], indirect=True, ids=["2x2"])
def test_a_client_of_two_hosts_by_two_ranks_trains_as_one_rank_and_stops_with_a_dead_remote_rank(
    client: Client,
) -> None:
    leader, sidecar, log = client.leader, client.sidecar, client.sidecar_log
    assert leader.line("PAYLOAD_EQUAL") == ["True"], leader.tail()
    assert leader.line("LOSS_EQUAL") == ["True"], leader.tail()
    assert leader.line("PARAMS_EQUAL") == ["True"], leader.tail()
    assert leader.line("EVAL_EQUAL") == ["True"], leader.tail()
    leader.line("TRAINING")
    started = re.search(r"rank\(s\) 2 \(pid (\d+)\), 3 \(pid (\d+)\)", log.read_text())
    assert started is not None, log.read_text()
    time.sleep(1.0)
    os.kill(int(started[2]), signal.SIGKILL)
    stopped = leader.line("STOPPED", timeout=60.0)
    assert set(stopped) <= {"WorkerDied", "RuntimeError", "DistBackendError"}, stopped
    assert leader.proc.wait(timeout=60.0) == 3, leader.tail()
    assert sidecar.wait(timeout=60.0) == 1, log.read_text()
    assert "rank 3 exited (code -9)" in log.read_text()
    wait_until(
        lambda: not namespace_pids(client.a) and not namespace_pids(client.b), "no process left"
    )


def test_a_killed_client_takes_the_other_hosts_ranks_with_it(client: Client) -> None:
    client.leader.line("TRAINING")
    os.killpg(client.leader.proc.pid, signal.SIGKILL)
    client.leader.proc.wait()
    assert client.sidecar.wait(timeout=60.0) == 1, client.sidecar_log.read_text()
    wait_until(lambda: not namespace_pids(client.b), "host B's rank to exit", 30.0)


@pytest.mark.silence_secs(4.0)
def test_a_frozen_host_is_noticed_by_its_silence(client: Client) -> None:
    """Host B stops answering (its sidecar and rank SIGSTOPped: no exit, no closed socket):
    the client notices the heartbeat that stopped and stops with one line. The silence that
    counts is a few seconds here (the product's 15 s default only made the test wait)."""
    client.leader.line("TRAINING")
    for pid in namespace_pids(client.b):
        os.kill(pid, signal.SIGSTOP)
    stopped = client.leader.line("STOPPED", timeout=90.0)
    assert "WorkerDied" in stopped, client.leader.tail()
    assert client.leader.proc.wait(timeout=60.0) == 3, client.leader.tail()


def test_a_sidecar_for_another_world_size_says_so_in_one_line() -> None:
    """On loopback (no namespaces): a client's store with its layout (DP=2), and a sidecar
    started with --world-size 3: one line naming both, exit 1, before any rank starts."""
    import socket

    from psyche.client.setup.hosts import open_store
    from psyche.client.setup.ranks import RankLayout

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = open_store(RankLayout(dp=2, main_host="127.0.0.1", port=port))
    argv = [
        sys.executable, "-m", "psyche.cli.client", "sidecar", "--main-host", "127.0.0.1",
        "--port", str(port), "--world-size", "3", "--start-rank", "1", "--device", "cpu",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "psyche-client: error: --world-size 3, but the client at 127.0.0.1 has 2 x 1 = 2 ranks"
    )
    del store


def test_a_rank_is_dead_after_the_settings_silence_and_not_before() -> None:
    """`HeartbeatSettings.silence_secs` decides when a counter that stands still is a death (the
    product's 15 s unless set), read on the reader's clock; a silence no longer than a beat is
    refused."""
    from torch.distributed import HashStore

    from psyche.client.setup.hosts import (
        BEAT_SECS,
        SILENCE_SECS,
        Heartbeats,
        HeartbeatSettings,
        alive_key,
    )

    store = HashStore()
    store.add(alive_key(1), 1)
    short = Heartbeats(store, own=[], watched=[1], settings=HeartbeatSettings(silence_secs=2.0))
    default = Heartbeats(store, own=[], watched=[1])
    assert default.settings.silence_secs == SILENCE_SECS == 15.0
    for beats in (short, default):
        assert beats.silent(now=100.0) is None
    assert short.silent(now=102.0) is None
    assert short.silent(now=102.5) == 1
    assert default.silent(now=102.5) is None
    store.add(alive_key(1), 1)  # it beats again: silent from now on only
    assert short.silent(now=103.0) is None
    assert short.silent(now=104.5) is None
    assert default.silent(now=115.5) is None  # the beat seen first here: counted from now
    assert default.silent(now=130.5) is None
    assert default.silent(now=130.6) == 1
    with pytest.raises(ValueError, match="must exceed a beat"):
        HeartbeatSettings(silence_secs=BEAT_SECS)
