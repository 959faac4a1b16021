"""One rank of the two-rank determinism scenarios of test_parallel_ranks.py (a script: the test
starts it twice, `python parallel_ranks.py RANK INIT_FILE OUT_DIR [cpu|cuda] [batched]`: gloo on
the CPU, or NCCL with rank r on cuda:r and bf16 parameters; `batched` runs DisTrO's batched route,
the default on CUDA, everywhere).

Rank 0 drives each scenario as a client does and also runs a one-rank reference trainer on the
same batches in the same process; it writes what it found to OUT_DIR/report.pt (and the
checkpoints of each side to OUT_DIR/<mode>/ and OUT_DIR/<mode>-reference/).

* `dp` (replicated DP) and `fsdp` (FSDP2) through the real protocol (`LeaderTrainer` and
  `serve`): train_exact + prepare_result + optimize for four steps (the last with one row, which
  leaves rank 1 a zero-weight micro-batch), payload bytes and parameters compared with the
  reference after every step, then extract and checkpoint files.
* `dp-torchtitan`, `fsdp-torchtitan`: `dp` and `fsdp` with the Torchtitan architecture (when the
  extra is installed; FSDP2 shards torchtitan's transformer blocks, as its `apply_fsdp` does).
* `tp-torchtitan`, `tp-torchtitan-deepseek`: the Torchtitan architecture's llama3 and
  deepseek_v3 at TP=2 with torchtitan's own plan, through the protocol as `dp` (each step's
  results that differ from the reference's listed by parameter name), then `tp`'s exact checks.
* `fsdp4` (its own run, `python parallel_ranks.py RANK INIT_FILE OUT_DIR cpu fsdp4` on four
  ranks): `fsdp` over four ranks, eight rows a step (one micro-batch of two per rank) and DisTrO
  unquantized, so that equal payloads mean equal momentum, hence equal gradients.
* `tp-fsdp-torchtitan`, `tp-fsdp-torchtitan-deepseek` (their own run, `... cpu
  tp-fsdp-torchtitan` on four ranks, three steps): the Torchtitan architecture's llama3 and
  deepseek_v3 at FSDP=2 x TP=2 (torchtitan's TP plan, then FSDP2 over its `fsdp` mesh), as
  `tp-torchtitan` (the protocol, then `tp`'s exact checks).
* `tp` and `tp-deepseek` (DTensor tensor parallelism of the tiny Llama and the tiny
  DeepSeek-V3), both ranks running the same code: the row-parallel matmuls
  sum their halves in another order, so trained gradients are close, not equal; what must be
  exact is checked exactly: given the reference's gradients and momentum, `generate` gives the
  reference's results bit for bit, and applying one aggregate gives the reference's parameters.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import ConstantLR, LearningRateSchedule
from psyche.modeling import distro as distro_module
from psyche.modeling import torchtitan
from psyche.modeling.causal_lm import CausalLM, ModelOptions
from psyche.modeling.checkpoint import save_tensors_into_safetensors
from psyche.modeling.configs import deepseek_config_dict, llama_config_dict
from psyche.modeling.distributed import LeaderTrainer, serve
from psyche.modeling.distro import DistroResult
from psyche.modeling.parallel import ParallelDims
from psyche.modeling.serialized_distro import distro_results_to_bytes
from psyche.modeling.sharding import (
    ShardingOptions,
    build_mesh,
    close_world,
    init_world,
    local_tensor,
    parallelize,
    shard_like,
)
from psyche.modeling.trainer import Batch, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_trainer import distro, make_trainer

DEVICE = "cpu"
ARCHITECTURES = {
    "dp": "HfLlama",
    "fsdp": "HfLlama",
    "tp": "HfLlama",
    "tp-deepseek": "HfDeepseek",
    "dp-torchtitan": "Torchtitan",
    "fsdp-torchtitan": "Torchtitan",
    "tp-torchtitan": "Torchtitan",
    "tp-torchtitan-deepseek": "Torchtitan",
    "fsdp4": "HfLlama",
    "tp-fsdp-torchtitan": "Torchtitan",
    "tp-fsdp-torchtitan-deepseek": "Torchtitan",
}
DEEPSEEK = ("tp-deepseek", "tp-torchtitan-deepseek", "tp-fsdp-torchtitan-deepseek")
"""The modes on the tiny DeepSeek-V3 (the others train the tiny Llama)."""
FOUR_RANKS = {
    "fsdp4": (("fsdp4",), 4),
    "tp-fsdp-torchtitan": (("tp-fsdp-torchtitan", "tp-fsdp-torchtitan-deepseek"), 3),
}
"""The four-rank runs (`python parallel_ranks.py RANK INIT_FILE OUT_DIR cpu RUN`): their
scenarios and steps."""
SEQ = 16
STEPS = 4


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


def batch_for(step: int, mode: str = "") -> Batch:
    """4 rows (1 at the last step; `tp-fsdp-*`: one micro-batch of 2 per DP rank, its TP ranks
    seeing the same rows); `fsdp4`: 8 (one micro-batch of 2 per rank)."""
    rows = 8 if mode == "fsdp4" else 1 if step == STEPS else 4
    g = torch.Generator().manual_seed(step)
    return Batch(torch.randint(0, 256, (rows, SEQ), generator=g))


def rank_device(rank: int) -> torch.device:
    return torch.device("cpu") if DEVICE == "cpu" else torch.device("cuda", rank)


def dims_for(mode: str, rank: int) -> ParallelDims:
    layout: dict = {
        "dp": dict(dp=2),
        "fsdp": dict(dp=2, fsdp=True),
        "tp": dict(tp=2),
        "tp-deepseek": dict(tp=2),
        "dp-torchtitan": dict(dp=2),
        "fsdp-torchtitan": dict(dp=2, fsdp=True),
        "tp-torchtitan": dict(tp=2),
        "tp-torchtitan-deepseek": dict(tp=2),
        "fsdp4": dict(dp=4, fsdp=True),
        "tp-fsdp-torchtitan": dict(dp=2, tp=2, fsdp=True),
        "tp-fsdp-torchtitan-deepseek": dict(dp=2, tp=2, fsdp=True),
    }[mode]
    dims = ParallelDims(rank_device(rank), rank=rank, **layout)
    return replace(dims, mesh=build_mesh(dims))


def rank_trainer(mode: str, rank: int, cls: type[Trainer]) -> Trainer:
    """The tiny trainer's model and settings (seed 1337, micro-batch 2), laid out for `mode`."""
    dims = dims_for(mode, rank)
    # built on the CPU in fp32 (the reference's random draws), then cast and moved
    architecture = ARCHITECTURES[mode]
    options = ModelOptions(architecture=architecture, device="cpu", seed=1337)
    config = deepseek_config_dict() if mode in DEEPSEEK else llama_config_dict("tiny")
    model = CausalLM.from_config(config, options)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    module = model.model if model.dtype == dtype else model.model.to(dtype)
    model = CausalLM(module.to(dims.device), model.architecture)
    model = parallelize(model, dims, ShardingOptions())
    schedule = LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0))
    optimizer = distro(weight_decay=0.01, quantize=mode != "fsdp4")
    return cls(model, schedule, optimizer, micro_batch_size=2, parallel=dims)


