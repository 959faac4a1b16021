"""A swarm of real nodes: does every member get every broadcast of a round, and what does a peer cost?

N nodes (`NetworkConnection`, the client's network: libp2p host, GossipSub, blob store and
downloader), `--per-process` of them in each of N/k processes on 127.0.0.1, each node with its
own identity, all of them in every node's allowlist, addresses found through a local-discovery
directory (as the local testnet's clients find each other). Connectivity is the client's own:
every `GOSSIP_CONNECT_INTERVAL_SECS` each node tops its gossip neighbours up with
`choose_gossip_peers` and `add_peers` (the client's `_ensure_gossip_connected`), nothing more.

Once every node has gossip neighbours (or a bounded wait ran out), rounds follow. In each round
every node stores one payload of `--payload` bytes (a DisTrO result of the 20M model is about
98.6 KB) and gossips one signed message naming it (its round and blob ticket, as a client's
`TrainingResult` broadcast does); every node that receives a message of the round downloads
that payload from its provider (other members as fallbacks, as the client does). A round ends
when every node holds every other node's message and payload, or after `--round-timeout`.

Printed per N and per gossip setting:
* delivery: the share of (node, sender) pairs whose message arrived, how many nodes got all
  N-1 (the goal: all of them, every round), and when the last message and the last payload
  arrived (seconds after the round started, wall clock: the machine is loaded, so this
  stretches), and when some were missing at the round's end, whose messages and which nodes
  (losses that cluster in one process's nodes are that process stalling on a loaded machine);
* CPU: process CPU time (user + system of every process) over the round, per node (process
  CPU / k) and per peer (per node / (N-1)), and the floor: the same round's unavoidable
  cryptography (N-1 signature checks and BLAKE3 of N-1 payloads) timed in the parent, the
  ratio per node against it, and "net": per peer less the idle rate (measured just before the
  rounds, per node per second) times the round's wall time, the round's own work apart from
  the heartbeats and probes a node does anyway while a loaded machine stretches the round;
  the slope of per-node CPU in N (least squares over the sizes run);
* wire, per node and round: the libp2p frames its process's muxers wrote, by Yamux type (data,
  window update, ping, go-away), and the streams and connections opened (counted around
  py-libp2p's Yamux; load-independent where CPU time is not, and connection churn shows here);
* `--compare` runs each N with the settings of `--before` (gossip as the mesh pushes it, the
  repair off) and the defaults (the repair on), in the same sitting.

Bounded: processes are started for one N at a time and stopped after it; every wait has a
deadline (`--max-seconds` for the whole run); loopback only; Ctrl-C stops the children and
exits. The machine's load average is printed at the start and per N (other work shares the
cores: CPU time, not wall time, is the figure to compare).

While the meshes form, a status line every `STATUS_SECS`: connections, gossip streams, mesh,
and each process's event loop (`LoopLag`: how late a 0.1 s sleep returns, and the share of a
core the process got). On a shared machine the kernel divides the cores between *sessions*
(autogroup scheduling, `/proc/sys/kernel/sched_autogroup_enabled`), not processes: all of a
swarm's processes together get one session's share, however many there are (measured: 64 nodes
in 16 processes, 0.014-0.032 of a core each, loops 0.4 s late median). `--session-per-process`
starts each process in a session of its own, as nodes on their own machines (it then takes a
larger share of a shared machine from other users' work).

Diagnosis: `SWARM_LOG=WARNING` shows the nodes' logs (a failed fetch's reason included);
`--profile PATH` writes process 0's cProfile stats of its rounds
only there (CPU time; every round so far, rewritten after each; the profiler slows that process
2-3x, which on a loaded machine is enough to make its pings late); `--connect-timeout S`
overrides the client's 5 s connect timeout (on a machine too loaded for the handshakes the meshes do not form).

Run: .venv/bin/python scripts/bench/swarm.py [--sizes 8,16,32] [--per-process 4] [--rounds 3]
     [--compare] [--max-seconds 1500]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psyche.core.serde import U32, struct
from psyche.network import BlobTicket

GOSSIP_CONNECT_INTERVAL_SECS = 6.0
"""The client's `GOSSIP_CONNECT_MIN_INTERVAL_SECS`: how often it tops its neighbours up."""
MESH_WAIT_SECS = 60.0
"""At most this long for every node to have gossip neighbours before the first round."""
SETTLE_SECS = 3.0
"""Then this long (three heartbeats) for the meshes to settle."""
REPLY_GRACE_SECS = 30.0
READY_SECS_PER_PROCESS = 20.0
"""How long the processes may take to start, each: importing the network stack alone is about
2.6 s of CPU, and at load 20 on two cores a process gets a tenth of a core."""
"""How much longer than its own deadline a child may take to answer."""


