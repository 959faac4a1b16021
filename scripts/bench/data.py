"""Data provider throughput against a raw read of the same bytes, measured in the same run.

    .venv/bin/python scripts/bench/data.py            # ~1-2 minutes
    .venv/bin/python scripts/bench/data.py --quick    # smaller, for a smoke test

Cases (tokens/s of the provider's `get_samples`, and of the baseline over the very same byte
ranges in the same order; ratio = provider / baseline; passes alternate and the best pass of
each counts, to damp the noise of a shared machine):

* local: LocalDataProvider's batch path (`get_batch`: one int32 [n, seq_len] array per batch) vs
  slicing the same ranges out of an `np.memmap` and widening them to int32 (the tokens' type);
  the lines below it compare the batch path with a plain byte copy instead, and the per-sample
  path (`get_samples`: one `TokenizedData` per sequence, rows of that array) with the baseline.
* http: HttpDataProvider vs plain httpx range GETs of the same ranges (same concurrency), both
  against the package's Range server running in another process.
* tcp: DataProviderTcpClient against the data server (another process) vs a raw socket
  download of the same ranges, one round trip per batch, from a minimal sendfile server
  (another process). The first line is the port's raw-token extension (what Python peers use),
  the last one upstream's varint messages (what Rust peers get).
* shuffle: upstream's seeded shuffle of N sequence pointers vs numpy's own permutation.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import trio

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.identity import SecretKey
from psyche.core.rng import ChaCha8Rng, shuffle_permutation
from psyche.core.token_size import TokenSize
from psyche.data_provider import (
    DataProviderTcpClient,
    FileURLs,
    HttpConfig,
    HttpDataProvider,
    LocalDataProvider,
)

SEED = bytes(range(1, 33))
GOALS = {"local": 0.8, "http": 0.5, "tcp": 0.5}


# ---------------------------------------------------------------------------------------------
# Raw TCP range server (run in a child process). Request: u32 count, then count pairs of u64
# offset and length (big-endian); reply: those bytes of the file, back to back. One round trip per
# batch, as the data server's protocol has.


def serve_raw(path: str, port: int) -> None:
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with open(path, "rb") as f:
                while True:
                    header = self.request.recv(4, socket.MSG_WAITALL)
                    if len(header) < 4:
                        return
                    (count,) = struct.unpack(">I", header)
                    pairs = self.request.recv(16 * count, socket.MSG_WAITALL)
                    for i in range(count):
                        offset, length = struct.unpack_from(">QQ", pairs, 16 * i)
                        self.request.sendfile(f, offset, length)

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    with socketserver.ThreadingTCPServer(("127.0.0.1", port), Handler) as server:
        server.serve_forever()


# ---------------------------------------------------------------------------------------------
# Helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def child(args: list[str], port: int) -> Iterator[None]:
    proc = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args} did not start: {proc.stderr.read().decode()}")
            time.sleep(0.05)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


async def best_of(
    passes: int,
    tokens: int,
    provider: Callable[[], Awaitable[None]],
    raw: Callable[[], Awaitable[None]],
) -> tuple[float, float]:
    """Best tokens/s of each over alternating passes (after one warm-up pass each)."""
    await provider()
    await raw()
    best_provider = best_raw = 0.0
    for _ in range(passes):
        t = time.perf_counter()
        await raw()
        best_raw = max(best_raw, tokens / (time.perf_counter() - t))
        t = time.perf_counter()
        await provider()
        best_provider = max(best_provider, tokens / (time.perf_counter() - t))
    return best_provider, best_raw


def report(name: str, kind: str, provider: float, raw: float) -> None:
    ratio = provider / raw
    goal = GOALS.get(kind)
    verdict = "" if goal is None else f"goal >= {goal:.1f}: {'met' if ratio >= goal else 'NOT met'}"
    print(
        f"{name:<36} {provider / 1e6:>10.1f} {raw / 1e6:>10.1f} {ratio:>7.3f}  {verdict}",
        flush=True,
    )


def pointers(local: LocalDataProvider, batches: list[BatchId]) -> list[list[tuple[int, int]]]:
    """(offset, length) ranges a batch reads, merged where consecutive (as the providers do)."""
    seq_bytes = local.seq_len * local.token_size.num_bytes
    out = []
    for b in batches:
        offsets = local._byte_offset[b.start : b.end + 1]
        if len(offsets) > 1 and (np.diff(offsets) == seq_bytes).all():
            out.append([(int(offsets[0]), seq_bytes * len(offsets))])
        else:
            out.append([(int(o), seq_bytes) for o in offsets])
    return out


# ---------------------------------------------------------------------------------------------
# Cases


async def bench_local(
    path: Path, seq_len: int, batches: list[BatchId], passes: int, size: str
) -> None:
    for shuffle, label in (
        (Shuffle.DontShuffle(), "sequential"),
        (Shuffle.Seeded(SEED), "shuffled"),
    ):
        with LocalDataProvider.new_from_directory(
            path.parent, TokenSize.TwoBytes, seq_len, shuffle
        ) as local:
            await bench_local_case(path, local, batches, passes, f"local {label} {size}")


async def bench_local_case(
    path: Path, local: LocalDataProvider, batches: list[BatchId], passes: int, name: str
) -> None:
    ranges = pointers(local, batches)
    mm = np.memmap(path, dtype="<u2", mode="r")
    tokens = sum(b.end - b.start + 1 for b in batches) * local.seq_len

    async def batch_path() -> None:
        for b in batches:
            await local.get_batch(b)

    async def per_sample() -> None:
        for b in batches:
            await local.get_samples(b)

    async def raw() -> None:
        # The same ranges sliced out of a memmap and widened to the tokens' i32.
        for batch in ranges:
            for offset, length in batch:
                mm[offset // 2 : (offset + length) // 2].astype(np.int32)

    async def raw_bytes() -> None:
        for batch in ranges:
            for offset, length in batch:
                np.array(mm[offset // 2 : (offset + length) // 2])

    ours, baseline = await best_of(passes, tokens, batch_path, raw)
    report(f"{name} (get_batch)", "local", ours, baseline)
    _, copy_only = await best_of(passes, tokens, batch_path, raw_bytes)
    report("  (vs byte copy only)", "info", ours, copy_only)
    samples, baseline = await best_of(passes, tokens, per_sample, raw)
    report("  get_samples (per-sample)", "info", samples, baseline)


async def bench_http(path: Path, seq_len: int, batches: list[BatchId], passes: int) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/{path.name}"
    args = [
        "-m",
        "psyche.data_provider.static_http",
        str(path.parent),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with child(args, port):
        for shuffle, label in (
            (Shuffle.DontShuffle(), "sequential"),
            (Shuffle.Seeded(SEED), "shuffled"),
        ):
            await bench_http_case(path, url, seq_len, shuffle, batches, passes, f"http {label}")


async def bench_http_case(
    path: Path,
    url: str,
    seq_len: int,
    shuffle: Shuffle,
    batches: list[BatchId],
    passes: int,
    name: str,
) -> None:
    config = HttpConfig()
    local = LocalDataProvider.new_from_directory(path.parent, TokenSize.TwoBytes, seq_len, shuffle)
    http = await HttpDataProvider.open(
        lambda c: FileURLs.from_list(c, [url], config), TokenSize.TwoBytes, seq_len, shuffle, config
    )
    # Same batches, same byte ranges: the HTTP provider reserves one token per file, so it may
    # have one sequence fewer; stay inside both.
    use = [b for b in batches if b.end < http.num_sequences()]
    ranges = pointers(local, use)
    local.close()
    tokens = sum(b.end - b.start + 1 for b in use) * seq_len
    raw_client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=config.max_concurrent_requests)
    )
    limiter = trio.CapacityLimiter(config.max_concurrent_requests)

    async def provider() -> None:
        for b in use:
            await http.get_samples(b)

    async def fetch(offset: int, length: int) -> None:
        async with limiter:
            r = await raw_client.get(
                url, headers={"Range": f"bytes={offset}-{offset + length - 1}"}
            )
            assert len(r.content) == length

    async def raw() -> None:
        for batch in ranges:
            async with trio.open_nursery() as nursery:
                for offset, length in batch:
                    nursery.start_soon(fetch, offset, length)

    report(name, "http", *await best_of(passes, tokens, provider, raw))
    await http.aclose()
    await raw_client.aclose()


async def bench_tcp(path: Path, seq_len: int, batches: list[BatchId], passes: int) -> None:
    data_port, raw_port = free_port(), free_port()
    config = path.parent.parent / "data.toml"
    config.write_text(
        f'dir = "{path.parent.name}"\ntoken_size = "TwoBytes"\nseq_len = {seq_len}\n'
        f"shuffle_seed = {list(SEED)}\n"
    )
    local = LocalDataProvider.new_from_directory(
        path.parent, TokenSize.TwoBytes, seq_len, Shuffle.Seeded(SEED)
    )
    ranges = pointers(local, batches)
    tokens = sum(b.end - b.start + 1 for b in batches) * seq_len
    server_args = [
        "-m",
        "psyche.data_provider.server",
        "--data-config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(data_port),
        "--allow-any",
        "--log-level",
        "WARNING",
    ]
    raw_args = [__file__, "--serve-raw", str(path), str(raw_port)]
    with child(server_args, data_port), child(raw_args, raw_port):
        client = await DataProviderTcpClient.connect(f"127.0.0.1:{data_port}", SecretKey.generate())
        stream = await trio.open_tcp_stream("127.0.0.1", raw_port)

        async def provider() -> None:
            for b in batches:
                await client.get_batch(b)

        async def provider_samples() -> None:
            for b in batches:
                await client.get_samples(b)

        async def raw() -> None:
            for batch in ranges:
                request = struct.pack(">I", len(batch)) + b"".join(
                    struct.pack(">QQ", offset, length) for offset, length in batch
                )
                await stream.send_all(request)
                total = sum(length for _, length in batch)
                got = bytearray()
                while len(got) < total:
                    got += await stream.receive_some(total - len(got))

        report("tcp raw tokens (get_batch)", "tcp", *await best_of(passes, tokens, provider, raw))
        assert client.raw_replies is True
        report("  get_samples", "info", *await best_of(passes, tokens, provider_samples, raw))
        # Upstream's messages (what a Rust peer gets): every token a varint.
        client.raw_replies = False
        report("  upstream varint form", "info", *await best_of(passes, tokens, provider, raw))
        await client.aclose()
        await stream.aclose()
    local.close()


def bench_shuffle(n: int) -> None:
    t = time.perf_counter()
    shuffle_permutation(n, ChaCha8Rng(SEED))
    ours = n / (time.perf_counter() - t)
    t = time.perf_counter()
    np.random.default_rng(0).permutation(n)
    numpy = n / (time.perf_counter() - t)
    print(
        f"{f'shuffle {n} pointers':<36} {ours / 1e6:>10.1f} {numpy / 1e6:>10.1f} {ours / numpy:>7.3f}"
        "  (items/s; baseline: numpy permutation)"
    )


async def main(args: argparse.Namespace) -> None:
    seq_len = args.seq_len
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data" / "tokens.ds"
        path.parent.mkdir()
        gen = np.random.default_rng(0)
        gen.integers(0, 32000, args.tokens, dtype=np.uint16).astype("<u2").tofile(path)
        n = args.tokens // seq_len - 1
        span = args.batch
        all_batches = [BatchId(s, s + span - 1) for s in range(0, n - span - 1, span)]
        pick = lambda k: all_batches[: max(1, min(len(all_batches), k))]  # noqa: E731
        print(f"{args.tokens} tokens (2-byte), seq_len {seq_len}, {span} sequences per batch")
        print(f"{'case':<36} {'Mtok/s':>10} {'raw Mtok/s':>10} {'ratio':>7}")
        await bench_local(path, seq_len, pick(len(all_batches)), args.passes, f"{span}/batch")
        big = [BatchId(s, s + 255) for s in range(0, n - 257, 256)]
        await bench_local(path, seq_len, big, args.passes, "256/batch")
        await bench_http(path, seq_len, pick(args.http_batches), args.passes)
        await bench_tcp(path, seq_len, pick(args.tcp_batches), args.passes)
        bench_shuffle(args.shuffle_items)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-raw":
        serve_raw(sys.argv[2], int(sys.argv[3]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--http-batches", type=int, default=128)
    parser.add_argument("--tcp-batches", type=int, default=128)
    parser.add_argument("--shuffle-items", type=int, default=2_000_000)
    parser.add_argument("--quick", action="store_true")
    cli = parser.parse_args()
    if cli.quick:
        cli.tokens, cli.passes, cli.http_batches, cli.tcp_batches = 2 * 1024 * 1024, 2, 16, 16
        cli.shuffle_items = 200_000
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    trio.run(main, cli)
