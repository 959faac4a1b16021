"""Where a cold model fetch's time goes, from timestamps in the joiner and in each provider.

One joiner (this process) and 3 providers (a process each, as `network.py --only
model-processes` starts them, model serialized ahead) on 127.0.0.1; each run starts fresh
providers and fetches the model twice: cold (new connections) and warm. Timestamps are
CLOCK_MONOTONIC (`time.perf_counter`, shared by the processes), written around the methods that
make up a connection's set-up and the model-sharing answers (wrapped here, in this benchmark's
processes only):

* joiner: each dial's end, the configuration's ticket asked and answered, the ticket batches;
* the provider that answers the configuration: the connection up (`_on_connected`), the set-up
  it runs then (py-libp2p's identify, GossipSub's new peer, our RTT probe and address-record
  exchange, the joiner's record exchange served), each inbound stream's arrival, and the
  configuration's handler (after the stream's protocol negotiation, or its side-channel
  answer, `SideChannelAnswers.config`, where the sources have it) and answer.

Printed per run, in ms from the dial's end to that provider: when the configuration's stream
arrived, when its handler ran, when it was answered, when the set-up ended; and the joiner's
configuration round trip cold and warm; then, from the cold fetch's start, when the joiner's
dials ended, its configuration request and its first ticket batch. Run it on another
checkout's packages (`PYTHONPATH=<their src directories>`, the providers inherit it) to
compare two versions in one sitting. Bounded: `--runs` (default 3), each fetch within 120 s;
the providers are stopped whatever happens. The machine's load average is printed (other work
shares the cores: compare runs of one sitting).

Run: .venv/bin/python scripts/bench/network_trace.py [--runs 3] [--millions 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import network as bench

Marks = list[tuple[str, float]]
MARKS: Marks = []


def _mark(what: str) -> None:
    MARKS.append((what, time.perf_counter()))


def _around(cls: Any, name: str, tag: str) -> None:
    """Mark the start and end of `cls.name` (a coroutine method; none in sources without it,
    for a run on an older checkout's packages)."""
    fn = getattr(cls, name, None)
    if fn is None:
        return

    @functools.wraps(fn)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        _mark(f"{tag} start")
        try:
            return await fn(*args, **kwargs)
        finally:
            _mark(f"{tag} end")

    setattr(cls, name, wrapped)


def _trace_provider() -> None:
    from libp2p.host.basic_host import BasicHost
    from libp2p.pubsub.pubsub import Pubsub

    from psyche.network.connection import NetworkConnection

    connected = NetworkConnection._on_connected

    def on_connected(self: NetworkConnection, peer: bytes, remote_addr: str) -> None:
        _mark("connected")
        connected(self, peer, remote_addr)

    NetworkConnection._on_connected = on_connected  # type: ignore[method-assign]
    from psyche.network import model_sharing

    side = getattr(model_sharing, "SideChannelAnswers", None)  # not in older sources
    if side is not None:
        _around(side, "config", "config")  # the configuration asked on the side channel
    for cls, name, tag in (
        (NetworkConnection, "_probe_rtt", "rtt probe"),
        (NetworkConnection, "_exchange_records", "records"),
        (NetworkConnection, "_serve_peer_exchange", "records served"),
        (NetworkConnection, "_serve_model_sharing_versioned", "config"),
        (BasicHost, "_identify_peer", "identify"),
        (BasicHost, "_swarm_stream_handler", "inbound stream"),
        (Pubsub, "_handle_new_peer", "gossip peer"),
    ):
        _around(cls, name, tag)


def _trace_joiner() -> None:
    from psyche.network.connection import NetworkConnection

    _around(NetworkConnection, "connect", "dial")
    _around(NetworkConnection, "request_model_blob_ticket", "config ticket")
    _around(NetworkConnection, "request_model_blob_tickets", "ticket batch")


def _first(marks: Marks, what: str, after: float = -1.0) -> float | None:
    return next((t for w, t in marks if w == what and t >= after), None)


def _last(marks: Marks, what: str) -> float | None:
    times = [t for w, t in marks if w == what]
    return max(times) if times else None


def _ms(t: float | None, origin: float) -> str:
    return "   -" if t is None else f"{(t - origin) * 1e3:4.0f}"


async def one_run(millions: int, workdir: Path) -> str:
    from psyche.core.identity import SecretKey
    from psyche.network.model_download import ModelDownload
    from psyche.network.testing import open_nodes

    joiner_key = SecretKey.generate()
    keys = [SecretKey.generate() for _ in range(3)]
    outputs = [workdir / f"provider{i}.json" for i in range(3)]
    providers = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--provider",
                str(millions),
                k.to_bytes().hex(),
                joiner_key.public_key.hex(),
                str(out),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k, out in zip(keys, outputs, strict=True)
    ]
    try:
        records = [
            bytes.fromhex(await trio.to_thread.run_sync(p.stdout.readline))  # type: ignore[union-attr]
            for p in providers
        ]
        await trio.sleep(1.0)  # the providers serialize ahead
        MARKS.clear()
        async with open_nodes(
            1, keys=[joiner_key], allow_each_other=False, model_codec=bench.tensor_codec()
        ) as (joiner,):
            joiner.set_allowed_peers([k.public_key for k in keys])
            for record in records:
                joiner.address_book.add_record(record)
            ids = [k.public_key for k in keys]
            with trio.fail_after(120):
                start = time.perf_counter()
                await ModelDownload(joiner, ids).run()
                cold = time.perf_counter() - start
                joiner.store.delete_prefix("model-")
                joiner.store.gc()
                warm_from = time.perf_counter()
                await ModelDownload(joiner, ids).run()
                warm = time.perf_counter() - warm_from
    finally:
        bench.stop_providers(providers)
    joiner_marks = list(MARKS)
    asked = _first(joiner_marks, "config ticket start")
    answered = _first(joiner_marks, "config ticket end")
    warm_asked = _first(joiner_marks, "config ticket start", warm_from)
    warm_answered = _first(joiner_marks, "config ticket end", warm_from)
    assert asked is not None
    assert answered is not None
    assert warm_asked is not None
    assert warm_answered is not None
    # the provider that answered the configuration
    traces = [json.loads(out.read_text()) for out in outputs]
    served = [m for m in traces if _first(m, "config start") is not None]
    marks: Marks = [(w, t) for w, t in served[0]] if served else []
    up = _first(marks, "connected") or asked
    config_start = _first(marks, "config start")
    setup_end = max(
        (t for t in (_last(marks, f"{s} end") for s in
                     ("identify", "gossip peer", "rtt probe", "records", "records served"))
         if t is not None),
        default=None,
    )  # fmt: skip
    arrived = [t for w, t in marks if w == "inbound stream start" and t <= (config_start or 0)]
    return (
        f"connection up -> config stream in {_ms(max(arrived) if arrived else None, up)} ms, "
        f"handler {_ms(config_start, up)} ms, answered {_ms(_first(marks, 'config end'), up)} ms,"
        f" set-up done {_ms(setup_end, up)} ms | joiner: config round trip cold "
        f"{(answered - asked) * 1e3:4.0f} ms, warm {(warm_answered - warm_asked) * 1e3:4.0f} ms;"
        f" fetch cold {cold * 1e3:5.0f} ms, warm {warm * 1e3:5.0f} ms\n"
        f"       joiner, cold, from the fetch's start: dials done "
        f"{_ms(max((t for w, t in joiner_marks if w == 'dial end' and t < warm_from), default=None), start)}"
        f" ms, config {_ms(asked, start)}-{_ms(answered, start)} ms, first ticket batch "
        f"{_ms(_first(joiner_marks, 'ticket batch start'), start)}-"
        f"{_ms(_first(joiner_marks, 'ticket batch end'), start)} ms"
    )


async def main(runs: int, millions: int) -> None:
    _trace_joiner()
    print(f"cold model fetch traced, {millions}M, 3 provider processes, load "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        for run in range(runs):
            print(f"run {run + 1}: {await one_run(millions, Path(workdir))}", flush=True)


async def provider(millions: int, key: str, joiner: str, out: str) -> None:
    _trace_provider()
    try:
        await bench.serve_model_process(millions, key, joiner, "127.0.0.1")
    finally:
        Path(out).write_text(json.dumps(MARKS))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--millions", type=int, default=20)
    parser.add_argument("--provider", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    bench.logging.basicConfig(level=bench.logging.ERROR)
    bench.logging.getLogger("libp2p").setLevel(bench.logging.CRITICAL)
    if args.provider:
        millions, key, joiner, out = args.provider
        trio.run(provider, int(millions), key, joiner, out)
    else:
        trio.run(main, args.runs, args.millions)
