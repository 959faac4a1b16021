"""A run of real processes on loopback, every link behind a chaos proxy (the I/O shell).

`Cluster` starts `psyche-server run` and `psyche-client train` processes (through
`launch.py`), one coordinator proxy per client, a proxy in front of the data server, and two
proxies per client for its libp2p and blob listeners (announced at `127.0.0.<100+n>`). Every
output line is kept with its arrival time; the clients log JSON events.

    async with Cluster.open(workdir, RunSpec(num_clients=3)) as cluster:
        await cluster.start_server()
        for n in cluster.spec.client_numbers:
            await cluster.start_client(n)
        await cluster.wait_server(r"-> RoundTrain", timeout=120)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from proxy import ANY, Proxy, ProxyNet

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu"
CHAOS_DIR = Path(__file__).resolve().parent
LAUNCH = CHAOS_DIR / "launch.py"
RUN_ID = "tiny-cpu"
SERVER_CONNECT_TIMEOUT = 120.0
"""How long a client keeps trying to reach the coordinator at its start: beyond the 60 s the
harness gives the server to serve once every client was refused (`Cluster.start_run`)."""

# Fast rounds for the tiny model: a round is ~2 s of protocol waits; epochs of ~8 rounds.
FAST_CONFIG: dict[str, int] = {
    "warmup_time": 8,
    "cooldown_time": 3,
    "epoch_time": 20,
    "max_round_train_time": 6,
    "round_witness_time": 2,
    "witness_nodes": 0,
    "min_clients": 2,
    "waiting_for_members_extra_time": 3,
    "global_batch_size_start": 8,
    "global_batch_size_end": 8,
    "total_steps": 600,  # a 10-minute soak runs ~300 rounds; the dataset holds 634 steps of 8
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def client_key_hex(number: int) -> str:
    return f"{number:064x}"


def client_short_id(number: int) -> str:
    """`NodeIdentity`'s short form (first 4 bytes of the public key) of test key `number`."""
    from psyche.core.identity import SecretKey

    return SecretKey.from_bytes(number.to_bytes(32, "big")).public_key[:4].hex()


def write_tiny_run(directory: Path, data_addr: str, config: dict[str, int]) -> Path:
    """`state.toml` + `data.toml` (+ `data/`) for the tiny model, its data at `data_addr`."""
    from psyche.centralized.tiny_run import write_tiny_dataset

    directory.mkdir(parents=True, exist_ok=True)
    text = (TINY / "state.toml").read_text().replace("127.0.0.1:20001", data_addr)
    for key, value in config.items():
        # the first match is the `[config]` table's (the LR schedule has a `total_steps` too)
        text, count = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
        if count != 1:
            raise KeyError(f"{key} is not a line of configs/tiny-cpu/state.toml")
    (directory / "state.toml").write_text(text)
    write_tiny_dataset(directory / "data", tokenizer_path=TINY / "model" / "tokenizer.json")
    data = (TINY / "data.toml").read_text().replace('"../../data/tiny-cpu"', '"data"')
    (directory / "data.toml").write_text(data)
    return directory


@dataclass(frozen=True)
class RunSpec:
    num_clients: int = 3
    config: dict[str, int] = field(default_factory=dict)
    reconnect_timeout: float = 120.0
    checkpoint_client: int | None = None
    """This client writes checkpoints (to `workdir/checkpoints`)."""

    @property
    def client_numbers(self) -> list[int]:
        return list(range(1, self.num_clients + 1))

    @property
    def full_config(self) -> dict[str, int]:
        """Every epoch waits for all clients (`init_min_clients`): a run that started with fewer
        would leave the latecomers out for an epoch; one that lost a client waits for its
        replacement at the next epoch boundary."""
        return {**FAST_CONFIG, "init_min_clients": self.num_clients, **self.config}


@dataclass
class Line:
    t: float
    text: str
    doc: dict[str, Any] | None


@dataclass(eq=False)
class Node:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: trio.Process | None = None
    lines: list[Line] = field(default_factory=list)
    started_at: float = 0.0
    starts: list[float] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def events(self, message: str | None = None, *, since: float = 0.0) -> list[dict[str, Any]]:
        return [
            line.doc
            for line in self.lines
            if line.doc is not None
            and line.t >= since
            and (message is None or line.doc.get("message") == message)
        ]

    def text(self) -> str:
        return "\n".join(line.text for line in self.lines)


@dataclass(frozen=True)
class Limits:
    """Resource limits of a started process (`file_size`: RLIMIT_FSIZE, a full disk)."""

    file_size: int | None = None


def _preexec(limits: Limits | None) -> Callable[[], None] | None:
    if limits is None or limits.file_size is None:
        return None
    size = limits.file_size

    def apply() -> None:
        # A write past the limit then fails with EFBIG instead of killing the process.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return apply