# ---- what a node gossips ----------------------------------------------------------------------


@struct(frozen=True)
class SwarmMessage:
    """What each node gossips once a round: its round and its payload's ticket (the shape of a
    client's `TrainingResult` broadcast, which adds the batch and a commitment)."""

    round: U32
    ticket: BlobTicket


def node_key(seed: int, index: int) -> Any:
    from psyche.core.identity import SecretKey

    return SecretKey.from_bytes(hashlib.sha256(f"swarm {seed} {index}".encode()).digest())


# ---- a child process: k nodes ----------------------------------------------------------------


@dataclass
class NodeRound:
    got: dict[int, float] = field(default_factory=dict)
    """Sender index -> seconds after the round's start its message arrived."""
    fetched: dict[int, float] = field(default_factory=dict)
    failed: int = 0


class Child:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n = args.n
        self.indices = list(range(args.first, args.first + args.per_process))
        self.keys = [node_key(args.seed, i) for i in range(args.n)]
        self.ids = [k.public_key for k in self.keys]
        self.index_of = {pk: i for i, pk in enumerate(self.ids)}
        self.nodes: list[Any] = []
        self.round = -1
        self.round_start = 0.0
        self.results: dict[int, NodeRound] = {}
        self.complete: Any = None
        self.early: list[tuple[int, Any, float]] = []
        """Messages of a round this process has not started yet (another process started it
        first), replayed when it starts."""
        self.nursery: Any = None
        self.wire = WireCounts()
        self.lag = LoopLag()
        self.profiler: Any = None
        if args.profile and args.first == 0:
            import cProfile

            # CPU time, not wall time: the machine is loaded, and a round's waits are not cost
            self.profiler = cProfile.Profile(time.process_time)

    async def main(self) -> None:
        import trio

        from psyche.network import NetworkConnection
        from psyche.network.gossip import GossipConfig
        from psyche.network.testing import local_config

        gossip = GossipConfig(**json.loads(self.args.gossip))
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            self.nursery = nursery
            nursery.start_soon(self.lag.run)
            for i in self.indices:
                node = await stack.enter_async_context(
                    NetworkConnection.open(
                        local_config(
                            "swarm-bench",
                            secret_key=self.keys[i],
                            local_discovery_dir=Path(self.args.discovery),
                            gossip=gossip,
                            **(
                                {"connect_timeout_secs": self.args.connect_timeout}
                                if self.args.connect_timeout
                                else {}
                            ),
                        ),
                        broadcast_type=SwarmMessage,
                        distro_result_type=bytes,
                    )
                )
                node.set_allowed_peers(self.ids)
                self.nodes.append(node)
                nursery.start_soon(self._events, i, node)
            stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
            self._reply({"ready": True})
            buffer = b""
            while True:
                chunk = await stdin.receive_some(65536)
                if not chunk:
                    break  # the parent is gone
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    command = json.loads(line)
                    if command["cmd"] == "stop":
                        nursery.cancel_scope.cancel()
                        return
                    await self._command(command, nursery)
            nursery.cancel_scope.cancel()

    def _reply(self, obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async def _command(self, command: dict[str, Any], nursery: Any) -> None:
        import trio

        if command["cmd"] == "connect":
            for i, node in zip(self.indices, self.nodes, strict=True):
                nursery.start_soon(self._keep_connected, i, node)
            self._reply({"ok": True})
        elif command["cmd"] == "idle":
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await trio.sleep(command["secs"])
            self._reply({"cpu": time.process_time() - cpu0, "wall": time.perf_counter() - wall0})
        elif command["cmd"] == "neighbors":
            self._reply(
                {
                    "neighbors": [len(node.neighbors()) for node in self.nodes],
                    "mesh": [len(node.gossip.mesh()) for node in self.nodes],
                    "connected": [len(node.connected_peers()) for node in self.nodes],
                    # gossip streams open, and peers known to subscribe to the run's topic
                    "streams": [len(node.gossip.pubsub.peers) for node in self.nodes],
                    "subscribed": [
                        len(node.gossip.pubsub.peer_topics.get(node.gossip.topic, ()))
                        for node in self.nodes
                    ],
                    "loop": self.lag.read() if command.get("reset") else self.lag.peek(),
                }
            )
        elif command["cmd"] == "round":
            cpu0 = time.process_time()
            wire0 = self.wire.snapshot()
            if self.profiler is not None:
                self.profiler.enable()
            self.round = command["r"]
            self.round_start = command["t0"]
            self.results = {i: NodeRound() for i in self.indices}
            self.complete = trio.Event()
            early, self.early = self.early, []
            for i, event, at in early:
                self._received(i, event, at)
            for i, node in zip(self.indices, self.nodes, strict=True):
                payload = random.Random(f"{self.args.seed} {i} {self.round}").randbytes(
                    self.args.payload
                )
                ticket, _ = await node.add_downloadable(payload, f"distro-result_{self.round}")
                node.broadcast(SwarmMessage(self.round, ticket))
            with trio.move_on_after(max(0.0, command["deadline"] - time.time())):
                await self.complete.wait()
            cpu = time.process_time() - cpu0
            if self.profiler is not None:
                self.profiler.disable()
                self.profiler.dump_stats(self.args.profile)
            self._reply(
                {
                    "cpu": cpu,
                    "wire": {k: v - wire0[k] for k, v in self.wire.snapshot().items()},
                    "nodes": [
                        {
                            "got": len(r.got),
                            "last_got": max(r.got.values(), default=None),
                            "fetched": len(r.fetched),
                            "last_fetched": max(r.fetched.values(), default=None),
                            "failed": r.failed,
                            "missing": sorted(set(range(self.n)) - set(r.got) - {i}),
                            "neighbors": len(self.nodes[self.indices.index(i)].neighbors()),
                        }
                        for i, r in self.results.items()
                    ],
                }
            )
            for node in self.nodes:
                node.remove_staled_tags(self.round + 1)

    async def _keep_connected(self, i: int, node: Any) -> None:
        """The client's `_ensure_gossip_connected`, on its interval."""
        import trio

        from psyche.network import choose_gossip_peers

        rng = random.Random(f"{self.args.seed} connect {i}")
        while True:
            chosen = choose_gossip_peers(self.ids, node.neighbors(), self.ids[i], rng)
            if chosen:
                node.add_peers(chosen)
            await trio.sleep(GOSSIP_CONNECT_INTERVAL_SECS)

    async def _events(self, i: int, node: Any) -> None:
        from psyche.network import MessageReceived

        while True:
            event = await node.next_event()
            if not isinstance(event, MessageReceived):
                continue
            if event.message.round > self.round:
                self.early.append((i, event, time.time()))
            elif event.message.round == self.round:
                self._received(i, event, time.time())

    def _received(self, i: int, event: Any, at: float) -> None:
        from psyche.network import DownloadType

        node = self.nodes[self.indices.index(i)]
        sender = self.index_of[event.from_]
        result = self.results[i]
        if sender not in result.got:
            result.got[sender] = at - self.round_start
            others = [pk for pk in self.ids if pk not in (event.from_, self.ids[i])]
            random.shuffle(others)
            download = node.start_download(
                event.message.ticket,
                f"downloaded-distro-result-{event.from_.hex()}_{self.round}",  # as the client
                DownloadType.DistroResult(others[:8]),
            )
            self.nursery.start_soon(self._fetch, i, sender, download, self.round)

    async def _fetch(self, i: int, sender: int, download: Any, round_: int) -> None:
        from psyche.network import DownloadComplete

        outcome = await download.finished()
        if round_ != self.round:
            return
        result = self.results[i]
        if isinstance(outcome, DownloadComplete):
            result.fetched[sender] = time.time() - self.round_start
        else:
            result.failed += 1
            if os.environ.get("SWARM_LOG"):
                print(f"fetch failed: {outcome.error}", file=sys.stderr)
        if all(len(r.fetched) == self.n - 1 for r in self.results.values()):
            self.complete.set()


LAG_TICK_SECS = 0.1


class LoopLag:
    """How late the process's event loop runs a task that sleeps `LAG_TICK_SECS` (what every
    timer and every peer's frame waits besides its own work: the cores' run queue and the
    loop's other tasks), and the process's share of a core, since the last `read`. Tells a
    starved process (late ticks, a large share or none to be had) from a stuck protocol
    (ticks on time, negotiations still timing out)."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self.since = (time.process_time(), time.perf_counter())

    async def run(self) -> None:
        import trio

        while True:
            start = time.perf_counter()
            await trio.sleep(LAG_TICK_SECS)
            self.late.append(time.perf_counter() - start - LAG_TICK_SECS)
            del self.late[:-10_000]

    def peek(self) -> dict[str, float]:
        """What `read` would return, without starting a new interval."""
        late, since = list(self.late), self.since
        try:
            return self.read()
        finally:
            self.late, self.since = late, since

    def read(self) -> dict[str, float]:
        late, self.late = sorted(self.late) or [0.0], []
        cpu0, wall0 = self.since
        self.since = (time.process_time(), time.perf_counter())
        return {
            "late_median": late[len(late) // 2],
            "late_p99": late[int(len(late) * 0.99)],
            "late_max": late[-1],
            "cpu_share": (self.since[0] - cpu0) / max(1e-9, self.since[1] - wall0),
        }


class WireCounts:
    """What a process's muxers did (bench instrumentation, wrapped around py-libp2p's Yamux):
    frames written by type, streams and connections opened. Read per round as differences."""

    FRAME_TYPES = ("data", "window", "ping", "goaway")

    def __init__(self) -> None:
        from libp2p.stream_muxer.yamux import yamux

        self.counts = dict.fromkeys((*self.FRAME_TYPES, "streams", "connections"), 0)
        counts = self.counts
        write_frame = yamux.Yamux._write_frame
        stream_init = yamux.YamuxStream.__init__
        conn_init = yamux.Yamux.__init__

        async def counted_write(conn: Any, data: bytes) -> None:
            if len(data) >= 2:
                kind = WireCounts.FRAME_TYPES[min(data[1], 3)]
                counts[kind] += 1
            await write_frame(conn, data)

        def counted_stream(stream: Any, *a: Any, **kw: Any) -> None:
            counts["streams"] += 1
            stream_init(stream, *a, **kw)

        def counted_conn(conn: Any, *a: Any, **kw: Any) -> None:
            counts["connections"] += 1
            conn_init(conn, *a, **kw)

        for cls, name, wrapper in (
            (yamux.Yamux, "_write_frame", counted_write),
            (yamux.YamuxStream, "__init__", counted_stream),
            (yamux.Yamux, "__init__", counted_conn),
        ):
            setattr(cls, name, wrapper)

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)


def child_main(args: argparse.Namespace) -> None:
    import logging

    import trio

    logging.basicConfig(level=os.environ.get("SWARM_LOG", "ERROR"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (stop, or stdin closed)
    try:
        trio.run(Child(args).main)
    except BaseExceptionGroup as group:
        for leaf in _leaves(group):
            print(f"swarm process {args.first // args.per_process}: {leaf!r}", file=sys.stderr)
        sys.exit(1)


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in _leaves(sub)]
    return [error]


# ---- the parent: one swarm per N ------------------------------------------------------------


@dataclass
class RoundResult:
    n: int
    cpu_per_node: float
    got_pairs: int
    complete_nodes: int
    fetched_pairs: int
    last_got: float | None
    last_fetched: float | None
    wall: float
    wire: dict[str, int]
    """Summed over the processes: Yamux frames written by type, streams, connections."""
    lacked: dict[int, int] = field(default_factory=dict)
    """Sender index -> how many nodes lacked its message at the round's end (none: absent)."""
    lacking: dict[int, int] = field(default_factory=dict)
    """Node index -> how many messages it lacked at the round's end (none: absent)."""


