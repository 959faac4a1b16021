"""Helpers of the Solana end-to-end tests: real processes, their logs, and a TCP proxy that can
take an RPC endpoint away and bring it back.

* `Processes`: starts commands with their output in `<dir>/<name>.log`, waits for log lines, and
  at the end interrupts, then kills, every process it started (and its process group).
* `Proxy`: forwards a loopback port to another; `down()` closes the listener and every
  forwarded connection (clients see the endpoint vanish), `up()` listens on the same port again.
* `json_events(text, name)`: the JSON log lines of a `--logs json` client.
* `start_endpoint(processes, directory, names)`: the tiny run's dataset served over HTTP, a
  wallet per name and the local endpoint (its own process) funding them; `run_config` the tiny
  CPU run's config with its data there and `config` over its `[config]`.
"""

from __future__ import annotations

import contextlib
import re
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solders.keypair import Keypair

from psyche.core.identity import SecretKey
from psyche.solana.keypair import derive_p2p_secret_key, write_keypair_file

from ..processes import REPO, Processes, free_port, json_events, wait_event
from ..timing import scaled_timers

__all__ = [
    "EVERYONE",
    "REPO",
    "TINY",
    "Endpoint",
    "Processes",
    "Proxy",
    "create_run",
    "free_port",
    "json_events",
    "member_train_argv",
    "p2p_id",
    "run_config",
    "start_endpoint",
    "wait_event",
]

TINY = REPO / "configs" / "tiny-cpu"


@dataclass(frozen=True)
class Endpoint:
    """A local endpoint process and what it serves: the tiny dataset's URL, funded wallets."""

    rpc_port: int
    ws_port: int
    data_url: str
    wallets: dict[str, Keypair]
    paths: dict[str, Path]

    @property
    def rpc(self) -> str:
        return f"http://127.0.0.1:{self.rpc_port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.ws_port}"


def start_endpoint(processes: Processes, directory: Path, names: Sequence[str]) -> Endpoint:
    """The tiny dataset over HTTP and the local endpoint, a funded wallet file per name."""
    from psyche.centralized.tiny_run import write_tiny_dataset

    dataset = write_tiny_dataset(
        directory / "data", tokenizer_path=TINY / "model" / "tokenizer.json"
    )
    data_port = free_port()
    data = processes.start(
        "data",
        [sys.executable, "-m", "psyche.data_provider.static_http", str(dataset.parent),
         "--host", "127.0.0.1", "--port", str(data_port)],
    )  # fmt: skip
    wallets = {name: Keypair() for name in names}
    paths = {name: directory / f"{name}.json" for name in names}
    for name in names:
        write_keypair_file(wallets[name], paths[name])
    rpc_port = free_port()
    localnet = processes.start(
        "localnet",
        [sys.executable, "-m", "psyche.cli.solana_client.main", "localnet",
         "--port", str(rpc_port), "--ws-port", str(free_port()),
         *(x for name in names for x in ("--fund", str(paths[name])))],
    )  # fmt: skip
    ws_port = int(processes.wait_for(localnet, r"websocket: ws://127\.0\.0\.1:(\d+)", 60)[1])
    processes.wait_for(data, r"serving", 30)
    url = f"http://127.0.0.1:{data_port}/{dataset.name}"
    return Endpoint(rpc_port, ws_port, url, wallets, paths)


EVERYONE = "11111111111111111111111111111111"
"""The authorizer that lets any wallet join (a permissionless run)."""


def member_train_argv(
    endpoint: Endpoint, run_id: str, name: str, ports: Mapping[str, int]
) -> list[str]:
    """`psyche-solana-client train`'s arguments for member `name` of a run on `endpoint`: JSON
    logs, the CPU, loopback P2P on its port of `ports`, every other member a bootstrap peer."""
    peers = [
        x
        for other in ports
        if other != name
        for x in (
            "--bootstrap-peer",
            f"{p2p_id(run_id, endpoint.wallets[other])}@127.0.0.1:{ports[other]}",
        )
    ]
    return ["train", "--rpc", endpoint.rpc, "--ws-rpc", endpoint.ws,
            "-w", str(endpoint.paths[name]), "--run-id", run_id, "--authorizer", EVERYONE,
            "--logs", "json", "--device", "cpu", "--bind-p2p-interface", "lo",
            "--bind-p2p-port", str(ports[name]), *peers]  # fmt: skip


def create_run(
    endpoint: Endpoint, directory: Path, run_id: str, config: Mapping[str, Any]
) -> list[str]:
    """Set up run `run_id` with the admin commands as its owner would type them (in this
    process, over real RPC): authorize everyone, create it, load `config`. It stays paused.
    Returns the owner's cluster arguments for further commands."""
    from psyche.cli.solana_client.main import main as solana_client

    config_path = directory / "run.toml"
    config_path.write_text(run_config(endpoint.data_url, config))
    cluster = ["--rpc", endpoint.rpc, "--ws-rpc", endpoint.ws, "-w", str(endpoint.paths["owner"])]
    for argv in (
        ["join-authorization-create", "--authorizer", EVERYONE],
        ["create-run", "--run-id", run_id, "--client-version", "test"],
        ["update-config", "--run-id", run_id, "--config-path", str(config_path)],
    ):
        assert solana_client([*argv, *cluster]) == 0, argv
    return cluster


def p2p_id(run_id: str, wallet: Keypair) -> str:
    """The P2P identity a Solana client of `run_id` derives from its wallet."""
    return SecretKey.from_bytes(derive_p2p_secret_key(run_id, wallet)).public_key.hex()


def run_config(data_url: str, config: Mapping[str, Any]) -> str:
    """The tiny CPU run with `config` over its `[config]` (timings scaled to this machine's
    speed, tests/timing.py) and its data over HTTP at `data_url` (there is no server)."""
    text = (TINY / "state.toml").read_text()
    for key, value in scaled_timers(config).items():
        line = f"{key} = {str(value).lower() if isinstance(value, bool) else value}"
        text, count = re.subn(rf"(?m)^{key} = .*$", line, text)
        if count == 0:  # a field the tiny run leaves at its default (`verifiers_train`)
            text, count = re.subn(r"(?m)^\[config\]$", f"[config]\n{line}", text)
        assert count == 1, key
    http = (
        f'location = {{ SingleUrl = "{data_url}" }}, token_size_in_bytes = "TwoBytes", '
        'shuffle = "DontShuffle"'
    )
    location = f"data_location = {{ Http = {{ {http} }} }}"
    text, count = re.subn(r"(?m)^data_location = .*$", location, text)
    assert count == 1
    return text


class Proxy:
    """A loopback TCP forwarder whose listening port can go away and come back."""

    def __init__(self, target_port: int, port: int = 0) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.connections = 0

    def __enter__(self) -> Proxy:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Stop listening and cut every forwarded connection (both sides see it close)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
                self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
