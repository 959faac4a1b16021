"""DisTrO benchmarks: payload size, optimizer share of the step, trainer speed, convergence.

Every figure is a ratio against a baseline measured in the same run:

1. bytes  - a DisTrO payload against a dense bf16 gradient of the same model, for chunk 64 with
            top-k 8 (the documented setting) and top-k 4 (Consilience), both 1-bit; the real
            postcard payload size is checked against the formula.
2. time   - DisTrO generate + apply (+ lookahead) as a fraction of the whole train step.
3. trainer- Trainer tokens/s against a plain PyTorch loop (same model, batch, AdamW).
4. converge - loss after the same tokens, DisTrO against AdamW (each at its best LR of a sweep).
5. fastpath - DisTrO generate+apply now, and on the sparse route (`Distro(sparse=True)`),
            against the frozen pre-optimisation code (tests/modeling/distro_reference.py:
            upstream's op order, the DeMo baseline), same run, same inputs: CPU-time ratios,
            whether every payload byte, parameter bit and momentum bit of the default route came
            out identical, whether two sparse instances agree bit for bit, and the share of
            weights the sparse route steps with another sign than the default route.

`--only profile` prints torch.profiler tables of generate and apply instead (by device and host
time): where the optimizer's share of the step goes.

    .venv/bin/python scripts/bench/distro.py --threads 1        # CPU, tiny model
    .venv/bin/python scripts/bench/distro.py --only fastpath --sizes tiny,20m --threads 1
    .venv/bin/python scripts/bench/distro.py --device cuda --sizes 20m,1b \
        --seq 2048 --batch 16 --micro-batch 4 --converge-size 20m   # realistic GPU steps

No downloads: models are random-init Llama configs (`psyche.modeling.configs`), data is a
synthetic bigram corpus.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import (
    AdamW,
    ConstantLR,
    CosineLR,
    Distro,
    LearningRateSchedule,
    OptimizerDefinition,
)
from psyche.core.serde import encode_varint
from psyche.modeling.causal_lm import CausalLM, ModelOptions
from psyche.modeling.configs import llama_config_dict
from psyche.modeling.distro import Distro as DistroOptimizer
from psyche.modeling.distro import ResultLayout, quantize_results, result_layouts, sorted_variables
from psyche.modeling.serialized_distro import transmittable_distro_result
from psyche.modeling.trainer import Batch, Trainer

# -- helpers --------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def constant(lr: float) -> LearningRateSchedule:
    return LearningRateSchedule.Constant(ConstantLR(base_lr=lr, warmup_init_lr=0.0, warmup_steps=0))


def distro_def(chunk: int, topk: int, clip: float | None = 1.0) -> OptimizerDefinition:
    return OptimizerDefinition.Distro(
        Distro(
            clip_grad_norm=clip,
            weight_decay=0.0,
            compression_decay=0.999,
            compression_topk=topk,
            compression_chunk=chunk,
            quantize_1bit=True,
        )
    )


def adamw_def() -> OptimizerDefinition:
    return OptimizerDefinition.AdamW(
        AdamW(betas=[0.9, 0.95], weight_decay=0.0, eps=1e-8, clip_grad_norm=1.0)
    )


def bigram_corpus(n: int, seq_len: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 2), generator=torch.Generator().manual_seed(0))
    x = torch.empty(n, seq_len, dtype=torch.int64)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, seq_len):
        x[:, t] = successors[x[:, t - 1], torch.randint(0, 2, (n,), generator=g)]
    return x


def build(size: str, device: str, dtype: str | None = None, seed: int = 1337) -> CausalLM:
    options = ModelOptions(architecture="HfLlama", device=device, dtype=dtype, seed=seed)
    return CausalLM.from_config(llama_config_dict(size), options)


def varint_len(v: int) -> int:
    out = bytearray()
    encode_varint(v, out)
    return len(out)


def payload_formula(layouts: list[ResultLayout], header: tuple[int, ...]) -> tuple[int, int]:
    """(postcard payload bytes, raw idx+bit bytes) predicted from the layouts alone."""
    total = sum(varint_len(v) for v in header) + varint_len(len(layouts))
    raw_total = 0
    for lay in layouts:
        nblocks = math.prod(lay.block_shape)
        idx_b = nblocks * lay.topk * lay.index_bytes
        val_b = math.ceil(nblocks * lay.topk / 8)
        raw_total += idx_b + val_b
        for dims, nbytes in ((lay.idx_shape, idx_b), (lay.val_shape, val_b)):
            total += varint_len(len(dims)) + sum(varint_len(2 * d) for d in dims)
            total += 3 + varint_len(nbytes) + nbytes
        total += varint_len(len(lay.xshape)) + sum(varint_len(d) for d in lay.xshape)
        total += varint_len(lay.totalk)
    return total, raw_total


# -- 1. bytes -----------------------------------------------------------------------------------


def bench_bytes(sizes: list[str]) -> None:
    print("\n## 1. Bytes per step: 1-bit DisTrO payload vs dense bf16 gradient (chunk 64)")
    print(
        f"{'model':>6} {'top-k':>5} {'params':>12} {'dense bf16 B':>14} {'payload B':>11} "
        f"{'ratio':>8} {'raw-data ratio':>14} {'formula':>8}"
    )
    for topk in (8, 4):
        block_ratio = (64 * 64 * 2) / (topk * 2 + topk / 8)
        print(
            f"   ideal 64x64 block, top-k {topk}: 8192 B / {topk * 2 + topk / 8} B = {block_ratio:.2f}x"
        )
    for size in sizes:
        for topk in (8, 4):
            real = size != "1b"  # the 1b payload is computed from shapes (meta tensors) on CPU
            if real:
                model = build(size, "cpu", "bf16")
                params = model.variables()
            else:
                with torch.device("meta"):
                    from transformers import AutoConfig, AutoModelForCausalLM

                    cfg = llama_config_dict(size)
                    mt = cfg.pop("model_type")
                    hf = AutoModelForCausalLM.from_config(
                        AutoConfig.for_model(mt, **cfg), dtype=torch.bfloat16
                    )
                params = list(hf.named_parameters())
            numel = sum(p.numel() for _, p in params)
            dense = numel * 2
            header = (1000, 7, 256000, 256255)
            if real:
                distro = DistroOptimizer(params, 0.999, 64, topk)
                g = torch.Generator().manual_seed(0)
                for _, p in params:
                    p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
                sent = quantize_results(distro.generate([], 0.0, 1e-3))
                payload = transmittable_distro_result(
                    sent, header[0], header[1], BatchId(header[2], header[3])
                )
                blob = len(payload.to_bytes())
                raw = sum(
                    len(r.sparse_idx.raw_tensor_data()) + len(r.sparse_val.raw_tensor_data())
                    for r in payload.distro_results
                )
                predicted, predicted_raw = payload_formula(distro.layouts(), header)
                check = "ok" if (blob, raw) == (predicted, predicted_raw) else "MISMATCH"
            else:
                shapes = [(n, tuple(p.shape), p.dtype) for n, p in sorted_variables(params)]
                blob, raw = payload_formula(result_layouts(shapes, 64, topk), header)
                check = "shapes"
            print(
                f"{size:>6} {topk:>5} {numel:>12,} {dense:>14,} {blob:>11,} "
                f"{dense / blob:>7.2f}x {dense / raw:>13.2f}x {check:>8}"
            )


# -- 2. time share ------------------------------------------------------------------------------


class Timed:
    """Wraps a bound method and accumulates its wall time (synchronising CUDA)."""

    def __init__(self, fn: Callable, device: torch.device) -> None:  # type: ignore[type-arg]
        self.fn, self.device, self.total = fn, device, 0.0

    def __call__(self, *a, **k):  # type: ignore[no-untyped-def]
        sync(self.device)
        t = time.perf_counter()
        out = self.fn(*a, **k)
        sync(self.device)
        self.total += time.perf_counter() - t
        return out


def measure_distro_share(
    size: str, device: str, steps: int, batch: int, seq: int, mbs: int
) -> tuple[float, float]:
    """(mean train step ms, DisTrO generate + apply + error-correction ms per step) of the
    client's step: `Trainer.train` on one batch, then `optimize` with the previous step's own
    quantized result (as a one-client round applies), after two warm-up steps. Also used by
    scripts/gpu.py."""
    model = build(size, device)
    dev = model.device
    vocab = model.config.vocab_size
    data = bigram_corpus((steps + 2) * batch, seq, vocab).to(dev)
    trainer = Trainer(model, constant(1e-3), distro_def(64, 8), micro_batch_size=mbs)
    assert trainer.distro is not None
    timers = {
        name: Timed(getattr(trainer.distro, name), dev)
        for name in ("generate", "apply", "error_correction")
    }
    for name, timer in timers.items():
        setattr(trainer.distro, name, timer)
    prev: list = []  # type: ignore[type-arg]
    step_times = []
    for step in range(1, steps + 3):
        if step == 3:  # two warm-up steps
            for timer in timers.values():
                timer.total = 0.0
        sync(dev)
        t = time.perf_counter()
        out = trainer.train(
            step, Batch(data[(step - 1) * batch : step * batch]), prev_self_distro_results=prev
        )
        if step > 1:
            trainer.optimize(step, distro_results=[quantize_results(prev[0])])
        sync(dev)
        if step >= 3:
            step_times.append(time.perf_counter() - t)
        prev = [out.distro_results]
    step_ms = statistics.mean(step_times) * 1e3
    distro_ms = sum(t.total for t in timers.values()) / steps * 1e3
    del trainer, model, prev, out
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return step_ms, distro_ms


def profile_distro(size: str, device: str, batch: int, seq: int, mbs: int, rows: int = 30) -> str:
    """torch.profiler tables of DisTrO's generate and apply alone (one step each, after a warm-up
    step), sorted by device time and by host time: where the optimizer's share goes."""
    from torch.profiler import ProfilerActivity, profile

    model = build(size, device)
    dev = model.device
    data = bigram_corpus(3 * batch, seq, model.config.vocab_size).to(dev)
    trainer = Trainer(model, constant(1e-3), distro_def(64, 8), micro_batch_size=mbs)
    assert trainer.distro is not None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    out = trainer.train(1, Batch(data[:batch]), prev_self_distro_results=[])
    trainer.optimize(2, distro_results=[quantize_results(out.distro_results)])
    prev = [out.distro_results]
    trainer.train(2, Batch(data[batch : 2 * batch]), prev_self_distro_results=prev)  # fills grads
    sections = []
    distro = trainer.distro
    for name, fn in (
        ("generate", lambda: distro.generate(prev, 1e-3, 1e-3)),
        ("apply", lambda: distro.apply([quantize_results(prev[0])], 1e-3)),
    ):
        sync(dev)
        with profile(activities=activities) as prof:
            fn()
            sync(dev)
        averages = prof.key_averages()
        for key in (["self_cuda_time_total"] if dev.type == "cuda" else []) + [
            "self_cpu_time_total"
        ]:
            sections.append(f"### {name}, {size}, sorted by {key}\n")
            sections.append(averages.table(sort_by=key, row_limit=rows, max_name_column_width=60))
    del trainer, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return "\n".join(sections)