class Swarm:
    """N/k child processes; commands go to every child, one JSON line back from each."""

    def __init__(
        self,
        n: int,
        k: int,
        seed: int,
        gossip: dict[str, Any],
        payload: int,
        connect_timeout: float,
        profile: str,
        session_per_process: bool = False,
    ) -> None:
        self.n, self.k = n, k
        self.tmp = tempfile.TemporaryDirectory(prefix="psyche-swarm-")
        self.children: list[subprocess.Popen[str]] = []
        for first in range(0, n, k):
            self.children.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        f"--n={n}",
                        f"--first={first}",
                        f"--per-process={min(k, n - first)}",
                        f"--seed={seed}",
                        f"--payload={payload}",
                        f"--discovery={self.tmp.name}",
                        f"--gossip={json.dumps(gossip)}",
                        f"--connect-timeout={connect_timeout}",
                        f"--profile={profile}",
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    start_new_session=session_per_process,
                )
            )

    def ask(self, command: dict[str, Any], deadline: float) -> list[dict[str, Any]]:
        for child in self.children:
            assert child.stdin is not None
            child.stdin.write(json.dumps(command) + "\n")
            child.stdin.flush()
        return [self._read(child, deadline) for child in self.children]

    def _read(self, child: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
        import selectors

        assert child.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(child.stdout, selectors.EVENT_READ)
            if not selector.select(max(0.0, deadline - time.time())):
                raise TimeoutError("a swarm process did not answer in time")
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"a swarm process exited (code {child.wait()})")
        return dict(json.loads(line))

    def close(self) -> None:
        """Stop every child (a second Ctrl-C does not cut this short)."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self._stop_children()
        finally:
            signal.signal(signal.SIGINT, previous)

    def _stop_children(self) -> None:
        for child in self.children:
            try:
                assert child.stdin is not None
                child.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                child.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        end = time.time() + 10
        for child in self.children:
            try:
                child.wait(max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.tmp.cleanup()


def run_swarm(
    n: int, args: argparse.Namespace, gossip: dict[str, Any], deadline: float
) -> tuple[list[RoundResult], float, float]:
    """The rounds of one swarm, and how long its meshes took to form."""
    swarm = Swarm(
        n,
        args.per_process,
        args.seed,
        gossip,
        args.payload,
        args.connect_timeout,
        args.profile,
        args.session_per_process,
    )
    try:
        start = time.time()
        for child in swarm.children:  # each says ready once its nodes are open
            swarm._read(child, min(deadline, start + READY_SECS_PER_PROCESS * len(swarm.children)))
        swarm.ask({"cmd": "connect"}, deadline)
        mesh_start = time.time()
        want = min(3, n - 1)
        last_status = mesh_start
        while True:
            due = time.time() - last_status >= STATUS_SECS
            replies = swarm.ask({"cmd": "neighbors", "reset": due}, deadline)
            counts = [c for r in replies for c in r["neighbors"]]
            done = min(counts) >= want or time.time() - mesh_start > MESH_WAIT_SECS
            if done or due:
                last_status = time.time()
                _print_status(n, time.time() - mesh_start, replies)
            if done:
                break
            time.sleep(0.5)
        idle = swarm.ask({"cmd": "idle", "secs": SETTLE_SECS}, deadline)
        idle_per_node_sec = sum(r["cpu"] / r["wall"] for r in idle) / n
        mesh_secs = time.time() - mesh_start
        results = []
        for r in range(args.rounds):
            t0 = time.time()
            round_deadline = min(deadline, t0 + args.round_timeout)
            replies = swarm.ask(
                {"cmd": "round", "r": r, "t0": t0, "deadline": round_deadline},
                round_deadline + REPLY_GRACE_SECS,
            )
            nodes = [node for reply in replies for node in reply["nodes"]]
            lacked: dict[int, int] = {}
            for node in nodes:
                for sender in node["missing"]:
                    lacked[sender] = lacked.get(sender, 0) + 1
            results.append(
                RoundResult(
                    n=n,
                    cpu_per_node=sum(reply["cpu"] for reply in replies) / n,
                    got_pairs=sum(node["got"] for node in nodes),
                    complete_nodes=sum(node["got"] == n - 1 for node in nodes),
                    fetched_pairs=sum(node["fetched"] for node in nodes),
                    last_got=_max_or_none(node["last_got"] for node in nodes),
                    last_fetched=_max_or_none(node["last_fetched"] for node in nodes),
                    wall=time.time() - t0,
                    lacked=lacked,
                    lacking={
                        index: len(node["missing"])
                        for index, node in enumerate(nodes)
                        if node["missing"]
                    },
                    wire={
                        k: sum(reply["wire"][k] for reply in replies) for k in replies[0]["wire"]
                    },
                )
            )
            if time.time() > deadline:
                break
        return results, mesh_secs, idle_per_node_sec
    finally:
        swarm.close()


STATUS_SECS = 10.0
"""While the meshes form, the swarm's state is printed this often."""


