"""Tracker overhead per logged step: every tracker on (W&B offline, TensorBoard, JSONL and
OpenTelemetry metrics + traces + logs to a collector on loopback) against none, same run.

Three figures, each with its baseline measured in the same run, arms interleaved so drift in
the machine's load hits both alike:

1. **The caller's cost of `log()`**: the time one `tracker.log(values, step)` call takes on the
   calling thread, values being what a client logs per round (17 keys: upstream's W&B keys, two
   evals, round timings, bytes, peers, the run state). Baseline: the `NoopTracker` a run without
   trackers has. Calls are spaced as steps are (`--gap-ms`), so the sinks' threads write each
   entry between two calls, as in a run.
2. **The sinks' CPU per step**: process CPU time per logged step while every sink writes it
   (their threads' work, which shares the GIL with the training thread), against the same
   spacing with no tracker.
3. **Training tokens/s with all trackers on vs off**: the tiny Llama (psyche.modeling, CPU,
   one torch thread) trained with AdamW, one `log()` per step of the values above, blocks of
   steps alternating (ABBA) between every tracker and none; the median step time of each arm.
   Once per `--seq-len`: the trackers' cost per step is fixed, so its share falls as steps
   grow (a real round is seconds long).

Run: .venv/bin/python scripts/bench/trackers.py [--calls 400] [--gap-ms 5] [--blocks 12]
     [--block-steps 10] [--batch 8] [--seq-len 64,512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from psyche.metrics import (
    NoopTracker,
    ServiceInfo,
    ThreadedTracker,
    Tracker,
    TrackerConfig,
    build_tracker,
    names,
)

SERVICE = ServiceInfo(
    name="psyche-bench", instance_id="bench", run_id="bench", scope="psyche_client"
)


class DiscardingCollector:
    """An OTLP/HTTP endpoint on 127.0.0.1 that reads each post and answers 200 (nothing kept):
    the exporters do their real work, the network is loopback."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            timeout = 10

            def do_POST(self) -> None:
                length = min(int(self.headers.get("Content-Length", "0")), 64 << 20)
                self.rfile.read(length)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def step_values(step: int) -> dict[str, float | int | str]:
    """What a client logs per round (17 keys)."""
    loss = 4.0 / (1 + step / 50)
    return {
        names.TRAIN_LOSS: loss,
        names.TRAIN_PERPLEXITY: 2.718281828**loss,
        names.TRAIN_CONFIDENCE: 1 - loss / 15,
        names.TRAIN_LR: 4e-4,
        names.TRAIN_TOTAL_TOKENS: step * 4096,
        names.TRAIN_TOKENS_PER_SEC: 5000.0 + step,
        names.TRAIN_GLOBAL_TOKEN_BATCH_SIZE: 4096,
        names.TRAIN_EFFICIENCY: 0.93,
        names.COORDINATOR_NUM_CLIENTS: 3,
        names.COORDINATOR_EPOCH: step // 100,
        names.COORDINATOR_ROUND: step,
        names.eval_key("ARC-Easy"): 0.31,
        names.eval_key("Hellaswag"): 0.27,
        names.ROUND_TRAIN_SECONDS: 1.9,
        names.P2P_DOWNLOAD_BYTES: step * 1_000_000,
        names.P2P_PEERS: 2,
        names.COORDINATOR_RUN_STATE: "RoundTrain",
    }


def all_trackers(directory: Path, collector: DiscardingCollector, queue_size: int) -> Tracker:
    config = TrackerConfig(
        wandb_project="psyche-bench",
        wandb_dir=directory,
        tensorboard_dir=directory / "tb",
        metrics_jsonl=directory / "metrics.jsonl",
        oltp_metrics_url=f"{collector.url}/v1/metrics",
        oltp_tracing_url=f"{collector.url}/v1/traces",
        oltp_logs_url=f"{collector.url}/v1/logs",
        oltp_report_interval=1.0,
        queue_size=queue_size,
    )
    tracker = build_tracker(
        config, service=SERVICE, run_name="bench", env={"WANDB_MODE": "offline"}
    )
    # Wait until every sink is open and has written an entry (W&B's init takes seconds), so
    # the measurement sees steady state.
    tracker.log(step_values(0), step=0)
    deadline = time.monotonic() + 120
    threaded = [t for t in tracker.trackers if isinstance(t, ThreadedTracker)]  # type: ignore[attr-defined]
    while any(t.written < 1 and not t.failed for t in threaded):
        if time.monotonic() > deadline:
            raise SystemExit("the trackers did not open within 120 s")
        time.sleep(0.05)
    failed = [t.sink.name for t in threaded if t.failed]
    if failed:
        raise SystemExit(f"trackers failed to start: {failed}")
    return tracker


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_calls(tracker: Tracker, calls: int, gap: float) -> None:
    print("\n## 1-2. log() on the calling thread, and the sinks' CPU per step")
    noop = NoopTracker()
    arms: dict[str, dict[str, list[float]]] = {
        "none": {"call": [], "cpu": []},
        "all": {"call": [], "cpu": []},
    }
    step = 1
    block = 50
    for start in range(0, calls, block):
        for name, target in (("none", noop), ("all", tracker)):
            cpu0 = time.process_time()
            for _ in range(min(block, calls - start)):
                values = step_values(step)
                t0 = time.perf_counter_ns()
                target.log(values, step=step)
                arms[name]["call"].append((time.perf_counter_ns() - t0) / 1000)
                step += 1
                time.sleep(gap)
            time.sleep(gap * 4)  # let the last entry of the block be written
            cpu = time.process_time() - cpu0
            n = min(block, calls - start)
            arms[name]["cpu"].append(cpu / n * 1e6)
    for name in ("none", "all"):
        call = arms[name]["call"]
        print(
            f"  {name:>4}: log() median {statistics.median(call):7.1f} us, p99 {pct(call, 0.99):7.1f} us;"
            f" process CPU {statistics.median(arms[name]['cpu']):7.1f} us per step"
        )
    extra_call = statistics.median(arms["all"]["call"]) - statistics.median(arms["none"]["call"])
    extra_cpu = statistics.median(arms["all"]["cpu"]) - statistics.median(arms["none"]["cpu"])
    print(
        f"  all trackers cost the caller {extra_call:.1f} us per log(), "
        f"and {extra_cpu:.0f} us of CPU per step in all (their threads included)"
    )


