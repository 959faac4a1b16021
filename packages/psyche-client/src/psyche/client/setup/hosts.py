"""A client across hosts: where its ranks meet, and how each side notices the other's death.

Upstream runs a client over several hosts with `psyche-sidecar python --main-host H --port P
--world-size W --start-rank R` on each other host: its ranks join the client's
`torch.distributed` group through a TCP store the client (rank 0) serves at `H:P`. Here the
same: the client given `--main-host` serves the store (`open_store`) and publishes its layout
(`LAYOUT_KEY`: data/tensor parallelism, FSDP and its dtypes) there; a `psyche-client sidecar`
reads it, starts its ranks as the client starts its local ones (`workers._worker_main`, so
they build, train and exit the same way), and they join the group through the store.

Deaths. Ranks on the client's host are its children: it sees them exit (process sentinels).
Ranks on other hosts are the sidecar's children; the sidecar and the client see each other
through the store (`Heartbeats`):

* each side bumps its counter every `BEAT_SECS` (`alive/0` for the client, `alive/<rank>` for
  each rank a sidecar runs); a counter that has not moved for `HeartbeatSettings.silence_secs`
  (`SILENCE_SECS` unless set: a host that froze, a network that split) is a death, read with
  the reader's own clock (hosts' clocks need not agree);
* a sidecar whose rank exits writes `died/<rank>` = its exit code, stops its other ranks and
  exits; the client's `WorkerGroup.watch` reads it within a beat and stops the client with one
  line, as for a local rank;
* a client that exits takes its store with it: the sidecar's next store operation fails, and
  it stops its ranks and exits (its ranks also watch it, their parent, as local ranks watch
  the client).

The store and the collectives are unauthenticated, as upstream's (and torch's): `--main-host`
must be an address on a network only the client's hosts reach. The ranks' collectives use the
interface that reaches the main host (`use_interface_towards`; gloo otherwise picks the address
of the host name, often a loopback one).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from psyche.client.setup.ranks import RankLayout
from psyche.core.cli import UserError

if TYPE_CHECKING:
    from torch.distributed import Store

log = logging.getLogger(__name__)

LAYOUT_KEY = "psyche/layout"
BEAT_SECS = 1.0
SILENCE_SECS = 15.0
JOIN_TIMEOUT = timedelta(minutes=30)
CONNECT_TRY_SECS = 5.0
_SIOCGIFADDR = 0x8915


class HostsError(UserError):
    """The ranks of other hosts cannot be reached or joined (one line)."""


def alive_key(rank: int) -> str:
    return f"psyche/alive/{rank}"


def died_key(rank: int) -> str:
    return f"psyche/died/{rank}"


def interface_of(address: str) -> str | None:
    """The name of the local network interface holding IPv4 `address`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def use_interface_towards(main_host: str, port: int) -> None:
    """Make gloo and NCCL use the interface this host reaches `main_host` through (unless the
    user set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); this process's children inherit it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((main_host, port))  # no packet is sent: only the route is chosen
        except OSError as e:
            raise HostsError(f"--main-host {main_host}: no route to it ({e})") from e
        local = probe.getsockname()[0]
    name = interface_of(local)
    if name is None:
        return
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, name)


def open_store(layout: RankLayout) -> Store:
    """The client's store at `main_host:port` (served by this process), with the layout the
    other hosts' ranks take."""
    from torch.distributed import TCPStore

    assert layout.main_host is not None
    try:
        store = TCPStore(
            layout.main_host,
            layout.port,
            is_master=True,
            timeout=JOIN_TIMEOUT,
            wait_for_workers=False,
        )
    except Exception as e:  # torch's DistNetworkError and kin: the address or port is taken
        raise HostsError(
            f"cannot serve the ranks' store at {layout.main_host}:{layout.port}: {e}"
        ) from e
    store.set(LAYOUT_KEY, json.dumps(layout.shared()))
    return store


def connect_store(main_host: str, port: int, timeout: float) -> Store:
    """A client of the store at `main_host:port`, trying for `timeout` seconds (in short
    tries, so Ctrl+C stops it)."""
    from torch.distributed import TCPStore

    deadline = time.monotonic() + timeout
    while True:
        try:
            return TCPStore(
                main_host, port, is_master=False, timeout=timedelta(seconds=CONNECT_TRY_SECS)
            )
        except Exception as e:  # torch's DistNetworkError / DistStoreError: not up yet
            if time.monotonic() > deadline:
                raise HostsError(
                    f"cannot reach the client's store at {main_host}:{port} within "
                    f"{timeout:.0f} s: {e}"
                ) from e


