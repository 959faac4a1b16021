"""`psyche-train`: train a model on local token files with AdamW or DisTrO (upstream's
`examples/train`), optionally as N simulated DisTrO peers in one process.

With DisTrO the loop has upstream's timing: step N trains on weights updated through step N-2
(plus the lookahead), then applies the (optionally 1-bit) results of step N-1. With `--peers N`
the batch is split across N replicas; each applies every replica's results, as Psyche clients
do, and keeps its own unquantized results for the momentum residual.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from psyche.core.definitions import (
    AdamW,
    CosineLR,
    Distro,
    LearningRateSchedule,
    OptimizerDefinition,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psyche-train", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--model", default="emozilla/llama2-215m-init", help="local dir or hub repo id")
    p.add_argument(
        "--init-config",
        help="random init instead of --model: a config.json path or a preset (tiny, 20m, 1b)",
    )
    p.add_argument(
        "--architecture",
        default="HfAuto",
        help="HfLlama, HfDeepseek or HfAuto (Torchtitan is not supported yet)",
    )
    p.add_argument("--data-path", default="data")
    p.add_argument("--sequence-length", type=int, default=2048)
    p.add_argument("--token-size", type=int, default=2, choices=(2, 4))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--total-batch", type=int, default=256)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--learning-rate", type=float, default=4e-4)
    p.add_argument("--warmup-steps", type=int, default=500)
    p.add_argument("--total-steps", type=int, default=25000)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp32")
    p.add_argument("--grad-accum-in-fp32", action="store_true")
    p.add_argument("--compression-chunk", type=int, default=64)
    p.add_argument("--compression-topk", type=int, default=4)
    p.add_argument("--compression-decay", type=float, default=0.999)
    p.add_argument("--distro", action="store_true")
    p.add_argument("--distro-quantization", action="store_true")
    p.add_argument("--peers", type=int, default=1, help="simulated DisTrO peers (replicas)")
    p.add_argument(
        "--attn-implementation", default="sdpa", choices=("eager", "sdpa", "flash_attention_2")
    )
    p.add_argument("--start-step", type=int, default=1)
    p.add_argument("--seed", type=int, help="shuffle the samples with this seed")
    p.add_argument("--save-path", help="write a Hugging Face checkpoint here at the end")
    return p


def _optimizer(args: argparse.Namespace) -> OptimizerDefinition:
    clip = None if args.max_grad_norm == 0 else args.max_grad_norm
    if args.distro:
        return OptimizerDefinition.Distro(
            Distro(
                clip_grad_norm=clip,
                weight_decay=args.weight_decay,
                compression_decay=args.compression_decay,
                compression_topk=args.compression_topk,
                compression_chunk=args.compression_chunk,
                quantize_1bit=args.distro_quantization,
            )
        )
    return OptimizerDefinition.AdamW(
        AdamW(
            betas=[args.beta1, args.beta2],
            weight_decay=args.weight_decay,
            eps=args.eps,
            clip_grad_norm=clip,
        )
    )


def _load_model(args: argparse.Namespace, seed: int):  # type: ignore[no-untyped-def]
    from psyche.modeling.causal_lm import CausalLM, ModelOptions, load_config_json
    from psyche.modeling.configs import PRESETS, llama_config_dict

    options = ModelOptions(
        architecture=args.architecture,
        device=args.device,
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
        max_position_embeddings=args.sequence_length,
        seed=seed,
    )
    if args.init_config:
        if args.init_config in PRESETS:
            config = llama_config_dict(args.init_config)
        else:
            config = load_config_json(Path(args.init_config))
        return CausalLM.from_config(config, options)
    return CausalLM.from_pretrained(args.model, options)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.peers < 1:
        raise SystemExit("--peers must be at least 1")
    if args.peers > 1 and not args.distro:
        raise SystemExit("--peers needs --distro (simulated peers exchange DisTrO results)")
    if args.total_batch % args.peers:
        raise SystemExit("--total-batch must be divisible by --peers")

    from psyche.modeling.local_data import DataError, LocalTokenDataset
    from psyche.modeling.trainer import Batch, Trainer

    try:
        dataset = LocalTokenDataset(
            args.data_path, args.token_size, args.sequence_length, args.seed
        )
    except DataError as e:
        raise SystemExit(f"psyche-train: {e}") from e
    print(f"Loaded local dataset with {len(dataset)} samples", flush=True)

    schedule = LearningRateSchedule.Cosine(
        CosineLR(
            base_lr=args.learning_rate,
            warmup_steps=args.warmup_steps,
            warmup_init_lr=0.0,
            total_steps=args.total_steps,
            final_lr=args.learning_rate / 10.0,
        )
    )
    optimizer = _optimizer(args)
    # Every replica starts from the same weights: same source, same init seed.
    trainers = [
        Trainer(
            _load_model(args, seed=1337),
            schedule,
            optimizer,
            args.micro_batch,
            grad_accum_in_fp32=args.grad_accum_in_fp32,
        )
        for _ in range(args.peers)
    ]
    print("Done loading, starting training.", flush=True)

    prev: list[list] | None = [] if args.distro else None  # type: ignore[type-arg]
    tokens_per_step = args.total_batch * args.sequence_length
    started = time.perf_counter()
    step = args.start_step - 1
    try:
        for step in range(args.start_step, args.total_steps + 1):
            t0 = time.perf_counter()
            start_id = (step - 1) * args.total_batch
            end_id = step * args.total_batch - 1
            try:
                samples = dataset.get_samples(start_id, end_id)
            except DataError as e:
                print(f"psyche-train: {e}", file=sys.stderr)
                return 1
            import torch

            rows = torch.from_numpy(samples)
            per_peer = len(rows) // len(trainers)
            outputs = []
            for i, trainer in enumerate(trainers):
                own_prev = None if prev is None else ([prev[i]] if prev else [])
                out = trainer.train(
                    step,
                    Batch(rows[i * per_peer : (i + 1) * per_peer]),
                    prev_self_distro_results=own_prev,
                )
                outputs.append(out)
            for trainer in trainers:
                if prev is None:
                    trainer.optimize(step)
                elif step > args.start_step:
                    sent = [
                        trainer.quantize_results(r) if args.distro_quantization else r for r in prev
                    ]
                    trainer.optimize(step, distro_results=sent)
            if prev is not None:
                prev = [out.distro_results for out in outputs]
            loss = sum(out.loss for out in outputs) / len(outputs)
            duration = time.perf_counter() - t0
            print(
                f"step: {step}, duration: {duration:.2f}, batch: B[{start_id}, {end_id}], "
                f"loss: {loss:.4f}, tokens/s: {tokens_per_step / duration:.0f}",
                flush=True,
            )
            if not math.isfinite(loss):
                print("psyche-train: loss is not finite, stopping", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        print("interrupted, stopping", file=sys.stderr)
    total = time.perf_counter() - started
    steps_done = step - args.start_step + 1
    if steps_done > 0:
        print(
            f"trained {steps_done} steps in {total:.2f}s, "
            f"{steps_done * tokens_per_step / total:.0f} tokens/s",
            flush=True,
        )
    if args.save_path:
        from psyche.modeling.checkpoint import save_checkpoint

        paths = save_checkpoint(trainers[0].model, args.save_path)
        print(f"Saved checkpoint to {args.save_path} ({len(paths)} files)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
