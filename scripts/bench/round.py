"""Round overhead of the training client: the share of a round that is not its own forward/backward.

Runs a real centralized run on this machine (`psyche-server run` and N `psyche-client train`
processes on loopback, JSON logs) and, for every full training round of every client, measures

* round time: from this round's `round_start` to the next one's (the client's own clock);
* forward/backward (the baseline, measured in the same run): `Trainer.train` minus DisTrO's
  `generate` (lookahead, micro-batches, backward, clipping);
* the rest, itemised where the client times it: apply (round N - 2's results), compress
  (`generate`), serialize + hash; what remains is the network, the witness protocol and waits.

overhead = (round time - forward/backward) / round time; the report gives the median over
rounds and clients. The coordinator's timing is part of every round: the witness phase lasts
`round_witness_time` whole seconds (>= 1 s) and the server ticks every 500 ms, so with a model
that trains in milliseconds (tiny, CPU) the overhead is mostly those waits; the goal (<= 10 %)
is for the 20M model on a GPU, where training dominates.

Threads (issue 28): each client runs torch on `cores / clients` threads (`--cpu-threads`, as
`psyche-local-testnet` gives them); `--threads default` leaves torch's default (every core, in
every client), `--threads both` runs the two alternately (`--repeats` times each) and prints the
ratio of their median round times. `--busy N` keeps N pure-Python spin loops running beside the
run (a machine with N cores taken), killed at the end.

Run: .venv/bin/python scripts/bench/round.py [--model tiny|20m] [--device cpu|cuda]
     [--clients 3] [--rounds 10] [--batch 8] [--seq-len 128]
     [--threads capped|default|both] [--repeats 1] [--busy 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from psyche.client.setup.cpu_threads import available_cores, threads_per_client

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_run(directory: Path, args: argparse.Namespace) -> None:
    from psyche.centralized.tiny_run import write_tiny_dataset
    from psyche.modeling.configs import llama_config_dict

    model_dir = directory / "model"
    model_dir.mkdir(parents=True)
    shutil.copy(TINY / "model" / "tokenizer.json", model_dir / "tokenizer.json")
    if args.model == "tiny":
        shutil.copy(TINY / "model" / "config.json", model_dir / "config.json")
    else:
        config = llama_config_dict("20m", max_position_embeddings=max(2048, args.seq_len))
        (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_tiny_dataset(
        directory / "data",
        tokenizer_path=TINY / "model" / "tokenizer.json",
        seq_len=args.seq_len,
        min_sequences=args.batch * (args.rounds + 12),
    )
    text = (TINY / "state.toml").read_text()
    overrides = {
        "warmup_time": 30,
        "epoch_time": 3600,
        "total_steps": 10_000,
        "max_round_train_time": args.max_round_train_time,
        "round_witness_time": 1,
        "init_min_clients": args.clients,
        "min_clients": 1,
        "global_batch_size_start": args.batch,
        "global_batch_size_end": args.batch,
        "max_seq_len": args.seq_len,
    }
    for key, value in overrides.items():
        # the first occurrence: [config] (the LR schedule has a total_steps of its own)
        text, count = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
        assert count == 1, key
    text = text.replace("127.0.0.1:20001", f"127.0.0.1:{free_port()}")
    text = text.replace('repo_id = "configs/tiny-cpu/model"', f'repo_id = "{model_dir}"')
    (directory / "state.toml").write_text(text)
    data = (TINY / "data.toml").read_text().replace('"../../data/tiny-cpu"', '"data"')
    data = re.sub(r"(?m)^seq_len = .*$", f"seq_len = {args.seq_len}", data)
    (directory / "data.toml").write_text(data)


def events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):  # a line being written
                out.append(json.loads(line))
    return out


def round_starts(path: Path) -> int:
    return sum(1 for e in events(path) if e.get("message") == "round_start" and e["assigned"])


@contextlib.contextmanager
def busy_cores(count: int, seconds: float) -> Iterator[None]:
    """`count` CPU-bound processes (pure-Python spin loops, each ending after `seconds`)."""
    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


class PortTaken(Exception):
    """The server's port (free when picked) was taken before the server bound it."""


# Another program may take a picked port before the server, started seconds later, binds it
# (busy machines: test workers and benchmarks side by side); the run is started again.
PORT_ATTEMPTS = 3


