"""Chaos scenarios: a run of real processes, faults injected on a schedule, figures measured.

Each scenario starts the server and the clients (`cluster.Cluster`), waits for the first round,
injects its faults for `duration` seconds, lifts them, waits for one more cooldown so every
client's model can be compared, and returns a `ScenarioResult`. Client 1 is never faulted: its
`applied_results` measure the run's throughput.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import metrics
import trio
from cluster import CHAOS_DIR, Cluster, Limits, RunSpec, client_short_id
from metrics import Fault
from proxy import ANY, CLEAR, Rule

SEQ_LEN = 128
REFERENCE = 1


@dataclass
class Context:
    cluster: Cluster
    rng: random.Random
    faults: list[Fault] = field(default_factory=list)
    restarts: list[tuple[str, float]] = field(default_factory=list)
    expected_exits: set[str] = field(default_factory=set)
    busy: set[str] = field(default_factory=set)
    """Clients a fault is acting on (the supervisor leaves them alone)."""

    def targets(self) -> list[int]:
        """Clients that may be faulted: running, not the reference, not already faulted."""
        return [
            n
            for n in self.cluster.spec.client_numbers
            if n != REFERENCE
            and self.cluster.nodes[Cluster.client_name(n)].running
            and Cluster.client_name(n) not in self.busy
        ]

    async def restart_client(self, number: int, *, kill: bool, delay: float = 0.0) -> None:
        name = Cluster.client_name(number)
        self.expected_exits.add(name)
        if kill:
            await self.cluster.kill(name)
        else:
            await self.cluster.stop(name, grace=5)
        await trio.sleep(delay)
        # expected until the replacement runs: the exit watcher must not see the killed process
        # (still the node's) while the replacement starts (it did on a loaded machine)
        try:
            await self.cluster.start_client(number)
        finally:
            self.expected_exits.discard(name)
        self.restarts.append((name, time.time()))

    def record(self, kind: str, target: str, detail: str = "", *, t: float | None = None,
               until: float | None = None, number: int | None = None) -> Fault:  # fmt: skip
        fault = Fault(
            t if t is not None else time.time(),
            kind,
            target,
            detail,
            until,
            client_short_id(number) if number is not None else None,
        )
        self.faults.append(fault)
        return fault


Action = Callable[[Context], Awaitable[None]]


# ---- fault actions -------------------------------------------------------------------------


def sigkill_client(restart_after: float = 3.0) -> Action:
    """SIGKILL a client (mid-round, whatever it does) and start a replacement with the same key."""

    async def act(ctx: Context) -> None:
        targets = ctx.targets()
        if not targets:
            return
        number = ctx.rng.choice(targets)
        name = Cluster.client_name(number)
        t = time.time()
        ctx.busy.add(name)
        try:
            await ctx.restart_client(number, kill=True, delay=restart_after)
        finally:
            ctx.busy.discard(name)
        ctx.record("sigkill", name, f"restarted after {restart_after:g} s", t=t,
                   until=time.time(), number=number)  # fmt: skip

    return act


def pause_client(secs: float) -> Action:
    """SIGSTOP a client, SIGCONT it `secs` later (a stalled machine)."""

    async def act(ctx: Context) -> None:
        targets = ctx.targets()
        if not targets:
            return
        number = ctx.rng.choice(targets)
        name = Cluster.client_name(number)
        t = time.time()
        ctx.busy.add(name)
        ctx.cluster.signal(name, signal.SIGSTOP)
        try:
            await trio.sleep(secs)
        finally:  # lifted and counted also when the scenario's window closes first
            ctx.cluster.signal(name, signal.SIGCONT)
            ctx.busy.discard(name)
            ctx.record("sigstop", name, f"{secs:g} s", t=t, until=time.time(), number=number)

    return act


def partition_client(secs: float) -> Action:
    """Cut one client off from the other clients (p2p links), keep its coordinator link."""

    async def act(ctx: Context) -> None:
        targets = ctx.targets()
        if not targets:
            return
        number = ctx.rng.choice(targets)
        name = Cluster.client_name(number)
        others = [Cluster.client_name(n) for n in ctx.cluster.spec.client_numbers if n != number]
        t = time.time()
        ctx.busy.add(name)
        ctx.cluster.net.partition(name, others=others)
        try:
            await trio.sleep(secs)
        finally:
            ctx.cluster.net.heal(name, others=others)
            ctx.busy.discard(name)
            ctx.record("partition", name, f"{secs:g} s from its peers", t=t, until=time.time(),
                       number=number)  # fmt: skip

    return act


def latency(secs: float, ms: float, *, links: str = "coordinator",
            bandwidth: float | None = None) -> Action:  # fmt: skip
    """Delay every chunk on the coordinator links (`coordinator`), the p2p links (`p2p`) or both
    (`all`) by `ms` each way, optionally at most `bandwidth` bytes/s, for `secs`."""

    async def act(ctx: Context) -> None:
        net = ctx.cluster.net
        rule = Rule(latency=ms / 1000, bandwidth=bandwidth)
        clients = [Cluster.client_name(n) for n in ctx.cluster.spec.client_numbers]
        keys = []
        if links in ("coordinator", "all"):
            keys += [(c, "server") for c in clients]
        if links in ("p2p", "all"):
            keys += [(c, other) for c in clients for other in clients if c != other]
        t = time.time()
        for src, dst in keys:
            net.set(rule, src=src, dst=dst, both=False)
        try:
            await trio.sleep(secs)
        finally:
            for src, dst in keys:
                net.set(CLEAR, src=src, dst=dst, both=False)
            detail = f"{ms:g} ms" + (f", {bandwidth / 1e3:g} kB/s" if bandwidth else "")
            ctx.record(f"latency-{links}", links, f"{detail} for {secs:g} s", t=t,
                       until=time.time())  # fmt: skip

    return act


def kill_server(restart_after: float = 2.0) -> Action:
    """SIGKILL the coordinator server and restart it from its --save-state-dir."""

    async def act(ctx: Context) -> None:
        t = time.time()
        ctx.expected_exits.add("server")
        await ctx.cluster.kill("server")
        await trio.sleep(restart_after)
        ctx.expected_exits.discard("server")
        await ctx.cluster.start_server(resume=True)
        ctx.record("server-sigkill", "server", "restarted from the saved state", t=t,
                   until=time.time())  # fmt: skip

    return act


def pause_server(secs: float) -> Action:
    async def act(ctx: Context) -> None:
        t = time.time()
        ctx.cluster.signal("server", signal.SIGSTOP)
        try:
            await trio.sleep(secs)
        finally:
            ctx.cluster.signal("server", signal.SIGCONT)
            ctx.record("server-sigstop", "server", f"{secs:g} s", t=t, until=time.time())

    return act


def data_outage(secs: float) -> Action:
    """The data server goes away and comes back: its connections reset, new ones refused."""

    async def act(ctx: Context) -> None:
        t = time.time()
        ctx.cluster.net.set(Rule(blocked=True), src=ANY, dst="data")
        try:
            await trio.sleep(secs)
        finally:
            ctx.cluster.net.set(CLEAR, src=ANY, dst="data")
            ctx.record("data-outage", "data", f"{secs:g} s", t=t, until=time.time())

    return act


# ---- attacks (issue 24, items 1 and 2; item 4 is the adversary's `junk-result`) ------------

STRANGERS_HOST = "127.0.0.3"
"""Where strangers connect from: the honest clients' coordinator proxies connect from 127.0.0.1,
and a per-address cap shared with them would measure the loopback test, not the attack."""


async def run_attacker(ctx: Context, prefix: str, args: Sequence[str]) -> dict[str, Any]:
    """Runs `flood.py ARGS` as its own process (an attacker competes for the CPU as a separate
    machine's would not, but the harness's proxies stay responsive) until it ends by itself;
    returns the JSON line it printed last (what the attack got), or {} if it printed none.
    Stopped with the scenario's window when that closes first."""
    name = f"{prefix}-{sum(1 for n in ctx.cluster.nodes if n.startswith(prefix + '-')) + 1}"
    ctx.expected_exits.add(name)
    node = await ctx.cluster.start(name, [sys.executable, str(CHAOS_DIR / "flood.py"), *args])
    try:
        assert node.process is not None
        await node.process.wait()
    finally:
        with trio.CancelScope(shield=True):
            await ctx.cluster.stop(name, grace=3)
    await trio.sleep(0.3)  # its last lines
    found = node.events()
    return dict(found[-1]) if found else {}