def _print_status(n: int, secs: float, replies: list[dict[str, Any]]) -> None:
    """The nodes' connectivity and the processes' event loops (`LoopLag`, since the last
    status) while the meshes form."""

    def col(key: str) -> list[int]:
        return [c for r in replies for c in r[key]]

    loops = [r["loop"] for r in replies]
    print(
        f"  N = {n}, {secs:.0f} s: gossip neighbours min {min(col('neighbors'))} median "
        f"{statistics.median(col('neighbors'))}, connections min {min(col('connected'))} "
        f"median {statistics.median(col('connected'))}, gossip streams median "
        f"{statistics.median(col('streams'))}, subscribed peers median "
        f"{statistics.median(col('subscribed'))}, mesh min {min(col('mesh'))} median "
        f"{statistics.median(col('mesh'))}; event loops (median of the processes) "
        f"{statistics.median(x['late_median'] for x in loops) * 1e3:.0f} ms late median, "
        f"{statistics.median(x['late_p99'] for x in loops) * 1e3:.0f} ms p99 "
        f"(max {max(x['late_max'] for x in loops) * 1e3:.0f} ms), "
        f"{statistics.median(x['cpu_share'] for x in loops):.3f} of a core each, "
        f"load {_load()}",
        flush=True,
    )


def _max_or_none(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def crypto_floor_secs(n: int, payload: int) -> float:
    """The unavoidable cryptography of one node's round, timed here: N-1 signed messages of the
    swarm's size checked, N-1 payloads BLAKE3-hashed (the checks every received message and
    blob gets, with nothing around them)."""
    import blake3

    from psyche.core.signed_message import SignedMessage

    key = node_key(0, 0)
    data = SignedMessage.sign_and_encode(key, os.urandom(300), bytes)
    blob = os.urandom(payload)
    start = time.process_time()
    for _ in range(n - 1):
        SignedMessage.verify_and_decode(data, bytes)
        blake3.blake3(blob).digest()
    return time.process_time() - start


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(
    label: str, n: int, results: list[RoundResult], mesh_secs: float, floor: float, idle: float
) -> None:
    pairs = n * (n - 1)
    print(
        f"\n{label}, N = {n} ({mesh_secs:.0f} s to form the meshes; idle CPU "
        f"{idle * 1e3:.1f} ms per node per second), load {_load()}:"
    )
    print(
        "  round  msgs got      nodes with all  payloads      last msg s  last payload s  "
        "CPU/node ms  CPU/peer ms  x floor  net/peer ms"
    )
    for r, res in enumerate(results):
        print(
            f"  {r:5d}  {res.got_pairs:5d}/{pairs:<6d}  {res.complete_nodes:4d}/{n:<9d}  "
            f"{res.fetched_pairs:5d}/{pairs:<6d}  {_fmt(res.last_got):>10}  "
            f"{_fmt(res.last_fetched):>14}  {res.cpu_per_node * 1e3:11.1f}  "
            f"{res.cpu_per_node * 1e3 / (n - 1):11.2f}  {res.cpu_per_node / floor:7.1f}  "
            f"{(res.cpu_per_node - idle * res.wall) * 1e3 / (n - 1):11.2f}"
        )
        print(
            "         per node: "
            + ", ".join(f"{k} {v / n:.0f}" for k, v in res.wire.items())
            + " (Yamux frames written by type; streams and connections opened)"
        )
        if res.lacked:
            print(
                "         lacked (sender: nodes without its message): "
                + ", ".join(f"{s}: {c}" for s, c in sorted(res.lacked.items()))
                + "; lacking (node: messages it lacks): "
                + ", ".join(f"{i}: {c}" for i, c in sorted(res.lacking.items()))
            )


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def slope(points: list[tuple[int, float]]) -> float | None:
    if len({n for n, _ in points}) < 2:
        return None
    xs = [float(n) for n, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="8,16,32", help="comma-separated N")
    parser.add_argument(
        "--per-process",
        type=int,
        default=4,
        help="nodes per process (the issue's k ≤ 4; up to 8 where a loaded machine cannot start "
        "N/4 processes in time)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-timeout", type=float, default=60.0)
    parser.add_argument("--payload", type=int, default=98_600, help="bytes per node per round")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--compare", action="store_true", help="also run each N with --before")
    parser.add_argument(
        "--before",
        default='{"repair_window": 0}',
        help="GossipConfig fields (JSON) of the 'before' setting",
    )
    parser.add_argument("--max-seconds", type=float, default=1500.0)
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=0.0,
        help="the nodes' connect timeout in seconds (default: the client's, 5 s); on a machine "
        "too loaded for N pure-Python Noise handshakes in time the meshes do not form",
    )
    parser.add_argument(
        "--session-per-process",
        action="store_true",
        help="start each process in its own session (the kernel shares the cores between "
        "sessions: by default the whole swarm gets one session's share)",
    )
    parser.add_argument(
        "--profile",
        default="",
        help="write process 0's cProfile stats of the rounds (CPU time) to this path",
    )
    # the child's own arguments
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--discovery", help=argparse.SUPPRESS)
    parser.add_argument("--gossip", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    if not 1 <= args.per_process <= 8:
        parser.error("--per-process must be 1 to 8")
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        before = json.loads(args.before)
    except ValueError as e:
        parser.error(f"bad --sizes or --before: {e}")
    settings = [("after (defaults)", {})]
    if args.compare:
        settings.insert(0, (f"before {json.dumps(before)}", before))
    signal.signal(signal.SIGTERM, _interrupt)
    deadline = time.time() + args.max_seconds
    print(
        f"swarm: N = {sizes}, {args.per_process} nodes per process, {args.rounds} rounds, "
        f"{args.payload} B payloads, connect timeout "
        f"{f'{args.connect_timeout:.0f} s' if args.connect_timeout else 'the default'}, "
        f"{os.cpu_count()} CPUs, load {_load()} (1/5/15 min), "
        f"{'a session per process' if args.session_per_process else 'one session'}; "
        f"waits at most {args.max_seconds:.0f} s in all"
    )
    per_node: dict[str, list[tuple[int, float]]] = {label: [] for label, _ in settings}
    try:
        for n in sizes:
            floor = crypto_floor_secs(n, args.payload)
            print(
                f"\nN = {n}: crypto floor per node per round {floor * 1e3:.2f} ms "
                f"({floor * 1e3 / (n - 1):.3f} ms per peer)"
            )
            for label, gossip in settings:
                if time.time() > deadline:
                    print(f"\n{label}, N = {n}: skipped, --max-seconds reached")
                    continue
                results, mesh_secs, idle = run_swarm(n, args, gossip, deadline)
                report(label, n, results, mesh_secs, floor, idle)
                # only rounds in which every member got everything: a swarm that never formed
                # does little work and would flatten the slope
                per_node[label] += [(n, r.cpu_per_node) for r in results if r.complete_nodes == n]
    except KeyboardInterrupt:
        print("\ninterrupted; the swarm's processes were stopped")
        sys.exit(130)
    except (TimeoutError, RuntimeError) as e:
        print(f"\nswarm stopped: {e}")
        sys.exit(1)
    print()
    for label, points in per_node.items():
        s = slope(points)
        if s is not None:
            print(
                f"{label}: per-node CPU per round grows {s * 1e3:.2f} ms per added node "
                "(rounds in which every member got everything)"
            )


if __name__ == "__main__":
    main()