def bench_time(sizes: list[str], device: str, steps: int, batch: int, seq: int, mbs: int) -> None:
    print("\n## 2. DisTrO generate+apply share of the train step (chunk 64, top-k 8, 1-bit)")
    print(f"{'model':>6} {'device':>6} {'step ms':>9} {'distro ms':>10} {'share':>7}")
    for size in sizes:
        step_ms, distro_ms = measure_distro_share(size, device, steps, batch, seq, mbs)
        print(
            f"{size:>6} {torch.device(device).type:>6} {step_ms:>9.1f} {distro_ms:>10.1f} "
            f"{distro_ms / step_ms:>6.1%}"
        )


# -- 3. trainer vs plain loop -----------------------------------------------------------------


def bench_trainer(
    size: str, device: str, steps: int, batch: int, seq: int, mbs: int, reps: int
) -> None:
    print("\n## 3. Trainer tokens/s vs a plain PyTorch loop (AdamW, same model and batches)")
    plain_model = build(size, device)
    trainer_model = build(size, device)
    dev = plain_model.device
    data = bigram_corpus(steps * batch, seq, plain_model.config.vocab_size).to(dev)
    n_micro = math.ceil(batch / mbs)

    hf = plain_model.model
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def plain_run() -> float:
        sync(dev)
        t = time.perf_counter()
        for step in range(steps):
            rows = data[step * batch : (step + 1) * batch]
            opt.zero_grad(set_to_none=False)
            for chunk in torch.chunk(rows, n_micro):
                loss = hf(chunk, labels=chunk, use_cache=False).loss / n_micro
                loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            opt.step()
        sync(dev)
        return time.perf_counter() - t

    trainer = Trainer(trainer_model, constant(1e-3), adamw_def(), micro_batch_size=mbs)

    def trainer_run() -> float:
        sync(dev)
        t = time.perf_counter()
        for step in range(steps):
            trainer.train(step + 1, Batch(data[step * batch : (step + 1) * batch]))
            trainer.optimize(step + 1)
        sync(dev)
        return time.perf_counter() - t

    plain_run()
    trainer_run()  # warm-up
    plain_times, trainer_times = [], []
    for _ in range(reps):  # interleaved, so drift in machine load hits both alike
        plain_times.append(plain_run())
        trainer_times.append(trainer_run())
    tokens = steps * batch * seq
    plain_tps = tokens / statistics.median(plain_times)
    trainer_tps = tokens / statistics.median(trainer_times)
    print(
        f"model {size} on {dev.type}: batch {batch}x{seq}, micro-batch {mbs}, {steps} steps x {reps} reps"
    )
    print(f"  plain loop   {plain_tps:>10.0f} tokens/s (median)")
    print(f"  Trainer      {trainer_tps:>10.0f} tokens/s (median)")
    print(f"  ratio        {trainer_tps / plain_tps:>10.3f}  (goal >= 0.95)")