def health_check_flood(secs: float, connections: int = 1, max_logins: int = 20_000) -> Action:
    """Issue 24, item 2: `connections` strangers log in to the coordinator with fresh keys and
    send well-formed 8 MiB `HealthCheck` frames back to back for `secs` (logging in again with
    a new key whenever the server closes them; at most `max_logins` logins). Before the fix one
    froze the server's only thread for a second per frame; ten took its RSS to 892 MB."""

    async def act(ctx: Context) -> None:
        t = time.time()
        got: dict[str, Any] = {}
        try:
            got = await run_attacker(
                ctx,
                "strangers",
                [
                    "--attack", "health-checks",
                    "--target", f"127.0.0.1:{ctx.cluster.server_port}",
                    "--bind", STRANGERS_HOST, "--connections", str(connections),
                    "--hold", f"{secs:g}", "--max-logins", str(max_logins),
                ],
            )  # fmt: skip
        finally:
            detail = (
                f"{got.get('logins', '?')} logins, {got.get('frames', '?')} 8 MiB frames sent "
                f"whole, {got.get('closed_by_peer', '?')} closed by the server"
            )
            ctx.record("health-check-flood", "server", detail, t=t, until=time.time())

    return act


def silent_flood(connections: int = 2000, *, rejoin: bool = True) -> Action:
    """Issue 24, item 1: `connections` TCP connections that never send a byte (50 open at once)
    at one client's libp2p port, from 127.0.0.1 as its peers' proxies. With `rejoin`, another
    client is then SIGKILLed and its replacement started, which must dial the flooded client
    and be dialed by it. Before the fix every pending upgrade the flood's newer connections
    evicted leaked a slot of py-libp2p's resource manager, and the flooded host refused every
    connection, in and out, for good (a replacement exited with `PeersUnreachable`)."""

    async def act(ctx: Context) -> None:
        # clients that loaded the model since they started: their libp2p hosts listen
        targets = [
            n
            for n in ctx.targets()
            if (node := ctx.cluster.nodes[Cluster.client_name(n)]).events(
                "loaded_model", since=node.started_at
            )
        ]
        if not targets:
            return
        number = ctx.rng.choice(targets)
        name = Cluster.client_name(number)
        ctx.busy.add(name)
        t = time.time()
        got: dict[str, Any] = {}
        try:
            port = ctx.cluster.p2p_ports[number][0]
            got = await run_attacker(
                ctx,
                "silent-flood",
                ["--attack", "silent", "--target", f"127.0.0.1:{port}",
                 "--connections", str(connections)],
            )  # fmt: skip
        finally:
            ctx.busy.discard(name)
            ctx.record("silent-flood", name,
                       f"{got.get('connections', 'no')} silent connections at its libp2p port",
                       t=t, until=time.time(), number=number)  # fmt: skip
        others = [n for n in ctx.targets() if n != number]
        if not (rejoin and got and others):
            return
        other = ctx.rng.choice(others)
        other_name = Cluster.client_name(other)
        ctx.busy.add(other_name)
        t = time.time()
        try:
            await ctx.restart_client(other, kill=True)
        finally:
            ctx.busy.discard(other_name)
        ctx.record("sigkill", other_name, f"the replacement dials the flooded {name}", t=t,
                   until=time.time(), number=other)  # fmt: skip

    return act