def make_reference(
    architecture: str = "HfLlama", deepseek: bool = False, quantize: bool = True
) -> Trainer:
    """The one-rank client (on this rank's device); the tiny DeepSeek-V3 when `deepseek`."""
    if architecture == "Torchtitan" and deepseek:  # make_trainer's DeepSeek is HfDeepseek's
        options = ModelOptions(architecture=architecture, device="cpu", seed=1337)
        model = CausalLM.from_config(deepseek_config_dict(), options)
        schedule = LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0))
        return Trainer(model, schedule, distro(weight_decay=0.01), micro_batch_size=2)
    if DEVICE == "cpu":
        return make_trainer(weight_decay=0.01, quantize=quantize, architecture=architecture)
    trainer = make_trainer(weight_decay=0.01, device="cpu", architecture=architecture)
    model = CausalLM(trainer.model.model.to(torch.bfloat16).to("cuda"), architecture)
    return Trainer(model, trainer.lr_schedule, distro(weight_decay=0.01), micro_batch_size=2)


def protocol_scenario(mode: str, rank: int, out: Path) -> dict:
    if rank != 0:
        serve(rank_trainer(mode, rank, Trainer))
        return {}
    leader = rank_trainer(mode, rank, LeaderTrainer)
    assert isinstance(leader, LeaderTrainer)
    reference = make_reference(ARCHITECTURES[mode], mode in DEEPSEEK, quantize=mode != "fsdp4")
    report: dict = {"payload_equal": [], "params_equal": [], "loss": [], "results_differ": []}
    names = [name for name, _ in reference.model.variables()]
    prev_l: list = []
    prev_r: list = []
    for step in range(1, STEPS + 1):
        batch, batch_id = batch_for(step, mode), BatchId(step * 10, step * 10 + 3)
        kwargs = dict(warmup_lr_between=None, zero_optim=False)
        out_l = leader.train_exact(step, batch, prev_self_distro_results=prev_l, **kwargs)
        out_r = reference.train_exact(step, batch, prev_self_distro_results=prev_r, **kwargs)
        leader.decay_weights(step, warmup_lr_between=None)  # the workers' too (a command)
        reference.decay_weights(step, warmup_lr_between=None)
        sent_l = leader.prepare_result(out_l, step=step, batch_id=batch_id)
        sent_r = reference.prepare_result(out_r, step=step, batch_id=batch_id)
        report["payload_equal"].append(
            sent_l.commitment_hash == sent_r.commitment_hash
            and distro_results_to_bytes(sent_l.payload.distro_results)
            == distro_results_to_bytes(sent_r.payload.distro_results)
        )
        report["loss"].append((out_l.loss, out_r.loss))
        report["results_differ"].append(
            [n for n, a, b in zip(names, sent_l.sent, sent_r.sent) if not same_result(a, b)]
        )
        aggregate = [sent_r.sent, sent_l.sent]
        leader.optimize(step, distro_results=aggregate)
        reference.optimize(step, distro_results=aggregate)
        full = leader.full_variables()
        report["params_equal"].append(
            all(same_bits(full[name], p) for name, p in reference.model.variables())
        )
        prev_l, prev_r = [out_l.distro_results], [out_r.distro_results]
    leader.truncate_bf16()
    reference.truncate_bf16()
    save_tensors_into_safetensors(leader.extract(torch.bfloat16), out / mode)
    save_tensors_into_safetensors(reference.extract(torch.bfloat16), out / f"{mode}-reference")
    leader.stop_workers()
    return report