class Cluster:
    def __init__(self, workdir: Path, spec: RunSpec, nursery: trio.Nursery) -> None:
        self.workdir = workdir
        self.spec = spec
        self.nursery = nursery
        self.net = ProxyNet()
        self.nodes: dict[str, Node] = {}
        self.server_port = free_port()
        self.data_port = free_port()
        self.config_dir = write_tiny_run(
            workdir / "run", f"127.0.0.1:{self.data_port}", spec.full_config
        )
        self.saves = workdir / "saves"
        self.checkpoints = workdir / "checkpoints"
        self.coordinator_ports: dict[int, int] = {}
        self.p2p_ports: dict[int, tuple[int, int]] = {}

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, workdir: Path, spec: RunSpec, *, proxies: bool = True
    ) -> AsyncIterator[Cluster]:
        """`proxies=False`: only the run directory (for a program that starts the run itself)."""
        async with trio.open_nursery() as nursery:
            cluster = cls(workdir, spec, nursery)
            try:
                if proxies:
                    await cluster._start_proxies()
                yield cluster
            finally:
                with trio.CancelScope(shield=True):
                    await cluster.stop_all()
                nursery.cancel_scope.cancel()

    # ---- names -------------------------------------------------------------------------------

    @staticmethod
    def client_name(number: int) -> str:
        return f"client-{number}"

    def announce_host(self, number: int) -> str:
        return f"127.0.0.{100 + number}"

    # ---- proxies -------------------------------------------------------------------------------

    async def _proxy(self, dst: str, target: tuple[str, int], listen: tuple[str, int]) -> int:
        proxy = Proxy(self.net, dst, target, listen)
        return int(await self.nursery.start(proxy.serve))

    async def _start_proxies(self) -> None:
        await self._proxy("data", ("127.0.0.2", self.data_port), ("127.0.0.1", self.data_port))
        for number in self.spec.client_numbers:
            await self.add_client_proxies(number)

    async def add_client_proxies(self, number: int) -> None:
        name = self.client_name(number)
        self.coordinator_ports[number] = await self._proxy(
            "server", ("127.0.0.1", self.server_port), ("127.0.0.1", 0)
        )
        p2p, blob = free_port(), free_port()
        self.p2p_ports[number] = (p2p, blob)
        host = self.announce_host(number)
        for port in (p2p, blob):
            await self._proxy(name, ("127.0.0.1", port), (host, port))

    # ---- processes -------------------------------------------------------------------------

    async def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        limits: Limits | None = None,
    ) -> Node:
        node = self.nodes.get(name)
        if node is None:
            node = Node(name, argv, env or {}, self.workdir / f"{name}.log")
            self.nodes[name] = node
        elif node.running:
            raise RuntimeError(f"{name} is already running")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **node.env}
        process = await trio.lowlevel.open_process(
            node.argv,
            cwd=str(REPO),
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_preexec(limits),
        )
        node.process = process
        node.started_at = time.time()
        node.starts.append(node.started_at)
        self.net.sources.register(process.pid, name)
        self.nursery.start_soon(self._pump, node, process)
        return node

    async def _pump(self, node: Node, process: trio.Process) -> None:
        assert process.stdout is not None
        buffer = b""
        with open(node.log_path, "ab") as log:
            async for chunk in process.stdout:
                log.write(chunk)
                log.flush()
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                now = time.time()
                for raw in complete:
                    text = raw.decode(errors="replace")
                    doc = None
                    if text.startswith("{"):
                        with contextlib.suppress(json.JSONDecodeError):
                            doc = json.loads(text)
                    node.lines.append(Line(now, text, doc))
        await process.wait()
        self.net.sources.forget(process.pid)

    def cpu_seconds(self, name: str) -> tuple[int, float] | None:
        """(pid, CPU seconds used so far: user + system) of a running process; None when it
        is not running or /proc does not say."""
        node = self.nodes.get(name)
        if node is None or not node.running or node.process is None:
            return None
        pid = node.process.pid
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        # utime and stime are the 14th and 15th fields; the split starts at the 3rd
        return pid, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def signal(self, name: str, signum: int) -> None:
        node = self.nodes[name]
        if node.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signum)

    async def kill(self, name: str) -> None:
        """SIGKILL the process group and wait for it."""
        node = self.nodes[name]
        self.signal(name, signal.SIGCONT)
        self.signal(name, signal.SIGKILL)
        if node.process is not None:
            await node.process.wait()

    async def stop(self, name: str, grace: float = 15.0) -> int | None:
        node = self.nodes[name]
        if node.process is None:
            return None
        if node.process.returncode is None:
            self.signal(name, signal.SIGCONT)
            self.signal(name, signal.SIGINT)
            with trio.move_on_after(grace):
                await node.process.wait()
        self.signal(name, signal.SIGKILL)
        await node.process.wait()
        return node.process.returncode

    async def stop_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for name in reversed(list(self.nodes)):
                nursery.start_soon(self.stop, name)

    # ---- the run's programs ---------------------------------------------------------------

    def server_argv(self, state: Path | None = None) -> list[str]:
        return [
            sys.executable, str(LAUNCH), "server", "run",
            "--state", str(state or self.config_dir / "state.toml"),
            "--data-config", str(self.config_dir / "data.toml"),
            "--server-port", str(self.server_port), "--tui", "false",
            "--save-state-dir", str(self.saves),
        ]  # fmt: skip

    async def start_server(self, *, resume: bool = False, limits: Limits | None = None) -> Node:
        node = self.nodes.get("server")
        argv = self.server_argv(self.saves if resume else None)
        if node is not None:
            node.argv = argv
        else:
            node = Node("server", argv, {"CHAOS_DATA_SERVER_HOST": "127.0.0.2"}, Path())
            node.log_path = self.workdir / "server.log"
            self.nodes["server"] = node
        after = len(node.lines)
        await self.start("server", argv, node.env, limits)
        await self.wait_line("server", r"serving run '", 60, after=after)
        return node

    def client_argv(self, number: int) -> list[str]:
        p2p, _ = self.p2p_ports[number]
        argv = [
            sys.executable, str(LAUNCH), "client", "train", "--run-id", RUN_ID,
            "--server-addr", f"127.0.0.1:{self.coordinator_ports[number]}",
            "--logs", "json", "--device", "cpu", "--bind-p2p-interface", "lo",
            "--bind-p2p-port", str(p2p),
            "--server-reconnect-timeout", str(self.spec.reconnect_timeout),
            # the server starts once every client was refused (`start_run`): on a crowded
            # machine its own start outlasted the clients' default 30 s (load 17)
            "--server-connect-timeout", str(SERVER_CONNECT_TIMEOUT),
        ]  # fmt: skip
        if number == self.spec.checkpoint_client:
            argv += ["--checkpoint-dir", str(self.checkpoints)]
        return argv

    def client_env(self, number: int) -> dict[str, str]:
        return {
            "RAW_IDENTITY_SECRET_KEY": client_key_hex(number),
            "CHAOS_ANNOUNCE_HOST": self.announce_host(number),
            "CHAOS_BLOB_PORT": str(self.p2p_ports[number][1]),
        }

    async def start_client(self, number: int, limits: Limits | None = None) -> Node:
        if number not in self.p2p_ports:
            await self.add_client_proxies(number)
        return await self.start(
            self.client_name(number), self.client_argv(number), self.client_env(number), limits
        )

    async def start_run(
        self,
        extra: Sequence[str] = (),
        limits: Mapping[int, Limits] | None = None,
        server_limits: Limits | None = None,
    ) -> None:
        """Start every client, then the server once each client (and each name in `extra`)
        has tried to reach it: they are all loaded and join within a second, so the first
        epoch has everyone (the server starts an epoch as soon as enough clients are pending)."""
        for number in self.spec.client_numbers:
            await self.start_client(number, (limits or {}).get(number))
        names = [self.client_name(n) for n in self.spec.client_numbers] + list(extra)
        with trio.fail_after(180):
            while not all(self.net.refused_from.get(name) for name in names):
                await trio.sleep(0.2)
        await self.start_server(limits=server_limits)

    async def coordinator_proxy(self) -> int:
        """A coordinator link for another process (its connections are attributed to it by
        pid once it is started with `start`); returns the port to give it."""
        return await self._proxy("server", ("127.0.0.1", self.server_port), ("127.0.0.1", 0))

    # ---- waiting -------------------------------------------------------------------------------

    async def wait_line(
        self, name: str, pattern: str, timeout: float, *, after: int = 0
    ) -> re.Match[str]:
        regex = re.compile(pattern)
        node = self.nodes[name]
        index = after
        with trio.fail_after(timeout):
            while True:
                while index < len(node.lines):
                    match = regex.search(node.lines[index].text)
                    index += 1
                    if match:
                        return match
                if node.process is not None and node.process.returncode is not None:
                    await trio.sleep(0.3)  # the last lines
                    if index >= len(node.lines):
                        raise RuntimeError(f"{name} exited before printing {pattern!r}")
                await trio.sleep(0.1)

    async def wait_event(
        self,
        name: str,
        message: str,
        predicate: Callable[[dict[str, Any]], bool] = lambda e: True,
        timeout: float = 60.0,
        *,
        since: float = 0.0,
    ) -> dict[str, Any]:
        node = self.nodes[name]
        with trio.fail_after(timeout):
            while True:
                for doc in node.events(message, since=since):
                    if predicate(doc):
                        return doc
                await trio.sleep(0.2)

    def server_rounds(self, since: float = 0.0, until: float = float("inf")) -> list[Line]:
        """The server's RoundTrain transitions (one per round)."""
        node = self.nodes["server"]
        return [
            line
            for line in node.lines
            if since <= line.t < until and "-> RoundTrain (" in line.text
        ]


__all__ = ["ANY", "Cluster", "Limits", "Line", "Node", "RunSpec", "client_short_id"]