def every(interval: float, actions: Sequence[Action]) -> Action:
    """Run `actions` in turn, one starting every `interval` seconds."""

    async def act(ctx: Context) -> None:
        index = 0
        next_at = trio.current_time() + interval
        while True:
            await trio.sleep_until(next_at)
            await actions[index % len(actions)](ctx)
            index += 1
            next_at += interval

    return act


def at(delay: float, action: Action) -> Action:
    async def act(ctx: Context) -> None:
        await trio.sleep(delay)
        await action(ctx)

    return act


def together(*actions: Action) -> Action:
    async def act(ctx: Context) -> None:
        async with trio.open_nursery() as nursery:
            for action in actions:
                nursery.start_soon(action, ctx)

    return act


# ---- scenarios -----------------------------------------------------------------------------


DROPPED = (
    "this client is not among the run's clients",
    # a member that missed its epoch's first round (stalled while warming up) sits the epoch
    # out; the health check drops it, and it may already be back in warmup, where it says nothing
    "ready after the epoch's first round started",
)


async def supervise(ctx: Context, grace: float = 2.0) -> None:
    """An operator's liveness check: a client the run dropped (health checks after a stall or a
    partition) stays connected and is never taken back (one Join per connection, as upstream),
    so it is restarted, as systemd or a container runtime would."""
    while True:
        await trio.sleep(1.0)
        for number in ctx.targets():
            name = Cluster.client_name(number)
            node = ctx.cluster.nodes[name]
            line = next(
                (
                    x
                    for x in node.lines
                    if x.t >= node.started_at and any(text in x.text for text in DROPPED)
                ),
                None,
            )
            if line is None or time.time() - line.t < grace:
                continue
            ctx.busy.add(name)
            try:
                await ctx.restart_client(number, kill=False)
            finally:
                ctx.busy.discard(name)
            ctx.record("dropped-restart", name, "dropped by the run; restarted", t=line.t,
                       until=time.time(), number=number)  # fmt: skip