def same_result(a: DistroResult, b: DistroResult) -> bool:
    return same_bits(a.sparse_idx, b.sparse_idx) and same_bits(a.sparse_val, b.sparse_val)


def copy_state(source: Trainer, target: Trainer) -> None:
    """The reference's parameters, gradients and momentum laid out as the target's."""
    assert source.distro is not None
    assert target.distro is not None
    pairs = zip(source.model.variables(), target.model.variables())
    with torch.no_grad():
        for ((_, ps), (_, pt)), ds, dt in zip(pairs, source.distro.deltas, target.distro.deltas):
            local_tensor(pt).copy_(local_tensor(shard_like(ps, pt)))
            local_tensor(dt).copy_(local_tensor(shard_like(ds, dt)))
            if pt.grad is None:
                pt.grad = torch.zeros_like(pt)
            local_tensor(pt.grad).copy_(local_tensor(shard_like(ps.grad, pt.grad)))


def tp_scenario(rank: int, mode: str = "tp") -> dict:
    tp = rank_trainer(mode, rank, Trainer)
    reference = make_reference(ARCHITECTURES[mode], mode in DEEPSEEK)
    batch = batch_for(1)
    kwargs = dict(warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[])
    out_t = tp.train(1, batch, **kwargs)
    out_r = reference.train(1, batch, **kwargs)
    grads_t = {n: p.grad for n, p in tp.model.variables()}
    full_grads = {n: tp_full(g) for n, g in grads_t.items()}
    diffs = {n: float((full_grads[n] - p.grad).abs().max()) for n, p in reference.model.variables()}
    grad_diff = max(diffs.values())
    # the parameters whose trained gradient is the one-rank client's, bit for bit, and whether
    # the payload DisTrO made of them (before the exact check below) is the one-rank bytes
    grad_equal = sorted(
        n for n, p in reference.model.variables() if same_bits(full_grads[n], p.grad)
    )
    sent_t, sent_r = (
        t.prepare_result(out, step=1, batch_id=BatchId(10, 13))
        for t, out in ((tp, out_t), (reference, out_r))
    )
    payload_equal = sent_t.commitment_hash == sent_r.commitment_hash
    sharded = sum(1 for _, p in tp.model.variables() if shard_placed(p))
    # exact: the same gradients and momentum give the same results; one aggregate, same bits
    assert reference.distro is not None
    assert tp.distro is not None
    copy_state(reference, tp)
    res_t = tp.distro.generate([out_t.distro_results], 1e-3, 1e-3)
    res_r = reference.distro.generate([out_t.distro_results], 1e-3, 1e-3)
    generate_equal = all(same_result(a, b) for a, b in zip(res_t, res_r))
    aggregate = [res_r, out_r.distro_results]
    tp.optimize(2, distro_results=aggregate)
    reference.optimize(2, distro_results=aggregate)
    full = tp.full_variables()
    apply_equal = all(same_bits(full[n], p) for n, p in reference.model.variables())
    return {
        "loss": (out_t.loss, out_r.loss),
        "grad_max_abs_diff": grad_diff,
        "grad_worst": max(diffs, key=diffs.__getitem__),
        "sharded_params": sharded,
        "grad_equal": grad_equal,
        "params": len(diffs),
        "payload_equal": payload_equal,
        "generate_equal": generate_equal,
        "apply_equal": apply_equal,
    }


