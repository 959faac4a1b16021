"""Hostile members and strangers of a centralized run (issue 13), for the tests and the figures.

    python scripts/chaos/hostile_members.py spam --server-addr 127.0.0.1:P --key-number 77 \
        [--count 500] [--go-file PATH]
    python scripts/chaos/hostile_members.py silent --server-addr 127.0.0.1:P --run-id tiny-cpu \
        --key-number 66
    python scripts/chaos/hostile_members.py figures [--out DIR]

* `spam`: a key that never joins sends `--count` Checkpoint messages of 18 bytes (upstream
  broadcast the whole run state to every client for each), and as many Witness and HealthCheck
  messages, once `--go-file` exists (at once without it); it reads whatever the server sends.
  It prints `ready`, `sent` or `refused` (the server closed its connection: a private run).
* `silent`: a member that joins and never delivers anything; whenever it stops being a member
  (dropped, withdrawn, or the epoch it stalled ended) it reconnects and joins again, as an
  attacker would. It prints `joined`, `member` and `left` with the epoch.
* `figures`: runs the tiny CPU run (`psyche-server run` and two `psyche-client train` on
  loopback, one behind a counting proxy) and prints the rows of docs/reliability.md's "hostile
  members" table: the bytes the server sends an honest client in a quiet window and in a
  window of Checkpoint spam (the same sitting), and the epochs of a run a silent member joins,
  with `--ban-epochs 1` (the default) and `0` (upstream's rules).

Every line the actors print is JSON (`{"message": ..., ...}`). tests/e2e/test_hostile_members.py
uses the functions below.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu"
SCRIPT = Path(__file__).resolve()


def _repo_on_path() -> None:
    """The figures use the tests' process helpers (`tests/processes.py`, `tests/e2e`)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def emit(message: str, **fields: Any) -> None:
    print(json.dumps({"ts": time.time(), "message": message, **fields}), flush=True)


def test_key(number: int) -> Any:
    """The secret key the testnet gives client `number` (`RAW_IDENTITY_SECRET_KEY`)."""
    from psyche.core.identity import SecretKey

    return SecretKey.from_bytes(number.to_bytes(32, "big"))


# ---- the actors --------------------------------------------------------------------------------


async def _drain(client: Any) -> None:
    while True:
        await client.receive()
        client.received.clear()


async def spam(server_addr: str, key_number: int, count: int, go_file: Path | None) -> None:
    from psyche.centralized.protocol import ClientToServerMessage
    from psyche.centralized.testing import ProtocolClient
    from psyche.coordinator.backend import OpportunisticData
    from psyche.coordinator.model import Checkpoint, HubRepo
    from psyche.coordinator.testing import warmup_witness_for
    from psyche.transport import ConnectionClosed

    client = await ProtocolClient.connect(server_addr, test_key(key_number))
    try:
        with trio.fail_after(10):
            await client.receive()  # a private run closes the connection instead
    except (ConnectionClosed, trio.BrokenResourceError, trio.TooSlowError) as e:
        emit("refused", error=str(e))
        return
    emit("ready")
    kinds = [
        ClientToServerMessage.Checkpoint(Checkpoint.Hub(HubRepo("a/b"))),
        ClientToServerMessage.Witness(OpportunisticData.WarmupStep(warmup_witness_for(0))),
        ClientToServerMessage.HealthCheck([]),
    ]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_drain, client)
        while go_file is not None and not go_file.exists():
            await trio.sleep(0.05)
        for message in kinds:
            for _ in range(count):
                await client.send(message)
        emit("sent", messages=count * len(kinds))


async def silent(server_addr: str, run_id: str, key_number: int) -> None:
    from psyche.centralized.testing import ProtocolClient
    from psyche.core.node_identity import NodeIdentity

    key = test_key(key_number)
    me = NodeIdentity.from_single_key(key.public_key)
    while True:
        async with await ProtocolClient.connect(server_addr, key) as client:
            await client.join(run_id)
            emit("joined")
            was_member = False
            while True:
                state = await client.next_coordinator()
                client.received.clear()
                member = any(c.id == me for c in state.epoch_state.clients)
                if member and not was_member:
                    emit("member", epoch=state.progress.epoch, step=state.progress.step)
                if was_member and not member:
                    emit("left", epoch=state.progress.epoch, step=state.progress.step)
                    break  # come back: reconnect and join again
                was_member = member


# ---- a counting proxy ----------------------------------------------------------------------------


