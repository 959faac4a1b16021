"""A client of several ranks against a one-rank client on the same cores: tokens/s of a DisTrO
training step (`train_exact` + `prepare_result` + `optimize` with the step's own result), same
model, same batches, same invocation.

* baseline: one process, one rank, `--threads` torch threads (all the cores the ranks share);
* DP=2 (replicated, gradients all-reduced in fp32), FSDP=2 and TP=2: two processes (gloo),
  `--threads / 2` threads each, driven through the real protocol (`LeaderTrainer` / `serve`).

The ratio is tokens/s against the faster of the one-rank runs (1 thread, or `--threads`); each
figure is the best median of `--repeat` rounds that alternate the layouts. On the CPU the ranks
split the same cores, so the ratio is a correctness-of-overhead figure (what
the collectives, the full-tensor gathers and the duplicated DisTrO compression cost), not a
speed-up: a speed-up needs one device per rank. GPU figures (DP scaling on several GPUs with
NCCL, MFU of a 1B model) need a lent GPU machine: run with `--device cuda` there (one CUDA
device per rank; none was lent while this was written).

Run: .venv/bin/python scripts/bench/parallel.py [--model tiny|20m] [--batch 8] [--seq-len 128]
     [--steps 6] [--threads 2] [--modes dp,fsdp,tp] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build(args: argparse.Namespace, mode: str, rank: int, leader: bool):  # type: ignore[no-untyped-def]
    import torch

    from psyche.core.definitions import (
        ConstantLR,
        Distro,
        LearningRateSchedule,
        OptimizerDefinition,
    )
    from psyche.modeling.causal_lm import CausalLM, ModelOptions
    from psyche.modeling.configs import llama_config_dict
    from psyche.modeling.distributed import LeaderTrainer
    from psyche.modeling.parallel import ParallelDims
    from psyche.modeling.sharding import ShardingOptions, build_mesh, parallelize
    from psyche.modeling.trainer import Trainer

    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
    dims = {
        "single": ParallelDims(device),
        "dp": ParallelDims(device, dp=2, rank=rank),
        "fsdp": ParallelDims(device, dp=2, fsdp=True, rank=rank),
        "tp": ParallelDims(device, tp=2, rank=rank),
    }[mode]
    dims = replace(dims, mesh=build_mesh(dims))
    config = llama_config_dict(args.model, max_position_embeddings=max(64, args.seq_len))
    dtype = "bf16" if device.type == "cuda" else None
    model = CausalLM.from_config(
        config, ModelOptions(architecture="HfLlama", device=str(device), dtype=dtype, seed=1337)
    )
    model = parallelize(model, dims, ShardingOptions())
    optimizer = OptimizerDefinition.Distro(
        Distro(
            clip_grad_norm=1.0,
            weight_decay=0.0,
            compression_decay=0.999,
            compression_topk=8,
            compression_chunk=64,
            quantize_1bit=True,
        )
    )
    schedule = LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0))
    cls = LeaderTrainer if leader else Trainer
    mbs = args.batch if mode == "single" else max(1, args.batch // dims.dp)
    return cls(model, schedule, optimizer, micro_batch_size=mbs, parallel=dims)


def drive(args: argparse.Namespace, trainer) -> list[float]:  # type: ignore[no-untyped-def]
    """Step times (seconds) of `args.steps` steps after one warm-up step."""
    import torch

    from psyche.core.batch_id import BatchId
    from psyche.modeling.trainer import Batch

    vocab = int(trainer.model.config.vocab_size)
    times, prev = [], []
    for step in range(1, args.steps + 2):
        g = torch.Generator().manual_seed(step)
        batch = Batch(torch.randint(0, vocab, (args.batch, args.seq_len), generator=g))
        start = time.perf_counter()
        out = trainer.train_exact(
            step, batch, warmup_lr_between=None, zero_optim=False, prev_self_distro_results=prev
        )
        sent = trainer.prepare_result(out, step=step, batch_id=BatchId(step, step))
        trainer.optimize(step, distro_results=[sent.sent])
        trainer.synchronize()
        if step > 1:
            times.append(time.perf_counter() - start)
        prev = [out.distro_results]
    return times


def rank_main(args: argparse.Namespace) -> None:
    """One rank of a two-rank mode; rank 0 prints the median step time."""
    import torch

    from psyche.modeling.distributed import serve
    from psyche.modeling.sharding import close_world, init_world

    torch.set_num_threads(max(1, args.threads // 2))
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{args.rank}")
    init_world(args.rank, 2, f"file://{args.init}", device)
    trainer = build(args, args.mode, args.rank, leader=args.rank == 0)
    if args.rank == 0:
        times = drive(args, trainer)
        trainer.stop_workers()
        print(f"MEDIAN {statistics.median(times)}", flush=True)
    else:
        serve(trainer)
    close_world()


def two_ranks(args: argparse.Namespace, mode: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        common = [
            sys.executable, __file__, "--mode", mode, "--init", str(Path(tmp) / "init"),
            "--model", args.model, "--batch", str(args.batch), "--seq-len", str(args.seq_len),
            "--steps", str(args.steps), "--threads", str(args.threads), "--device", args.device,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // 2))}
        procs = [
            subprocess.Popen(
                [*common, "--rank", str(r)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    medians = [ln for ln in outs[0].splitlines() if ln.startswith("MEDIAN")]
    if not medians:
        codes = [p.returncode for p in procs]
        raise SystemExit(f"{mode}: ranks exited {codes}:\n" + "\n".join(o[-2000:] for o in outs))
    return float(medians[0].split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "20m", "1b"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--modes", default="dp,fsdp,tp")
    parser.add_argument("--repeat", type=int, default=2, help="rounds; the best median counts")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode is not None:
        rank_main(args)
        return
    import torch

    tokens = args.batch * args.seq_len
    modes = args.modes.split(",")
    best: dict[str, float] = {}
    # rounds alternate the layouts, so a busy machine's load falls on all of them alike
    for _ in range(args.repeat):
        for threads in sorted({1, args.threads}):
            torch.set_num_threads(threads)
            times = drive(args, build(args, "single", 0, leader=False))
            key = f"single{threads}"
            best[key] = min(best.get(key, float("inf")), statistics.median(times))
        for mode in modes:
            best[mode] = min(best.get(mode, float("inf")), two_ranks(args, mode))
    # the faster one-rank figure is the baseline (on a loaded machine, threads can hurt)
    single = min(best[f"single{t}"] for t in {1, args.threads})
    print(
        f"model {args.model}, batch {args.batch} x {args.seq_len} tokens, {args.steps} steps, "
        f"{args.threads} threads in all, device {args.device}; DisTrO chunk 64, top-k 8, 1-bit"
    )
    print(f"{'layout':<16}{'step (ms)':>12}{'tokens/s':>12}{'tok/s ratio':>12}")
    rows = [(f"1 rank, {t} thr", best[f"single{t}"]) for t in sorted({1, args.threads})]
    labels = {"dp": "DP=2", "fsdp": "FSDP=2", "tp": "TP=2"}
    rows += [(labels[m], best[m]) for m in modes]
    for label, median in rows:
        print(f"{label:<16}{median * 1e3:>12.1f}{tokens / median:>12.0f}{single / median:>12.2f}")


if __name__ == "__main__":
    main()