def shard_placed(p: torch.Tensor) -> bool:
    """Split over the TP ranks (a DTensor may also be replicated: torchtitan's norms are)."""
    from psyche.modeling.sharding import is_sharded

    return is_sharded(p) and any(placement.is_shard() for placement in p.placements)


def tp_full(t: torch.Tensor) -> torch.Tensor:
    from psyche.modeling.sharding import full_tensor

    return full_tensor(t)


def main() -> None:
    global DEVICE, STEPS
    rank, init_file, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    DEVICE = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    torch.set_num_threads(1)
    if len(sys.argv) > 5 and sys.argv[5] in FOUR_RANKS:  # four ranks, these scenarios alone
        init_world(rank, 4, f"file://{init_file}", rank_device(rank))
        report = {}
        modes, STEPS = FOUR_RANKS[sys.argv[5]]
        try:
            for mode in modes:
                report[mode] = protocol_scenario(mode, rank, out)
                if mode.startswith("tp-"):
                    report[mode]["exact"] = tp_scenario(rank, mode)
        finally:
            close_world()
        if rank == 0:
            torch.save(report, out / "report.pt")
        os._exit(0)
    if len(sys.argv) > 5:  # "batched" or "per-parameter": DisTrO's route on every trainer
        distro_module.BATCHED_ROUTE = sys.argv[5] == "batched"
    init_world(rank, 2, f"file://{init_file}", rank_device(rank))
    report = {}
    try:
        for mode in ("dp", "fsdp"):
            report[mode] = protocol_scenario(mode, rank, out)
        # torchtitan (an optional extra) on the CPU: its RoPE table is a complex buffer that a
        # bf16 cast of the whole module would ruin
        if DEVICE == "cpu" and torchtitan.available() is None:
            for mode in ("dp-torchtitan", "fsdp-torchtitan"):
                report[mode] = protocol_scenario(mode, rank, out)
        report["tp"] = tp_scenario(rank)
        report["tp-deepseek"] = tp_scenario(rank, "tp-deepseek")
        if DEVICE == "cpu" and torchtitan.available() is None:
            for mode in ("tp-torchtitan", "tp-torchtitan-deepseek"):
                protocol = protocol_scenario(mode, rank, out)
                report[mode] = {**protocol, "exact": tp_scenario(rank, mode)}
    finally:
        close_world()
    if rank == 0:
        torch.save(report, out / "report.pt")
    os._exit(0)


if __name__ == "__main__":
    main()
