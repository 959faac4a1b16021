"""What trackers and evaluations cost a training client's rounds: a real run in one process
(`InProcessServer`, two clients over real libp2p on loopback, the tiny Llama trained on CPU) for
each arm, one after the other in the same invocation:

* `none`: no tracker, no evaluation (the baseline);
* `trackers`: every tracker at once (W&B offline, TensorBoard, a JSONL file, OpenTelemetry
  metrics + traces + logs to an OTLP/HTTP endpoint on loopback), both clients;
* `evals`: client 1 evaluates PIQA, ARC-Easy and HellaSwag (local datasets, 40 documents each)
  between rounds.

Each arm runs `--repeat` times, the arms interleaved, pooled. Per arm, over client 1's rounds
after the first two (warm-up): the mean step interval (the time between the progress lines of
consecutive steps of one epoch; a mean, since rounds last whole coordinator ticks, 1 or 2 s
here, and a median jumps between them), the mean time to train a batch, the run's tokens/s, the time the client loop spent handing each round to
its observers (`on_round`: the trackers' `log`), and with evaluations, how long each round's
training step waited for the evaluation to give the model back (`EvalWorker.stop`).

Run: .venv/bin/python scripts/bench/client_telemetry.py [--steps 14] [--repeat 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))


class Timed:
    """Seconds of each call of `method` on `obj` (wrapped in place)."""

    def __init__(self, obj: Any, method: str) -> None:
        self.seconds: list[float] = []
        inner = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - start)

        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await inner(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - start)

        import inspect

        setattr(obj, method, timed_async if inspect.iscoroutinefunction(inner) else timed)


def eval_rows(count: int) -> dict[tuple[str, str | None], list[dict[str, Any]]]:
    piqa = [
        {"goal": f"Do thing {i}", "sol1": f"Way {i}.", "sol2": f"Other way {i}.", "label": i % 2}
        for i in range(count)
    ]
    arc = [
        {
            "id": f"q{i}",
            "question": f"Which is item {i}?",
            "choices": {"text": [f"a{i}", f"b{i}", f"c{i}", f"d{i}"], "label": list("ABCD")},
            "answerKey": "ABCD"[i % 4],
        }
        for i in range(count)
    ]
    hellaswag = [
        {
            "ind": i,
            "activity_label": "Thing",
            "ctx_a": f"A person does {i}",
            "ctx_b": "then",
            "ctx": f"A person does {i} then",
            "endings": [f"ends {i}", f"stops {i}", f"goes {i}", f"waits {i}"],
            "source_id": "x",
            "split": "validation",
            "split_type": "indomain",
            "label": str(i % 4),
        }
        for i in range(count)
    ]
    return {
        ("ybisk/piqa", "plain_text"): piqa,
        ("allenai/ai2_arc", "ARC-Easy"): arc,
        ("Rowan/hellaswag", None): hellaswag,
    }


def run_arm(arm: str, directory: Path, steps: int, collector_url: str) -> dict[str, Any]:
    import torch
    import trio

    from psyche.client.client import Client
    from psyche.client.observe.evals import EvalSettings
    from psyche.client.round.broadcast import open_network
    from psyche.client.run import _close_all, run_observers
    from psyche.client.setup.init import RunInitConfig
    from psyche.client.setup.options import TrainOptions
    from psyche.client.testing import InProcessServer
    from psyche.core.identity import SecretKey
    from psyche.core.node_identity import NodeIdentity
    from psyche.modeling.configs import llama_config_dict
    from psyche.network.connection import NetworkConfig
    from tests.client.test_in_process_run import RUN_ID, coordinator, write_run
    from tests.modeling.eval_support import write_rows

    torch.set_num_threads(1)
    root = directory / arm
    root.mkdir(parents=True)
    model_dir, data_dir = write_run(root)
    (model_dir / "config.json").write_text(json.dumps(llama_config_dict("tiny", vocab_size=512)))
    shutil.copy(REPO / "configs" / "tiny-cpu" / "model" / "tokenizer.json", model_dir)
    evals_dir = root / "evals"
    for (repo, subset), rows in eval_rows(40).items():
        for split in ("validation", "train", "test"):
            write_rows(evals_dir, repo, subset, split, rows)
    state = coordinator(model_dir, data_dir)
    state.config.total_steps = steps
    server = InProcessServer(state)
    timers: dict[str, Timed] = {}
    clients: dict[int, Client] = {}

    def options(number: int) -> TrainOptions:
        out = root / f"client-{number}"
        kwargs: dict[str, Any] = {}
        if arm == "trackers":
            kwargs = {
                "metrics_jsonl": out / "metrics.jsonl",
                "tensorboard_dir": out / "tb",
                "wandb_project": "bench",
                "oltp_metrics_url": f"{collector_url}/v1/metrics",
                "oltp_tracing_url": f"{collector_url}/v1/traces",
                "oltp_logs_url": f"{collector_url}/v1/logs",
            }
        if arm == "evals" and number == 1:
            kwargs = {"eval_tasks": "piqa,arc_easy,hellaswag", "eval_data_dir": evals_dir}
        return TrainOptions(run_id=RUN_ID, **kwargs)

    async def one(number: int) -> None:
        key = SecretKey.from_bytes(number.to_bytes(32, "big"))
        identity = NodeIdentity.from_single_key(key.public_key)
        opts = options(number)
        observers, closers = run_observers(opts, identity, "psyche-bench-client")
        evals = await trio.to_thread.run_sync(EvalSettings.from_options, opts.evals)
        if number == 1:
            timers["on_round"] = Timed(observers, "on_round")
        config = NetworkConfig(run_id=RUN_ID, secret_key=key, bind_host="127.0.0.1")
        try:
            async with open_network(config) as network, server.connect(identity, RUN_ID) as b:
                client = Client(
                    b, network, RunInitConfig(identity, key, RUN_ID, device="cpu"),
                    observers=observers, evals=evals,
                )  # fmt: skip
                clients[number] = client
                await client.run()
        finally:
            _close_all(closers)

    async def watch_evals() -> None:
        while 1 not in clients or clients[1].machine is None:
            await trio.sleep(0.05)
        worker = clients[1].machine.evals
        if worker is not None:
            timers["stop"] = Timed(worker, "stop")

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            nursery.start_soon(watch_evals)
            with trio.fail_after(60 + 10 * steps):
                async with trio.open_nursery() as both:
                    both.start_soon(one, 1)
                    both.start_soon(one, 2)
            nursery.cancel_scope.cancel()

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() in ("client_loss", "trained_batch"):
                records.append(record)

    handler = Keep()
    psyche_log = logging.getLogger("psyche")
    psyche_log.addHandler(handler)
    psyche_log.setLevel(logging.DEBUG)  # the trained_batch events
    psyche_log.propagate = False
    try:
        trio.run(scenario)
    finally:
        logging.getLogger("psyche").removeHandler(handler)
    me = str(clients[1].identity)
    losses = [
        r for r in records if r.getMessage() == "client_loss" and r.psyche_fields["client_id"] == me
    ]
    # consecutive steps of one epoch only (an epoch boundary adds the cooldown and warmup)
    points = [(r.psyche_fields["epoch"], r.psyche_fields["step"], r.created) for r in losses][2:]
    intervals = [
        t1 - t0
        for (e0, s0, t0), (e1, s1, t1) in itertools.pairwise(points)
        if e0 == e1 and s1 == s0 + 1
    ]
    trained = [
        r.psyche_fields["train_secs"]
        for r in records
        if r.getMessage() == "trained_batch" and r.psyche_fields["client_id"] == me
    ][2:]
    worker = clients[1].machine.evals if clients[1].machine is not None else None
    return {
        "rounds": len(intervals),
        "step_s": statistics.fmean(intervals) if intervals else float("nan"),
        "train_s": statistics.fmean(trained) if trained else float("nan"),
        "tokens_per_s": clients[1].machine.progress.tokens_per_second() or 0.0,
        "on_round_us": [s * 1e6 for s in timers["on_round"].seconds],
        "stop_ms": [s * 1e3 for s in timers["stop"].seconds] if "stop" in timers else [],
        "eval_docs": 0 if worker is None else worker.documents,
        "eval_scores": {} if worker is None else worker.scores(),
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one arm as one: means weighted by rounds, lists joined."""
    rounds = sum(r["rounds"] for r in runs) or 1
    return {
        "rounds": sum(r["rounds"] for r in runs),
        "step_s": sum(r["step_s"] * r["rounds"] for r in runs) / rounds,
        "train_s": statistics.fmean(r["train_s"] for r in runs),
        "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in runs),
        "on_round_us": [x for r in runs for x in r["on_round_us"]],
        "stop_ms": [x for r in runs for x in r["stop_ms"]],
        "eval_docs": sum(r["eval_docs"] for r in runs),
        "eval_scores": runs[-1]["eval_scores"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--arms", default="none,trackers,evals")
    parser.add_argument(
        "--repeat", type=int, default=2, help="runs of each arm, interleaved (pooled)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from trackers import DiscardingCollector

    from psyche.client.setup.model_loading import preload_modeling

    preload_modeling()
    for var in ("WANDB_API_KEY",):
        os.environ.pop(var, None)
    with tempfile.TemporaryDirectory(prefix="psyche-bench-client-telemetry-") as tmp:
        directory = Path(tmp)
        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_DIR"] = str(directory)
        os.environ["WANDB_CONFIG_DIR"] = str(directory / "wandb-config")
        os.environ["WANDB_CACHE_DIR"] = str(directory / "wandb-cache")
        collector = DiscardingCollector()
        runs: dict[str, list[dict[str, Any]]] = {}
        try:
            for repeat in range(args.repeat):
                for arm in args.arms.split(","):
                    run = run_arm(arm, directory / str(repeat), args.steps, collector.url)
                    runs.setdefault(arm, []).append(run)
        finally:
            collector.close()
    results = {arm: pooled(r) for arm, r in runs.items()}
    load = os.getloadavg()[0]
    print(f"# client rounds: tiny Llama, 2 in-process clients, CPU, load {load:.1f}")
    print(
        "arm        rounds  step s  train s  tok/s*  ratio   on_round us (median / max)"
        "  stop ms (median/max)"
    )
    base = results.get("none")
    for arm, r in results.items():
        # throughput ratio: the baseline's mean step over this arm's (same tokens per step)
        ratio = base["step_s"] / r["step_s"] if base else 1.0
        on_round = r["on_round_us"] or [0.0]
        stops = r["stop_ms"]
        stop = f"{statistics.median(stops):.1f}/{max(stops):.1f}" if stops else "-"
        print(
            f"{arm:<10} {r['rounds']:>6} {r['step_s']:7.3f} {r['train_s']:8.4f} "
            f"{r['tokens_per_s']:7.0f} {ratio:7.3f} "
            f"{statistics.median(on_round):12.0f} / {max(on_round):8.0f}   {stop}"
        )
    print(
        "step s: mean interval between consecutive steps of one epoch; train s: mean per batch;"
        " * tok/s: the run's tokens over the time from "
        "this client's first to last step (epoch boundaries included)"
    )
    if "evals" in results:
        r = results["evals"]
        print(f"evals: {r['eval_docs']} documents scored between rounds; scores {r['eval_scores']}")


if __name__ == "__main__":
    main()