def bench_training(
    tracker: Tracker, blocks: int, block_steps: int, batch: int, seq_len: int
) -> None:
    import torch

    from psyche.modeling.causal_lm import CausalLM, ModelOptions
    from psyche.modeling.configs import llama_config_dict

    print("\n## 3. Training tokens/s, all trackers on vs none (tiny Llama, CPU, AdamW)")
    torch.set_num_threads(1)  # one core for training; the trackers' threads get the other
    torch.manual_seed(0)
    model = CausalLM.from_config(
        llama_config_dict("tiny"), ModelOptions(architecture="HfLlama", device="cpu", seed=1)
    ).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    rows = torch.randint(0, vocab, (batch, seq_len))
    noop = NoopTracker()
    step = 0

    def run(target: Tracker) -> list[float]:
        """One block: per-step wall times, the first left out (it may carry the other arm's
        trackers' last writes)."""
        nonlocal step
        times = []
        for _ in range(block_steps + 1):
            t = time.perf_counter()
            loss = model(rows, labels=rows, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            values = step_values(step)
            values[names.TRAIN_LOSS] = float(loss.detach())
            target.log(values, step=step + 1000)
            times.append(time.perf_counter() - t)
            step += 1
        return times[1:]

    run(noop)  # warm-up
    times: dict[str, list[float]] = {"none": [], "all": []}
    for i in range(blocks):  # ABBA order: neither arm always runs first
        order = (("none", noop), ("all", tracker))
        for name, target in order if i % 2 == 0 else reversed(order):
            times[name].extend(run(target))
    tokens = batch * seq_len
    tps = {name: tokens / statistics.median(ts) for name, ts in times.items()}
    print(
        f"  batch {batch}x{seq_len}, {blocks} blocks of {block_steps} steps per arm, "
        f"median step {statistics.median(times['none']) * 1000:.1f} ms (none), "
        f"{statistics.median(times['all']) * 1000:.1f} ms (all)"
    )
    print(f"  none   {tps['none']:>9.0f} tokens/s (median step)")
    print(f"  all    {tps['all']:>9.0f} tokens/s (median step)")
    print(f"  ratio  {tps['all'] / tps['none']:>9.3f}  (all trackers / none)")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--calls", type=int, default=400, help="log() calls per arm")
    p.add_argument("--gap-ms", type=float, default=5.0, help="time between two log() calls")
    p.add_argument("--blocks", type=int, default=12, help="training blocks per arm")
    p.add_argument("--block-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--seq-len",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[64, 512],
        help="comma list: one training comparison per sequence length (longer = slower steps)",
    )
    p.add_argument("--skip-training", action="store_true")
    args = p.parse_args()
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        os.environ.pop(var, None)
    with tempfile.TemporaryDirectory(prefix="psyche-bench-trackers-") as tmp:
        directory = Path(tmp)
        os.environ["WANDB_CONFIG_DIR"] = str(directory / "wandb-config")
        os.environ["WANDB_CACHE_DIR"] = str(directory / "wandb-cache")
        collector = DiscardingCollector()
        tracker = all_trackers(directory, collector, queue_size=4096)
        threaded = [t for t in getattr(tracker, "trackers", []) if isinstance(t, ThreadedTracker)]
        print("# Trackers: W&B (offline), TensorBoard, JSONL, OpenTelemetry metrics+traces+logs")
        try:
            bench_calls(tracker, args.calls, args.gap_ms / 1000)
            if not args.skip_training:
                for seq_len in args.seq_len:
                    bench_training(tracker, args.blocks, args.block_steps, args.batch, seq_len)
        finally:
            t = time.perf_counter()
            tracker.finish(60)
            print(f"\nfinish() with every tracker: {time.perf_counter() - t:.2f} s")
            dropped = [(t.sink.name, t.dropped) for t in threaded if t.dropped]
            print(f"entries dropped: {dropped or 'none'}")
            collector.close()


if __name__ == "__main__":
    main()