class CountingProxy:
    """`proxy.Proxy` in a thread of its own, forwarding 127.0.0.1:`port` to the coordinator;
    `bytes_down()` is what the server sent through it so far (connections still open)."""

    def __init__(self, target_port: int) -> None:
        sys.path.insert(0, str(SCRIPT.parent))
        import proxy

        self.net = proxy.ProxyNet()
        self._proxy = proxy.Proxy(self.net, "server", ("127.0.0.1", target_port))
        self.port = 0
        self._ready = threading.Event()
        self._token: Any = None
        self._scope: Any = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            self._scope = scope
            async with trio.open_nursery() as nursery:
                self.port = await nursery.start(self._proxy.serve)
                self._ready.set()

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(30)

    def bytes_down(self) -> int:
        return sum(conn.bytes_down for conn in list(self.net.conns))


# ---- runs -----------------------------------------------------------------------------------------


def write_run(directory: Path, **config: int) -> Path:
    """The tiny run in `directory` (its data server on a free port, the model path absolute)
    with `config` overriding `[config]` values (tests/e2e/conftest.py's shape)."""
    _repo_on_path()
    from tests.e2e.conftest import write_tiny_run

    total_steps = config.pop("total_steps", None)
    run = write_tiny_run(directory, **config)
    state = run / "state.toml"
    text = state.read_text().replace(
        'repo_id = "configs/tiny-cpu/model"', f'repo_id = "{TINY / "model"}"'
    )
    if total_steps is not None:  # the run's and the learning-rate schedule's
        text = re.sub(r"(?m)^total_steps = \d+$", f"total_steps = {total_steps}", text)
    state.write_text(text)
    return run


def server_command(run: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "psyche.cli.server", "run", "--state", str(run / "state.toml"),
        "--data-config", str(run / "data.toml"), "--server-port", str(port), "--tui", "false",
        *extra,
    ]  # fmt: skip


def client_command(server_port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "psyche.cli.client", "train", "--run-id", "tiny-cpu",
        "--server-addr", f"127.0.0.1:{server_port}", "--logs", "json", "--device", "cpu",
        "--bind-p2p-interface", "lo", "--server-reconnect-timeout", "0", *extra,
    ]  # fmt: skip


def actor_command(*args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), *args]


@dataclass
class Epoch:
    epoch: int
    clients: int
    first_step: int
    last_step: int
    seconds: int

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1


_CLOCK = r"(\d\d):(\d\d):(\d\d)"


def epochs(server_log: str) -> list[Epoch]:
    """Each finished epoch of a server log: its clients, steps and seconds (Warmup to its end)."""
    found = []
    starts: dict[int, tuple[int, int, int]] = {}
    for line in server_log.splitlines():
        clock = re.match(_CLOCK, line)
        if clock is None:
            continue
        seconds = int(clock[1]) * 3600 + int(clock[2]) * 60 + int(clock[3])
        if match := re.search(r"-> Warmup \(epoch (\d+), step (\d+), (\d+) clients\)", line):
            starts[int(match[1])] = (int(match[2]), int(match[3]), seconds)
        elif match := re.search(r"epoch (\d+) finished at step (\d+)", line):
            number = int(match[1])
            if number in starts:
                step, clients, began = starts[number]
                found.append(Epoch(number, clients, step, int(match[2]), (seconds - began) % 86400))
    return found


# ---- figures ---------------------------------------------------------------------------------------


@contextmanager
def _processes(directory: Path) -> Iterator[Any]:
    _repo_on_path()
    from tests.processes import Processes

    group = Processes(directory)
    try:
        yield group
    finally:
        group.stop_all()


def old_code_env(old_src: Path | None) -> dict[str, str]:
    """The environment that runs another checkout's packages (`old_src`: its `packages/`)
    instead of this one's: their `src` directories first on PYTHONPATH."""
    if old_src is None:
        return {}
    return {"PYTHONPATH": ":".join(str(p) for p in sorted(old_src.glob("*/src")))}