# -- 4. convergence ---------------------------------------------------------------------------


def _train_losses(
    size: str,
    device: str,
    definition: OptimizerDefinition,
    lr: float,
    data: torch.Tensor,
    batch: int,
    mbs: int,
) -> list[float]:
    model = build(size, device)
    total = len(data) // batch
    # upstream's examples/train schedule: warmup, then cosine to a tenth
    schedule = LearningRateSchedule.Cosine(
        CosineLR(
            base_lr=lr,
            warmup_init_lr=0.0,
            final_lr=lr / 10,
            warmup_steps=total // 10,
            total_steps=total,
        )
    )
    trainer = Trainer(model, schedule, definition, micro_batch_size=mbs)
    is_distro = trainer.distro is not None
    prev: list = []  # type: ignore[type-arg]
    losses = []
    for step in range(1, len(data) // batch + 1):
        rows = Batch(data[(step - 1) * batch : step * batch])
        if is_distro:
            out = trainer.train(step, rows, prev_self_distro_results=prev)
            if step > 1:
                trainer.optimize(step, distro_results=[quantize_results(prev[0])])
            prev = [out.distro_results]
        else:
            out = trainer.train(step, rows)
            trainer.optimize(step)
        losses.append(out.loss)
    return losses


def bench_convergence(size: str, device: str, steps: int, batch: int, seq: int, mbs: int) -> None:
    print("\n## 4. Convergence: loss after the same tokens, DisTrO (1-bit) vs AdamW")
    probe = build(size, "cpu" if device == "auto" else device)
    data = bigram_corpus(steps * batch, seq, probe.config.vocab_size).to(probe.device)
    del probe
    tail = max(1, steps // 10)
    print(
        f"model {size}, {steps} steps of {batch}x{seq} tokens, cosine LR (10% warmup, to lr/10); "
        f"loss = mean of the last {tail} steps"
    )
    print("  (floor of the synthetic bigram corpus is about ln 2 = 0.693 per predicted token)")
    results: dict[str, tuple[float, float]] = {}
    runs = [
        ("AdamW", adamw_def(), (1e-3, 3e-3, 1e-2)),
        ("DisTrO c64 k8", distro_def(64, 8), (3e-3, 1e-2, 3e-2)),
        ("DisTrO c16 k4", distro_def(16, 4), (3e-3, 1e-2, 3e-2)),
    ]
    for name, definition, lrs in runs:
        for lr in lrs:
            losses = _train_losses(size, device, definition, lr, data, batch, mbs)
            final = statistics.mean(losses[-tail:])
            print(f"  {name:<14} lr {lr:<7g} final loss {final:.4f}")
            if name not in results or final < results[name][0]:
                results[name] = (final, lr)
    base, base_lr = results["AdamW"]
    print(f"  best AdamW: {base:.4f} (lr {base_lr:g})")
    for name, (final, lr) in results.items():
        if name != "AdamW":
            print(
                f"  best {name}: {final:.4f} (lr {lr:g}) -> {final / base - 1:+.2%} vs AdamW (goal within 3%)"
            )


# -- 5. fast paths against the frozen reference ------------------------------------------------


def load_reference() -> ModuleType:
    """The pre-optimisation DisTrO code, frozen in the tests (not an installed module)."""
    path = Path(__file__).resolve().parents[2] / "tests" / "modeling" / "distro_reference.py"
    spec = importlib.util.spec_from_file_location("distro_reference", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().contiguous().view(view), b.detach().contiguous().view(view))


def _copy(base: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, torch.nn.Parameter(t.clone())) for n, t in base]


def bench_fastpath(
    sizes: list[str], device: str, dtypes: list[str], steps: int, peers: int
) -> None:
    """Generate + apply of the frozen pre-optimisation code (upstream's op order, the DeMo
    baseline), the live default route (upstream's bits) and the sparse route
    (`SPARSE_ROUTE`), in one process on the same inputs; CPU time of the process (wall time
    too), median over the steps. The default route's bits are checked against the old code's
    every step; the sparse route's against a second, independent sparse instance's (the
    determinism its design claims), and its share of parameters updated with another sign than
    the default route's, from the same state (after each apply, every side's parameters and
    momenta are reset to the default route's, so the states stay the same)."""
    print(
        f"\n## 5. DisTrO generate+apply: old (upstream's ops) vs now vs the sparse route, same "
        f"run (chunk 64, top-k 8, apply of {peers + 1} 1-bit results; median CPU ms over steps)"
    )
    print(
        f"{'model':>6} {'dtype':>5} {'thr':>3} {'steps':>5} {'old ms':>8} {'new ms':>8} "
        f"{'sparse ms':>9} {'new/old':>8} {'sparse/old':>10} {'wall s/o':>8}  bits  "
        f"sparse signs != new"
    )
    ref = load_reference()
    opts = (0.999, 64, 8)
    sides = ("old", "new", "sparse", "sparse2")
    for size in sizes:
        for dtype in dtypes:
            model = build(size, device, dtype)
            dev = model.device
            base = [(n, p.detach().clone()) for n, p in model.variables()]
            del model

            params = {side: _copy(base) for side in sides}
            opt = {
                "old": ref.Distro(params["old"], *opts),
                "new": DistroOptimizer(params["new"], *opts, sparse=False),
                "sparse": DistroOptimizer(params["sparse"], *opts, sparse=True),
                "sparse2": DistroOptimizer(params["sparse2"], *opts, sparse=True),
            }
            peer_params = [_copy(base) for _ in range(peers)]
            peer_opts = [DistroOptimizer(pp, *opts) for pp in peer_params]
            prev: list = []  # type: ignore[type-arg]
            cpu: dict[str, list[float]] = {side: [] for side in sides}
            wall: dict[str, list[float]] = {side: [] for side in sides}
            identical = deterministic = True
            flipped = total = 0
            step = -1
            # step 0 warms up, untimed; small models run more steps (at least 1 s per side)
            while step < steps or (sum(cpu["new"]) < 1.0 and step < 200):
                step += 1
                lr, prev_lr = 1e-3, (1e-3 if step else 0.0)
                g = torch.Generator().manual_seed(step)
                grads = [torch.randn(t.shape, generator=g).to(t.dtype).to(dev) for _, t in base]
                arriving = []  # the other peers' 1-bit results of this round
                for k, (pp, peer) in enumerate(zip(peer_params, peer_opts)):
                    for (_, p), grad in zip(pp, grads):
                        p.grad = grad * (k + 2)
                    arriving.append(quantize_results(peer.generate([], prev_lr, lr)))
                outs = {}
                order = sides if step % 2 else tuple(reversed(sides))  # cancel drift
                for side in order:
                    for (_, p), grad in zip(params[side], grads):
                        p.grad = grad.clone()
                    sync(dev)
                    c, t = time.process_time(), time.perf_counter()
                    out = opt[side].generate([prev] if prev else [], prev_lr, lr)
                    opt[side].apply([quantize_results(out), *arriving], lr)
                    sync(dev)
                    if step:
                        cpu[side].append(time.process_time() - c)
                        wall[side].append(time.perf_counter() - t)
                    outs[side] = out
                payloads = [
                    transmittable_distro_result(
                        quantize_results(outs[side]), step, 7, BatchId(1, 2)
                    )
                    for side in ("old", "new")
                ]
                identical &= payloads[0].to_bytes() == payloads[1].to_bytes()
                identical &= all(
                    _same_bits(a.sparse_val, b.sparse_val)
                    and _same_bits(a.sparse_idx, b.sparse_idx)
                    for a, b in zip(outs["old"], outs["new"])  # unquantized values too
                )
                identical &= all(
                    _same_bits(a, b) for (_, a), (_, b) in zip(params["old"], params["new"])
                )
                identical &= all(
                    _same_bits(a, b) for a, b in zip(opt["old"].deltas, opt["new"].deltas)
                )
                deterministic &= all(
                    _same_bits(a, b) for (_, a), (_, b) in zip(params["sparse"], params["sparse2"])
                ) and all(
                    _same_bits(a, b) for a, b in zip(opt["sparse"].deltas, opt["sparse2"].deltas)
                )
                for (_, a), (_, b) in zip(params["new"], params["sparse"]):
                    flipped += int((a != b).sum())
                    total += a.numel()
                # every side continues from the default route's state (same inputs each step)
                for side in ("sparse", "sparse2"):
                    with torch.no_grad():
                        for (_, a), (_, b) in zip(params[side], params["new"]):
                            a.copy_(b)
                        for a, b in zip(opt[side].deltas, opt["new"].deltas):
                            a.copy_(b)
                prev = outs["new"]
            ms = {side: statistics.median(cpu[side]) * 1e3 for side in sides}
            wall_ratio = statistics.median(wall["sparse"]) / statistics.median(wall["old"])
            bits = ("identical" if identical else "DIFFERENT") + (
                "" if deterministic else " SPARSE-NONDETERMINISTIC"
            )
            print(
                f"{size:>6} {dtype:>5} {torch.get_num_threads():>3} {len(cpu['new']):>5} "
                f"{ms['old']:>8.1f} {ms['new']:>8.1f} {ms['sparse']:>9.1f} "
                f"{ms['new'] / ms['old']:>8.3f} {ms['sparse'] / ms['old']:>10.3f} "
                f"{wall_ratio:>8.3f}  {bits}  {flipped / max(total, 1):.2e}"
            )
            del params, opt, peer_params, peer_opts, prev, outs
            if dev.type == "cuda":
                torch.cuda.empty_cache()


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", default="tiny", help="comma list of tiny, 20m, 1b (time share)")
    p.add_argument("--byte-sizes", default="20m,1b", help="models for the bytes table")
    p.add_argument("--only", default="bytes,time,trainer,converge,fastpath")
    p.add_argument("--fastpath-dtypes", default="fp32,bf16", help="model dtypes for section 5")
    p.add_argument("--fastpath-peers", type=int, default=3, help="other peers' results applied")
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--converge-size", default="tiny")
    p.add_argument("--converge-steps", type=int, default=200)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    sizes = args.sizes.split(",")
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}")
    if "bytes" in only:
        bench_bytes(args.byte_sizes.split(","))
    if "time" in only:
        bench_time(sizes, args.device, args.steps, args.batch, args.seq, args.micro_batch)
    if "trainer" in only:
        bench_trainer(
            sizes[0], args.device, args.steps, args.batch, args.seq, args.micro_batch, args.reps
        )
    if "fastpath" in only:
        bench_fastpath(
            sizes,
            args.device,
            args.fastpath_dtypes.split(","),
            min(args.steps, 7),
            args.fastpath_peers,
        )
    if "profile" in only:  # not in the default set: a table to read, not a figure
        print(profile_distro(sizes[0], args.device, args.batch, args.seq, args.micro_batch))
    if "converge" in only:
        bench_convergence(
            args.converge_size, args.device, args.converge_steps, args.batch, 32, args.micro_batch
        )


if __name__ == "__main__":
    main()