def run(args: argparse.Namespace, directory: Path, threads: str) -> list[Path]:
    """The run with every client's torch threads `capped` (cores / clients) or at torch's
    `default`; the clients' logs. Started again, in a fresh directory, when its port was
    taken before the server bound it."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return run_once(args, directory / f"attempt-{attempt}", threads)
        except PortTaken as taken:
            print(f"{taken}; starting the run again", file=sys.stderr)
    raise SystemExit(f"the server's port was taken {PORT_ATTEMPTS} times; logs in {directory}")


def run_once(args: argparse.Namespace, directory: Path, threads: str) -> list[Path]:
    directory.mkdir(parents=True)
    write_run(directory, args)
    port = free_port()
    logs = []
    procs: list[subprocess.Popen[bytes]] = []
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CPU_THREADS"):
        base_env.pop(name, None)
    thread_args: list[str] = []
    if threads == "capped":
        thread_args = ["--cpu-threads", str(threads_per_client(available_cores(), args.clients))]

    def start(name: str, argv: list[str], env: dict[str, str]) -> None:
        log = directory / f"{name}.log"
        logs.append(log)
        with open(log, "wb") as out:
            procs.append(
                subprocess.Popen(
                    argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )  # fmt: skip

    try:
        start(
            "server",
            [
                sys.executable, "-m", "psyche.cli.server", "run", "--state",
                str(directory / "state.toml"), "--data-config", str(directory / "data.toml"),
                "--server-port", str(port), "--tui", "false",
            ],
            base_env,
        )  # fmt: skip
        for n in range(1, args.clients + 1):
            start(
                f"client-{n}",
                [
                    sys.executable, "-m", "psyche.cli.client", "train", "--run-id", "tiny-cpu",
                    "--server-addr", f"127.0.0.1:{port}", "--logs", "json", "--device",
                    args.device, "--bind-p2p-interface", "lo",
                    "--micro-batch-size", str(args.micro_batch_size), *thread_args,
                ],
                {**base_env, "RAW_IDENTITY_SECRET_KEY": f"{n:064x}"},
            )  # fmt: skip
        deadline = time.monotonic() + args.timeout
        # rounds 0 and 1 apply nothing: measure from round 2 on, and one round more to close
        wanted = args.rounds + 3
        while round_starts(logs[1]) < wanted:
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out; logs in {directory}")
            for proc, log in zip(procs, logs):
                if proc.poll() is not None:
                    text = log.read_text()
                    if log.name == "server.log" and "is already in use" in text:
                        raise PortTaken(f"the port the server was given was taken ({log})")
                    raise SystemExit(f"{log.name} exited:\n{text[-3000:]}")
            time.sleep(0.5)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return logs[1:]


def measure(client_logs: list[Path], rounds: int) -> list[dict[str, float]]:
    rows = []
    for log in client_logs:
        evs = events(log)
        starts = {e["step"]: e for e in evs if e.get("message") == "round_start"}
        trained: dict[int, list[dict[str, Any]]] = {}
        for e in evs:
            if e.get("message") == "trained_batch":
                trained.setdefault(e["step"], []).append(e)
        applied = {e["step"]: e for e in evs if e.get("message") == "applied_results"}
        steps = sorted(s for s in starts if starts[s]["round"] >= 2 and s + 1 in starts)
        for step in steps[:rounds]:
            batches = trained.get(step)
            if not batches:
                continue
            round_secs = starts[step + 1]["ts"] - starts[step]["ts"]
            train = sum(b["train_secs"] for b in batches)
            generate = sum(b["generate_secs"] for b in batches)
            serialize = sum(b["serialize_secs"] for b in batches)
            apply = applied[step]["apply_secs"] if step in applied else 0.0
            fwd_bwd = train - generate
            rows.append(
                {
                    "round": round_secs,
                    "fwd_bwd": fwd_bwd,
                    "apply": apply,
                    "compress": generate,
                    "serialize": serialize,
                    "rest": round_secs - fwd_bwd - apply - generate - serialize,
                    "overhead": (round_secs - fwd_bwd) / round_secs,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "20m"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="global batch size (sequences)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--max-round-train-time", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--threads", choices=("capped", "default", "both"), default="capped",
                        help="each client's torch threads: cores / clients, torch's default, or "
                        "both alternately")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="runs of each --threads mode")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside the run")
    parser.add_argument("--keep", action="store_true", help="keep the run directory and logs")
    args = parser.parse_args()
    modes = ("capped", "default") if args.threads == "both" else (args.threads,)
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with busy_cores(args.busy, args.timeout * args.repeats * len(modes)):
        for _ in range(args.repeats):
            for mode in modes:
                directory = Path(tempfile.mkdtemp(prefix="psyche-round-bench-"))
                try:
                    results[mode] += measure(run(args, directory, mode), args.rounds)
                finally:
                    if args.keep:
                        print(f"logs ({mode}): {directory}")
                    else:
                        shutil.rmtree(directory, ignore_errors=True)
    for mode, rows in results.items():
        report(args, mode, rows)
    if len(modes) == 2:
        capped, default = (statistics.median(r["round"] for r in results[m]) for m in modes)
        print(
            f"round time, torch's default threads / capped at cores / clients: "
            f"{default:.2f} s / {capped:.2f} s = {default / capped:.2f} "
            f"({available_cores()} cores, {args.clients} clients, {args.busy} busy)"
        )


def report(args: argparse.Namespace, threads: str, rows: list[dict[str, float]]) -> None:
    if not rows:
        raise SystemExit(f"no complete training rounds were measured ({threads} threads)")
    print(
        f"round overhead: {args.model} model, {args.clients} clients, device {args.device}, "
        f"batch {args.batch} x {args.seq_len} tokens, {len(rows)} client-rounds, "
        f"threads {threads}, {args.busy} busy processes"
    )
    print(f"{'':>22}{'median':>10}{'mean':>10}   (seconds per round and client)")
    for key in ("round", "fwd_bwd", "apply", "compress", "serialize", "rest"):
        values = [r[key] for r in rows]
        print(f"{key:>22}{statistics.median(values):>10.4f}{statistics.fmean(values):>10.4f}")
    overhead = [r["overhead"] for r in rows]
    print(
        f"overhead = (round - own fwd/bwd) / round: median {statistics.median(overhead):.3f}, "
        f"min {min(overhead):.3f}, max {max(overhead):.3f}"
    )
    # the client's own work besides the forward/backward, without the protocol's waits
    work = [r["apply"] + r["compress"] + r["serialize"] for r in rows]
    compute = [w / (w + r["fwd_bwd"]) for w, r in zip(work, rows)]
    print(
        "compute overhead = (apply + compress + serialize) / (those + fwd/bwd): "
        f"median {statistics.median(compute):.3f}"
    )


if __name__ == "__main__":
    main()