def traffic_figures(
    work: Path, window: float, count: int, old_src: Path | None = None
) -> dict[str, float]:
    """Bytes the server sends an honest client in a quiet window and in a spam window (the
    server from `old_src` when given, see `old_code_env`)."""
    _repo_on_path()
    from tests.processes import free_port, wait_event

    name = "old" if old_src else "new"
    work = work / f"traffic-{name}"
    run = write_run(work / "run", epoch_time=120, total_steps=200)
    port = free_port()
    with _processes(work) as procs, CountingProxy(port) as proxy:
        server = procs.start("server", server_command(run, port), env=old_code_env(old_src))
        procs.wait_for(server, r"serving run", 60)
        honest = [
            procs.start(
                f"client-{n}",
                client_command(proxy.port if n == 1 else port),
                env={"RAW_IDENTITY_SECRET_KEY": f"{n:064x}"},
            )
            for n in (1, 2)
        ]
        wait_event(honest[0], "applied_results", lambda e: True, 240)
        go = work / "go"
        spammer = procs.start(
            "spammer", actor_command("spam", "--server-addr", f"127.0.0.1:{port}",
                                     "--key-number", "77", "--count", str(count),
                                     "--go-file", str(go)),
        )  # fmt: skip
        procs.wait_for(spammer, r'"ready"', 60)
        before = proxy.bytes_down()
        time.sleep(window)
        quiet = proxy.bytes_down() - before
        before = proxy.bytes_down()
        go.touch()
        time.sleep(window)
        spammed = proxy.bytes_down() - before
        procs.wait_for(spammer, r'"sent"', 30)
    return {"quiet": quiet, "spam": spammed, "factor": spammed / max(quiet, 1)}


def silent_member_figures(work: Path, ban_epochs: int, epochs_wanted: int) -> list[Epoch]:
    _repo_on_path()
    from tests.processes import free_port

    work = work / f"silent-ban{ban_epochs}"
    run = write_run(work / "run", epoch_time=20, max_round_train_time=8, total_steps=200)
    port = free_port()
    with _processes(work) as procs:
        server = procs.start("server", server_command(run, port, "--ban-epochs", str(ban_epochs)))
        procs.wait_for(server, r"serving run", 60)
        for n in (1, 2):
            procs.start(
                f"client-{n}",
                client_command(port),
                env={"RAW_IDENTITY_SECRET_KEY": f"{n:064x}"},
            )
        # the silent member joins once the first epoch (the quiet baseline) is under way
        procs.wait_for(server, r"-> RoundTrain \(epoch 0", 240)
        procs.start(
            "silent",
            actor_command("silent", "--server-addr", f"127.0.0.1:{port}",
                          "--run-id", "tiny-cpu", "--key-number", "66"),
        )  # fmt: skip
        deadline = time.monotonic() + 60 * epochs_wanted
        while time.monotonic() < deadline and len(epochs(server.text())) < epochs_wanted:
            time.sleep(1)
        return epochs(server.text())


def figures(out: Path, window: float, count: int, epochs_wanted: int, old_src: Path | None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for source in ([old_src] if old_src else []) + [None]:
        traffic = traffic_figures(out, window, count, source)
        print(
            f"| Checkpoint spam, {'before' if source else 'after'} ({count} each of Checkpoint, "
            f"Witness, HealthCheck from a non-member) "
            f"| {traffic['quiet'] / window:,.0f} B/s to an honest client in a quiet "
            f"{window:.0f} s | {traffic['spam'] / window:,.0f} B/s in the {window:.0f} s of spam "
            f"| x{traffic['factor']:.2f} |",
            flush=True,
        )
    for ban in (1, 0):
        found = silent_member_figures(out, ban, epochs_wanted)
        cells = [
            f"epoch {e.epoch}: {e.clients} clients, {e.steps} steps in {e.seconds} s" for e in found
        ]
        print(f"| silent member, --ban-epochs {ban} | " + "; ".join(cells) + " |", flush=True)
    return 0


# ---- command line ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    spam_args = commands.add_parser("spam")
    spam_args.add_argument("--server-addr", required=True)
    spam_args.add_argument("--key-number", type=int, default=77)
    spam_args.add_argument("--count", type=int, default=500)
    spam_args.add_argument("--go-file", type=Path)
    silent_args = commands.add_parser("silent")
    silent_args.add_argument("--server-addr", required=True)
    silent_args.add_argument("--run-id", required=True)
    silent_args.add_argument("--key-number", type=int, default=66)
    figure_args = commands.add_parser("figures")
    figure_args.add_argument("--out", type=Path, default=None)
    figure_args.add_argument("--window", type=float, default=5.0)
    figure_args.add_argument("--count", type=int, default=500)
    figure_args.add_argument("--epochs", type=int, default=5)
    figure_args.add_argument(
        "--old-src",
        type=Path,
        help="the packages/ of an older checkout: also measure its server's traffic (before)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "spam":
            trio.run(spam, args.server_addr, args.key_number, args.count, args.go_file)
        elif args.command == "silent":
            trio.run(silent, args.server_addr, args.run_id, args.key_number)
        else:
            out = args.out or Path(tempfile.mkdtemp(prefix="hostile-members-"))
            print(f"logs in {out}", file=sys.stderr)
            return figures(out, args.window, args.count, args.epochs, args.old_src)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