Extra = Callable[[Cluster], Awaitable[list[str]]]


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    duration: float
    inject: Action | None
    run: RunSpec = field(default_factory=RunSpec)
    client_limits: dict[int, Limits] = field(default_factory=dict)
    extra: Extra | None = None
    """Starts more processes before the server (an adversary); returns their names."""
    supervise: bool = True
    server_limits: Limits | None = None


EVIDENCE = {
    "checkpoint write failed": "Writing the checkpoint to",
    "state save failed": "Error saving state",
    "rounds abandoned": "the round was abandoned",
    "dropped by health check": "Dropped 1 clients",
    "download retries": "Retrying download for distro result",
    "data fetch retries": "retrying",
    "results over the run's bound refused": r"not retrying\): blob of \d+ bytes exceeds",
    "undecodable results dropped": r"not retrying\): undecodable blob",
    "junk results requested": '"message": "blob_requested", "mode": "junk-result"',
    "undecodable blobs requested": '"message": "blob_requested", "mode": "garbage-blob"',
    "frames refused at the header (logged)": r"frame of \d+ bytes exceeds the limit",
    "pending libp2p upgrades evicted (logged)": "pending connections full",
}
"""Regular expressions counted in every process's output (lines a `DropLog` rate-limits count
once per interval: their summary lines are not counted)."""


@dataclass
class ScenarioResult:
    name: str
    title: str
    duration: float
    faults: list[dict[str, Any]]
    fault_counts: dict[str, int]
    rounds: int
    rounds_total: int
    epochs: int
    tokens: int
    tokens_per_s: float
    lost_per_departure: list[int]
    lost_per_fault: list[int]
    lost_total: int
    dropped: int
    rejoins: list[dict[str, Any]]
    models_identical: bool
    epochs_checked: int
    model_problems: list[str]
    applied_problems: list[str]
    unexpected_exits: list[str]
    partial_files: list[str]
    loss_first: float | None
    loss_last: float | None
    evidence: dict[str, int]
    round_seconds: float | None = None
    """The median round in the window (`metrics.median_round_seconds`)."""
    server_cpu_per_min: float | None = None
    """CPU seconds the server process used per minute of the window (None when it restarted)."""
    throughput_ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def partial_files(cluster: Cluster) -> list[str]:
    """Temporary or incomplete files left in the save and checkpoint directories."""
    problems = []
    for root in (cluster.saves, cluster.checkpoints):
        if not root.exists():
            continue
        for path in root.rglob("*"):
            if path.name.startswith(".") or path.name.endswith(".tmp"):
                problems.append(str(path.relative_to(cluster.workdir)))
        if root == cluster.checkpoints:
            for step_dir in root.iterdir():
                if step_dir.is_dir() and not (
                    (step_dir / "model.safetensors").is_file()
                    and (step_dir / "config.json").is_file()
                ):
                    problems.append(f"incomplete checkpoint {step_dir.name}")
    latest = cluster.saves / "latest"
    if latest.exists():
        named = latest.read_text().strip()
        if not (cluster.saves / named).is_file():
            problems.append(f"saves/latest names a missing file {named!r}")
    return problems