def read_layout(store: Store) -> dict[str, Any]:
    """The leader's shared layout fields (waits for them as long as the store's timeout)."""
    return dict(json.loads(store.get(LAYOUT_KEY)))


@dataclass(frozen=True)
class HeartbeatSettings:
    """How long a watched counter may stand still before its rank counts as dead. The default
    (`SILENCE_SECS`, fifteen beats) outlasts a loaded host's stalls; a shorter one notices a
    frozen host sooner (the tests' frozen host) at the risk of calling a stalled one dead."""

    silence_secs: float = SILENCE_SECS

    def __post_init__(self) -> None:
        if not self.silence_secs > BEAT_SECS:
            raise ValueError(f"silence_secs must exceed a beat ({BEAT_SECS} s)")


class Heartbeats:
    """This side's counters bumped every `BEAT_SECS`, and the other side's read: `silent()`
    names the first watched rank whose counter has not moved for `settings.silence_secs`."""

    def __init__(
        self,
        store: Store,
        own: Iterable[int],
        watched: Iterable[int],
        settings: HeartbeatSettings | None = None,
    ) -> None:
        self.store = store
        self.own = list(own)
        self.watched = list(watched)
        self.settings = settings or HeartbeatSettings()
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        for rank in self.own:
            self.store.add(alive_key(rank), 1)

    def start(self) -> None:
        """Bump this side's counters in a thread until `stop` (a failed bump ends it: the
        other side then sees this one go silent)."""
        self.beat()

        def run() -> None:
            while not self._stop.wait(BEAT_SECS):
                try:
                    self.beat()
                except Exception as e:
                    log.debug("heartbeat stopped: %s", e)
                    return

        self._thread = threading.Thread(target=run, name="psyche-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def joined(self) -> list[int]:
        """The watched ranks whose counter exists."""
        return [r for r in self.watched if self.store.check([alive_key(r)])]

    def silent(self, now: float | None = None) -> int | None:
        """The first watched rank silent for `settings.silence_secs` (counters that never appeared
        count from the first call)."""
        now = time.monotonic() if now is None else now
        for rank in self.watched:
            value = self.store.get(alive_key(rank)) if self.store.check([alive_key(rank)]) else b""
            last = self._seen.get(rank)
            if last is None or last[0] != value:
                self._seen[rank] = (value, now)
            elif now - last[1] > self.settings.silence_secs:
                return rank
        return None

    def died(self) -> tuple[int, int] | None:
        """A watched rank its sidecar saw exit, and its exit code."""
        for rank in self.watched:
            if self.store.check([died_key(rank)]):
                return rank, int(self.store.get(died_key(rank)))
        return None


def wait_for_remote(beats: Heartbeats, layout: RankLayout, timeout: float) -> None:
    """Block until every rank of other hosts has said it is alive (a Python loop, so Ctrl+C
    stops it), saying what it waits for; `HostsError` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    told = 0.0
    while True:
        missing = sorted(set(beats.watched) - set(beats.joined()))
        if not missing:
            return
        now = time.monotonic()
        if now > deadline:
            raise HostsError(
                f"rank(s) {', '.join(map(str, missing))} of this client never joined at "
                f"{layout.main_host}:{layout.port} within {timeout:.0f} s: start "
                f"`psyche-client sidecar --main-host {layout.main_host} --world-size "
                f"{layout.world_size} --start-rank {missing[0]}` on their host"
            )
        if now - told > 30.0:
            log.info(
                "waiting for rank(s) %s of this client to join from other hosts at %s:%d",
                ", ".join(map(str, missing)),
                layout.main_host,
                layout.port,
            )
            told = now
        time.sleep(0.2)


__all__ = [
    "BEAT_SECS",
    "LAYOUT_KEY",
    "SILENCE_SECS",
    "HeartbeatSettings",
    "Heartbeats",
    "HostsError",
    "alive_key",
    "connect_store",
    "died_key",
    "interface_of",
    "open_store",
    "read_layout",
    "use_interface_towards",
    "wait_for_remote",
]
