"""DiLoCo benchmarks: bytes on the wire and loss, against DisTrO and AdamW on the same tokens.

Every figure is a ratio against a baseline measured in the same run:

1. bytes    - one DiLoCo payload (a round: `inner_steps` steps) in each sent form, against a
              dense fp32 gradient and a 1-bit DisTrO payload (one step), for the given model
              sizes; real postcard payloads of a random pseudo-gradient, not formulas.
3. apply    - DiLoCo's outer step on N payloads (decode, mean, momentum, update: the device-exact
              route) against DisTrO's apply of N results, per round and per step.
2. converge - N peers on the same tokens (the synthetic bigram corpus of scripts/bench/distro.py,
              split evenly among the peers): AdamW (one model on the whole batch, which is what
              data-parallel AdamW computes), DisTrO (PeerSimulation) and DiLoCo in each form
              (DilocoPeerSimulation: Psyche's one-round overlap with the lookahead, and for bf16
              also without the lookahead and with the paper's timing), each at the best LR of a
              small sweep; the loss is that of the final shared model on held-out sequences. Bytes per
              token are what one peer sends per token it trains on.

    .venv/bin/python scripts/bench/diloco.py --threads 1
    .venv/bin/python scripts/bench/diloco.py --only bytes --byte-sizes tiny,20m
    .venv/bin/python scripts/bench/diloco.py --device cuda --converge-size 20m --seq 256

No downloads: random-init Llama configs and a synthetic corpus.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import CosineLR, DilocoTransmission, LearningRateSchedule
from psyche.modeling.diloco import DilocoPeerSimulation, DilocoSettings
from psyche.modeling.distro import quantize_results
from psyche.modeling.research import DistroSettings, PeerSimulation
from psyche.modeling.serialized_distro import transmittable_distro_result
from psyche.modeling.trainer import Batch, Trainer

T = DilocoTransmission


def _distro_bench() -> ModuleType:
    """scripts/bench/distro.py: its corpus, model builder and optimizer definitions."""
    path = Path(__file__).with_name("distro.py")
    spec = importlib.util.spec_from_file_location("bench_distro", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


D = _distro_bench()

FORMS: dict[str, DilocoSettings] = {
    "bf16": DilocoSettings(transmission=T.Bf16),
    "int8": DilocoSettings(transmission=T.Int8, compression_chunk=64),
    "sparse c16 k8 2b": DilocoSettings(compression_chunk=16, compression_topk=8, value_bits=2),
    "sparse c16 k16 2b": DilocoSettings(compression_chunk=16, compression_topk=16, value_bits=2),
    "sparse c64 k64 2b": DilocoSettings(compression_chunk=64, compression_topk=64, value_bits=2),
    "sparse c64 k4 2b": DilocoSettings(compression_chunk=64, compression_topk=4, value_bits=2),
}
# outer (lr, momentum, Nesterov): the DiLoCo paper's, a lower momentum, plain averaging, and a
# step a little past the average
OUTER = {
    "0.7/0.9N": (0.7, 0.9, True),
    "0.7/0.5N": (0.7, 0.5, True),
    "1.0/0": (1.0, 0.0, False),
    "1.2/0": (1.2, 0.0, False),
}
ADAMW_LRS = (3e-3, 5e-3, 6e-3, 7e-3, 1e-2)
"""AdamW, the baseline, gets a finer grid than the others: its best is what they are held to."""


def _settings(form: str, inner_steps: int, outer: str = "0.7/0.9N") -> DilocoSettings:
    base = FORMS[form]
    outer_lr, momentum, nesterov = OUTER[outer]
    return DilocoSettings(
        inner_steps=inner_steps,
        transmission=base.transmission,
        value_bits=base.value_bits,
        compression_chunk=base.compression_chunk,
        compression_topk=base.compression_topk,
        outer_lr=outer_lr,
        outer_momentum=momentum,
        nesterov=nesterov,
    )


# -- 1. bytes -----------------------------------------------------------------------------------


def _diloco_payload_bytes(model: torch.nn.Module, settings: DilocoSettings) -> int:
    sim = DilocoPeerSimulation([model], settings, lr=1e-3, through_wire=True)
    diloco = sim.replicas[0].diloco
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in diloco.params:
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    results = diloco.end_round()
    return len(transmittable_distro_result(results, 1, 0, BatchId(0, 0)).to_bytes())


def _distro_payload_bytes(size: str, chunk: int, topk: int) -> int:
    trainer = Trainer(D.build(size, "cpu"), D.constant(1e-3), D.distro_def(chunk, topk), 1)
    data = D.bigram_corpus(1, 16, trainer.model.config.vocab_size)
    out = trainer.train(1, Batch(data), prev_self_distro_results=[])
    sent = quantize_results(out.distro_results)
    return len(transmittable_distro_result(sent, 1, 0, BatchId(0, 0)).to_bytes())


def bench_bytes(sizes: list[str], inner_steps: int) -> None:
    print(
        f"\n## 1. Bytes: a DiLoCo round ({inner_steps} inner steps) vs one step of dense fp32 / DisTrO"
    )
    for size in sizes:
        model = D.build(size, "cpu")
        n = sum(p.numel() for _, p in model.variables())
        fp32 = 4 * n
        distro = _distro_payload_bytes(size, 64, 8)
        print(
            f"model {size}: {n} parameters; dense fp32 gradient {fp32} B; DisTrO c64 k8 1-bit "
            f"payload {distro} B ({fp32 / distro:.1f}x smaller than fp32)"
        )
        print(
            f"  {'form':<18} {'payload B':>11} {'vs fp32':>9} {'vs DisTrO':>10} "
            f"{'per step vs fp32':>17} {'per step vs DisTrO':>19}"
        )
        for form in FORMS:
            fresh = D.build(size, "cpu")
            payload = _diloco_payload_bytes(fresh.model, _settings(form, inner_steps))
            print(
                f"  {form:<18} {payload:>11} {fp32 / payload:>8.1f}x {distro / payload:>9.2f}x "
                f"{fp32 * inner_steps / payload:>16.0f}x {distro * inner_steps / payload:>18.2f}x"
            )


# -- 3. apply time ------------------------------------------------------------------------------


def _median_time(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_apply(size: str, device: str, peers: int, inner_steps: int, reps: int) -> None:
    print(
        f"\n## 3. Apply time: the outer step on {peers} payloads vs DisTrO's apply of {peers} "
        f"results (model {size}, {device})"
    )
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    trainer = Trainer(D.build(size, device), D.constant(1e-3), D.distro_def(64, 8), 1)
    data = D.bigram_corpus(1, 16, trainer.model.config.vocab_size).to(dev)
    out = trainer.train(1, Batch(data), prev_self_distro_results=[])
    results = [quantize_results(out.distro_results)] * peers
    assert trainer.distro is not None
    distro = trainer.distro

    def distro_apply() -> None:
        distro.apply(results, 1e-3)
        sync()

    base = _median_time(distro_apply, reps)
    print(f"  DisTrO c64 k8 1-bit apply: {base * 1000:9.1f} ms per step")
    print(f"  {'form':<18} {'ms per round':>12} {'vs DisTrO':>10} {'per step vs DisTrO':>19}")
    for form in FORMS:
        model = D.build(size, device)
        sim = DilocoPeerSimulation([model.model], _settings(form, inner_steps), lr=1e-3)
        diloco = sim.replicas[0].diloco
        g = torch.Generator().manual_seed(1)
        payloads = []
        for _ in range(peers):
            diloco.begin_round()
            with torch.no_grad():
                for p in diloco.params:
                    p.add_(torch.randn(p.shape, generator=g).to(dev) * 1e-3)
            payloads.append(diloco.end_round())

        def diloco_apply(diloco=diloco, payloads=payloads) -> None:  # type: ignore[no-untyped-def]
            diloco.apply(payloads, 0.7)
            sync()

        took = _median_time(diloco_apply, reps)
        print(
            f"  {form:<18} {took * 1000:12.1f} {took / base:9.2f}x "
            f"{took / inner_steps / base:18.2f}x"
        )


# -- 2. convergence -----------------------------------------------------------------------------


def _schedule(lr: float, total: int) -> LearningRateSchedule:
    return LearningRateSchedule.Cosine(
        CosineLR(
            base_lr=lr,
            warmup_init_lr=0.0,
            final_lr=lr / 10,
            warmup_steps=total // 10,
            total_steps=total,
        )
    )


@torch.no_grad()
def _held_out_loss(model: torch.nn.Module, held_out: torch.Tensor) -> float:
    losses = [float(model(rows, labels=rows, use_cache=False).loss) for rows in held_out.split(16)]
    return statistics.mean(losses)


def _run_adamw(size, device, lr, data, steps, batch, held_out) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    model = D.build(size, device)
    trainer = Trainer(model, _schedule(lr, steps), D.adamw_def(), micro_batch_size=batch)
    for step in range(1, steps + 1):
        trainer.train(step, Batch(data[(step - 1) * batch : step * batch]))
        trainer.optimize(step)
    n = sum(p.numel() for _, p in model.variables())
    return _held_out_loss(model.model, held_out), 4 * n  # bytes per peer per step


def _run_peers(sim, peers, data, steps, batch, per_step_bytes) -> None:  # type: ignore[no-untyped-def]
    share = batch // peers
    for step in range(1, steps + 1):
        sim.zero_grad(step)
        rows = data[(step - 1) * batch : step * batch]
        for i, m in enumerate(sim.models):
            ids = rows[i * share : (i + 1) * share]
            m(ids, labels=ids, use_cache=False).loss.backward()
        sim.step(step)
        if sim.last_payload_bytes:
            per_step_bytes.append(max(sim.last_payload_bytes))


def _run_distro(size, device, lr, data, steps, batch, peers, held_out) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    models = [D.build(size, device).model for _ in range(peers)]
    settings = DistroSettings(compression_chunk=16, compression_topk=4, clip_grad_norm=1.0)
    sim = PeerSimulation(models, settings, lr=_schedule(lr, steps), through_wire=True)
    sizes: list[int] = []
    _run_peers(sim, peers, data, steps, batch, sizes)
    return _held_out_loss(models[0], held_out), float(sizes[-1])


def _run_diloco(
    size, device, form, outer, timing, inner, lr, data, steps, batch, peers, held_out
) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    models = [D.build(size, device).model for _ in range(peers)]
    sim = DilocoPeerSimulation(
        models,
        _settings(form, inner, outer),
        lr=_schedule(lr, steps),
        through_wire=True,
        overlap=timing != "no-overlap",
        lookahead=timing == "",
    )
    sizes: list[int] = []
    _run_peers(sim, peers, data, steps, batch, sizes)
    sim.flush(steps)
    return _held_out_loss(models[0], held_out), sizes[-1] / inner


def bench_convergence(
    size: str,
    device: str,
    steps: int,
    batch: int,
    seq: int,
    peers: int,
    inner: int,
    forms: list[str],
) -> None:
    print(
        f"\n## 2. Convergence: held-out loss after the same tokens, {peers} peers "
        f"(DiLoCo: {inner} inner steps per round)"
    )
    probe = D.build(size, "cpu")
    vocab = probe.config.vocab_size
    data = D.bigram_corpus(steps * batch, seq, vocab).to(device)
    held_out = D.bigram_corpus(64, seq, vocab, seed=99).to(device)
    tokens_per_peer_step = batch // peers * seq
    print(
        f"model {size}, {steps} steps of {batch}x{seq} tokens ({batch // peers} sequences per peer "
        "per step), cosine LR (10% warmup, to lr/10); floor about ln 2 = 0.693"
    )
    results: dict[str, tuple[float, float, float]] = {}

    def record(name: str, lr: float, loss: float, per_step: float, took: float) -> None:
        per_token = per_step / tokens_per_peer_step
        print(
            f"  {name:<36} lr {lr:<7g} loss {loss:.4f}  {per_token:10.1f} B/token  ({took:.0f} s)"
        )
        if name not in results or loss < results[name][0]:
            results[name] = (loss, lr, per_token)

    for lr in ADAMW_LRS:
        t = time.perf_counter()
        loss, per_step = _run_adamw(size, device, lr, data, steps, batch, held_out)
        record("AdamW (dense fp32 grads)", lr, loss, per_step, time.perf_counter() - t)
    for lr in (1e-2, 3e-2):
        t = time.perf_counter()
        loss, per_step = _run_distro(size, device, lr, data, steps, batch, peers, held_out)
        record("DisTrO c16 k4 1-bit", lr, loss, per_step, time.perf_counter() - t)
    # Psyche's timing with the lookahead; for reference (bf16), without the lookahead and with
    # the DiLoCo paper's timing (no overlap)
    runs = [(form, "") for form in forms]
    if "bf16" in forms:
        runs += [("bf16", "no-lookahead"), ("bf16", "no-overlap")]
    for form, timing in runs:
        for outer in OUTER:
            for lr in (3e-3, 1e-2):
                t = time.perf_counter()
                loss, per_step = _run_diloco(
                    size,
                    device,
                    form,
                    outer,
                    timing,
                    inner,
                    lr,
                    data,
                    steps,
                    batch,
                    peers,
                    held_out,
                )
                name = f"DiLoCo {form} {outer} {timing}".rstrip()
                record(name, lr, loss, per_step, time.perf_counter() - t)
    base, _, base_bytes = results["AdamW (dense fp32 grads)"]
    _, _, distro_bytes = results["DisTrO c16 k4 1-bit"]
    print(
        f"\n  {'best of each (inner lr)':<36} {'loss':>7} {'vs AdamW':>9} {'B/token':>10} "
        f"{'vs fp32':>9} {'vs DisTrO':>10}"
    )
    for name, (loss, lr, per_token) in results.items():
        print(
            f"  {name:<36} {loss:7.4f} {loss / base - 1:+8.2%} {per_token:10.1f} "
            f"{base_bytes / per_token:8.1f}x {distro_bytes / per_token:9.2f}x   (lr {lr:g})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", default="bytes,apply,converge")
    p.add_argument("--apply-size", default="20m")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU)")
    p.add_argument("--byte-sizes", default="tiny,20m")
    p.add_argument("--converge-size", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=8)
    p.add_argument(
        "--forms", default="bf16,int8,sparse c16 k16 2b,sparse c16 k8 2b,sparse c64 k4 2b"
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}")
    if "bytes" in only:
        bench_bytes(args.byte_sizes.split(","), args.inner_steps)
    if "apply" in only:
        bench_apply(args.apply_size, args.device, args.peers, args.inner_steps, args.reps)
    if "converge" in only:
        bench_convergence(
            args.converge_size,
            args.device,
            args.steps,
            args.batch,
            args.seq,
            args.peers,
            args.inner_steps,
            args.forms.split(","),
        )


if __name__ == "__main__":
    main()