def _mean_loss(events: Sequence[dict[str, Any]], last: bool) -> float | None:
    losses = [e["loss"] for e in metrics.of(events, "client_loss") if e.get("trained")]
    if not losses:
        return None
    # Up to 3 rounds each end, never overlapping (a slow machine may train only a few rounds:
    # then the first and the last are compared).
    k = max(1, min(3, len(losses) // 2))
    window = losses[-k:] if last else losses[:k]
    return sum(window) / len(window)


def start_adversary(key_number: int, modes: str, junk_mib: int = 512) -> Extra:
    """A scenario's `extra`: a hostile member (adversary.py) playing `modes`, its coordinator
    link and its junk to the peers' blob ports through the proxies (`junk_mib`: the size of its
    `junk-result` blob)."""

    async def start(cluster: Cluster) -> list[str]:
        port = await cluster.coordinator_proxy()
        peers = ",".join(
            f"{cluster.announce_host(n)}:{cluster.p2p_ports[n][1]}"
            for n in cluster.spec.client_numbers
        )
        await cluster.start(
            "adversary",
            [
                sys.executable, str(CHAOS_DIR / "adversary.py"),
                "--server-addr", f"127.0.0.1:{port}", "--run-id", "tiny-cpu",
                "--key-number", str(key_number), "--modes", modes,
                "--data-addr", f"127.0.0.1:{cluster.data_port}", "--peers", peers,
                "--junk-mib", str(junk_mib),
            ],
        )  # fmt: skip
        return ["adversary"]

    return start


async def run_scenario(
    scenario: Scenario,
    workdir: Path,
    *,
    seed: int = 0,
    observe: Callable[[Context], None] | None = None,
) -> ScenarioResult:
    """Runs one scenario; `observe` sees the settled cluster (its nodes' output) before the
    figures are taken and the processes stopped; the checkpoint and save directories are
    checked for partial files after they stopped."""
    workdir.mkdir(parents=True, exist_ok=True)
    async with Cluster.open(workdir, scenario.run) as cluster:
        ctx = Context(cluster, random.Random(seed))
        extra = await scenario.extra(cluster) if scenario.extra is not None else []
        await cluster.start_run(
            extra, limits=scenario.client_limits, server_limits=scenario.server_limits
        )
        await cluster.wait_line("server", r"-> RoundTrain \(", 180)
        t0 = time.time()
        cpu0 = cluster.cpu_seconds("server")
        async with trio.open_nursery() as nursery:
            if scenario.inject is not None:
                nursery.start_soon(scenario.inject, ctx)
            if scenario.supervise:
                nursery.start_soon(supervise, ctx)
            nursery.start_soon(_watch_exits, ctx)
            await trio.sleep(scenario.duration)
            nursery.cancel_scope.cancel()
        t1 = time.time()
        cpu1 = cluster.cpu_seconds("server")
        # lift every fault, then let the run reach a cooldown everyone can be compared at
        cluster.net.clear()
        for name in cluster.nodes:
            cluster.signal(name, signal.SIGCONT)
        await _settle(ctx, t1)
        if observe is not None:
            observe(ctx)
        result = _result(scenario, ctx, t0, t1)
        if cpu0 is not None and cpu1 is not None and cpu0[0] == cpu1[0]:
            result.server_cpu_per_min = 60 * (cpu1[1] - cpu0[1]) / (t1 - t0)
    # Leftovers are judged once every process has stopped: a checkpoint being written while the
    # figures were taken is not a partial file (its temporary directory is still in use).
    return replace(result, partial_files=partial_files(cluster))


def run_captured(scenario: Scenario, workdir: Path) -> dict[str, Any]:
    """Runs `scenario` (from synchronous code: the tests' fixtures) and returns its result with
    what the settled run left: `result`, `nodes` (each process's name -> its JSON events and
    its whole output), `running` (name -> whether it still ran) and `checkpoints` (the
    checkpoint directory)."""
    captured: dict[str, Any] = {}

    def observe(ctx: Context) -> None:
        nodes = ctx.cluster.nodes
        captured["nodes"] = {name: (node.events(), node.text()) for name, node in nodes.items()}
        captured["running"] = {name: node.running for name, node in nodes.items()}
        captured["checkpoints"] = ctx.cluster.checkpoints

    captured["result"] = trio.run(partial(run_scenario, scenario, workdir, observe=observe))
    return captured


async def run_testnet_scenario(
    scenario: Scenario, workdir: Path, *, interval: float, seed: int = 0
) -> ScenarioResult:
    """`psyche-local-testnet --headless` with its own random kill (SIGINT to a client, the same
    command started again), measured like the other scenarios from its prefixed output."""
    workdir.mkdir(parents=True, exist_ok=True)
    async with Cluster.open(workdir, scenario.run, proxies=False) as cluster:
        ctx = Context(cluster, random.Random(seed))
        numbers = scenario.run.client_numbers
        argv = [
            sys.executable, "-m", "psyche.cli.local_testnet", "start",
            "--num-clients", str(len(numbers)), "--config-path", str(cluster.config_dir),
            "--headless", "--server-port", str(cluster.server_port),
            "--random-kill-num", "1", "--random-kill-interval", f"{interval:g}",
            "--allowed-to-kill", ",".join(str(n) for n in numbers if n != REFERENCE),
            "--client-args", "--logs json --device cpu --bind-p2p-interface lo",
        ]  # fmt: skip
        testnet = await cluster.start("testnet", argv)
        await cluster.wait_line("testnet", r"\[server\] .*-> RoundTrain \(", 240)
        t0 = time.time()
        await trio.sleep(scenario.duration)
        t1 = time.time()
        # the testnet goes on killing: wait for the reference client's next cooldown only
        reference = Cluster.client_name(REFERENCE)
        with trio.move_on_after(75):
            while not _split_testnet(testnet.lines)[reference].events("cooldown_model", since=t1):
                await trio.sleep(1)
        await cluster.stop("testnet")
        cluster.nodes = _split_testnet(testnet.lines)
        for line in testnet.lines:
            found = re.search(r"random kill: restarting (client-(\d+))", line.text)
            if found and line.t < t1:
                ctx.restarts.append((found.group(1), line.t))
                ctx.record("sigint-restart", found.group(1), "the testnet's random kill",
                           t=line.t, until=line.t, number=int(found.group(2)))  # fmt: skip
        return _result(scenario, ctx, t0, t1)


def _split_testnet(lines: Sequence[Any]) -> dict[str, Any]:
    """The testnet's output as one node per child (`[client-2] {...}` -> client-2)."""
    from cluster import Line, Node

    nodes: dict[str, Node] = {}
    for line in lines:
        found = re.match(r"\[([\w-]+)\] (.*)$", line.text)
        if found is None:
            continue
        name, text = found.groups()
        node = nodes.setdefault(name, Node(name, [], {}, Path()))
        doc = None
        if text.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                doc = json.loads(text)
        node.lines.append(Line(line.t, text, doc))
    return nodes


async def _watch_exits(ctx: Context) -> None:
    while True:
        await trio.sleep(0.5)
        for name, node in ctx.cluster.nodes.items():
            if not node.running and name not in ctx.expected_exits and node.process is not None:
                ctx.expected_exits.add(name)
                ctx.record("unexpected-exit", name, f"exit code {node.process.returncode}")


async def _settle(ctx: Context, t1: float, timeout: float = 75.0) -> None:
    """Wait until every running client logged a cooldown after `t1`."""
    with trio.move_on_after(timeout):
        while True:
            running = [
                n for n in ctx.cluster.nodes.values() if n.running and n.name.startswith("client-")
            ]
            if all(n.events("cooldown_model", since=t1) for n in running):
                return
            await trio.sleep(0.5)


def _result(scenario: Scenario, ctx: Context, t0: float, t1: float) -> ScenarioResult:
    cluster = ctx.cluster
    clients = {
        name: [dict(e) for e in node.events()]
        for name, node in cluster.nodes.items()
        if name != "server"
    }
    reference = clients[Cluster.client_name(REFERENCE)]
    server_lines = cluster.nodes["server"].lines
    rounds = [line.t for line in server_lines if "-> RoundTrain (" in line.text]
    epochs = sum(
        1 for line in server_lines if t0 <= line.t < t1 and "finished at step" in line.text
    )
    in_window = [t for t in rounds if t0 <= t < t1]
    round_epochs = [
        (line.t, int(found.group(1)))
        for line in server_lines
        if t0 <= line.t < t1 and (found := re.search(r"-> RoundTrain \(epoch (\d+)", line.text))
    ]
    round_secs = (t1 - t0) / max(1, len(in_window))
    tokens = metrics.applied_tokens(reference, SEQ_LEN, t0, t1)
    lost = metrics.lost_assignments(reference)
    faults = [f for f in ctx.faults if f.kind != "unexpected-exit"]
    departures = [f for f in faults if f.kind in ("sigkill", "sigint-restart", "dropped-restart")]
    agreement = metrics.model_agreement(clients)
    rejoins = []
    for name, restarted in ctx.restarts:
        peers = {n: evs for n, evs in clients.items() if n != name}
        info = metrics.rejoin(name, restarted, clients[name], peers, rounds)
        rejoins.append({**asdict(info), "seconds": info.seconds})
    counts: dict[str, int] = {}
    for fault in faults:
        counts[fault.kind] = counts.get(fault.kind, 0) + 1
    return ScenarioResult(
        name=scenario.name,
        title=scenario.title,
        duration=round(t1 - t0, 1),
        faults=[asdict(f) for f in ctx.faults],
        fault_counts=counts,
        rounds=len(in_window),
        rounds_total=len(rounds),
        epochs=epochs,
        tokens=tokens,
        tokens_per_s=tokens / (t1 - t0),
        lost_per_departure=metrics.lost_per_fault(lost, departures, round_secs),
        lost_per_fault=metrics.lost_per_fault(lost, faults, round_secs),
        lost_total=sum(1 for x in lost if t0 - round_secs <= x.ts < t1),
        dropped=counts.get("dropped-restart", 0),
        rejoins=rejoins,
        models_identical=agreement.identical,
        epochs_checked=agreement.epochs_checked,
        model_problems=agreement.problems,
        applied_problems=metrics.applied_agreement(clients),
        unexpected_exits=[
            f"{f.target}: {f.detail}" for f in ctx.faults if f.kind == "unexpected-exit"
        ],
        partial_files=partial_files(cluster),
        loss_first=_mean_loss(reference, last=False),
        loss_last=_mean_loss(reference, last=True),
        evidence={
            name: sum(
                len(re.findall(pattern, line.text))
                for node in cluster.nodes.values()
                for line in node.lines
            )
            for name, pattern in EVIDENCE.items()
        },
        round_seconds=metrics.median_round_seconds(round_epochs),
    )


ADVERSARY_KEY = 66
ATTACK_MODES = "junk-result+garbage-blob"
"""Issue 24, item 4: each round the hostile member trains in it offers, for its batch, its junk
result (512 MiB of random bytes) and a 4 KiB blob that does not decode."""


def attack_scenario(
    name: str,
    duration: float,
    flood_at: Sequence[float],
    *,
    config: dict[str, int],
    junk_mib: int = 512,
    max_logins: int = 20_000,
    member_joins_late: bool = False,
    barrage_margin: float = 8,
) -> Scenario:
    """Issue 24's items 1, 2 and 4 together against a live run of three honest clients and a
    hostile member: strangers' 8 MiB `HealthCheck` frames at the coordinator for the whole
    window but its last `barrage_margin` s (the strangers' process reports before the window
    closes), a silent flood of a client's libp2p port at each of `flood_at`
    (seconds into the window; the first followed by another client's restart), and the
    member's junk results whenever it trains. `config` must give a joiner a warmup well beyond
    the 10 s it loses asking the hostile member for a part of the model (`warmup_time` just
    under `epoch_time`); the hostile member never delivers, so rounds of epochs it is in run to
    `max_round_train_time`.

    The member starts with the run, for its first epoch (which must then wait for four
    clients, `init_min_clients` 4: as long as three honest clients cannot start an epoch
    alone, its bans yield), or, `member_joins_late`, when the window opens: it joins the
    running run's next epoch, as an attacker would, and the first epoch is the honest
    clients' alone (it joins in a second; with `init_min_clients` 3 an epoch that started as
    soon as it and two clients were in left the third out)."""
    floods = ", ".join(f"{t:g}" for t in flood_at)
    member = start_adversary(ADVERSARY_KEY, ATTACK_MODES, junk_mib)

    async def join_late(ctx: Context) -> None:
        await member(ctx.cluster)

    return Scenario(
        name,
        f"issue 24 items 1, 2, 4: strangers' 8 MiB HealthChecks for "
        f"{duration - barrage_margin:g} s, 2000 "
        f"silent connections at a client's libp2p port at {floods} s (after the first another "
        f"client restarted), a member's {junk_mib} MiB junk results",
        duration,
        together(
            *([join_late] if member_joins_late else []),
            health_check_flood(duration - barrage_margin, max_logins=max_logins),
            *(at(t, silent_flood(rejoin=i == 0)) for i, t in enumerate(flood_at)),
        ),
        RunSpec(num_clients=3, config=config),
        extra=None if member_joins_late else member,
    )


# ---- the catalogue -------------------------------------------------------------------------


def catalogue(duration: float, interval: float) -> dict[str, Scenario]:
    """The long suite (`just chaos`): each scenario runs `duration` seconds; the soak mixes
    every client fault, one every `interval` seconds."""
    soak_faults = [
        sigkill_client(),
        pause_client(8),
        partition_client(8),
        latency(10, 1000, links="coordinator"),
        latency(10, 200, links="p2p", bandwidth=2e6),
        data_outage(1.5),
    ]
    return {
        "baseline": Scenario("baseline", "fault-free run (the reference)", duration, None),
        "sigkill": Scenario(
            "sigkill", "SIGKILL a client, restart it 3 s later", duration,
            every(interval, [sigkill_client()]),
        ),
        "sigstop": Scenario(
            "sigstop", "SIGSTOP a client for 8 s, then SIGCONT", duration,
            every(interval, [pause_client(8)]),
        ),
        "partition": Scenario(
            "partition", "one client cut off from its peers for 8 s", duration,
            every(interval, [partition_client(8)]),
        ),
        "latency-1000": Scenario(
            "latency-1000", "1000 ms added to every coordinator link for 15 s", duration,
            every(interval, [latency(15, 1000)]),
        ),
        "latency-5000": Scenario(
            "latency-5000", "5000 ms added to every coordinator link for 15 s", duration,
            every(interval, [latency(15, 5000)]),
        ),
        "client-latency": Scenario(
            "client-latency", "1000 ms on every link of every client for 15 s", duration,
            every(interval, [latency(15, 1000, links="all")]),
        ),
        "bandwidth": Scenario(
            "bandwidth", "every link limited to 200 kB/s with 100 ms latency for 15 s", duration,
            every(interval, [latency(15, 100, links="all", bandwidth=2e5)]),
        ),
        "testnet-random-kill": Scenario(
            "testnet-random-kill",
            f"psyche-local-testnet --random-kill-num 1 --random-kill-interval {interval:g}",
            duration, None,
        ),
        "server-restart": Scenario(
            "server-restart", "SIGKILL the server, restart it from --save-state-dir", duration,
            every(max(interval, 45), [kill_server()]),
        ),
        "server-pause": Scenario(
            "server-pause", "SIGSTOP the server for 20 s (upstream: validator paused)", duration,
            every(max(interval, 45), [pause_server(20)]),
        ),
        "disk-full": Scenario(
            "disk-full", "client 2 checkpoints and the server saves onto a full disk", duration,
            None, RunSpec(checkpoint_client=2), client_limits={2: Limits(file_size=64 << 10)},
            server_limits=Limits(file_size=1 << 10),
        ),
        "data-outage": Scenario(
            "data-outage", "the data server restarting: unreachable for 1.5 s", duration,
            every(interval, [data_outage(1.5)]),
        ),
        "soak": Scenario(
            "soak", f"one fault every {interval:g} s, cycling through the client faults",
            duration, every(interval, soak_faults),
        ),
        "attacks": attack_scenario(
            "attacks", duration,
            [5, *range(int(interval), int(duration) - 10, int(interval))],
            config={"warmup_time": 19}, max_logins=1_000_000, member_joins_late=True,
        ),
    }  # fmt: skip
