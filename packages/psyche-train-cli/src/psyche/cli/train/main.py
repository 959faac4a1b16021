"""`psyche-train`: train a model on local token files with AdamW or DisTrO (upstream's
`examples/train`), optionally as N simulated DisTrO peers in one process.

With DisTrO the loop has upstream's timing: step N trains on weights updated through step N-2
(plus the lookahead), then applies the (optionally 1-bit) results of step N-1. With `--peers N`
the batch is split across N replicas; each applies every replica's results, as Psyche clients
do, and keeps its own unquantized results for the momentum residual.

Data comes from psyche.data_provider, as upstream: the local token-file provider, or, when the
directory holds no token files it can use, the preprocessed (parquet) provider's train split.
`--seed S` (a u32) shuffles with upstream's ChaCha8 shuffle under the 32-byte seed
`[0] * 28 + S.to_bytes(4, "big")` (upstream's example writes the seed's big-endian bytes into the
last four bytes of a zeroed array), so a seed selects the same order here as in upstream.

The defaults train offline out of the box: the tiny run's model (configs/tiny-cpu/model, a
config without weights: random init, seed 1337) on its token files (data/tiny-cpu, written by
scripts/setup.sh), for 200 steps of 8 sequences of 128 tokens with the tiny run's learning
rate schedule. Upstream's example defaults to a 215M-parameter hub model on
`--sequence-length 2048 --total-batch 256`; pass those to train it. The default paths are
found from the repository's root when run anywhere inside it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psyche.core.cli import (
    HelpFormatter,
    UserError,
    add_verbose_flag,
    parse_unsigned,
    run_command,
)
from psyche.core.definitions import (
    AdamW,
    CosineLR,
    Distro,
    LearningRateSchedule,
    OptimizerDefinition,
)

if TYPE_CHECKING:
    from psyche.core.batch_id import BatchId
    from psyche.core.data_shuffle import Shuffle
    from psyche.modeling.causal_lm import CausalLM
    from psyche.modeling.trainer import Batch

PROG = "psyche-train"
# The tiny run's model and data, relative to the repository's root.
DEFAULT_MODEL = "configs/tiny-cpu/model"
DEFAULT_DATA = "data/tiny-cpu"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="local directory (safetensors weights, or only a config.json: random init) or a "
        "hub repo id (downloaded unless cached)",
    )
    p.add_argument(
        "--init-config",
        help="random init instead of --model: a config.json path or a preset (tiny, 20m, 1b)",
    )
    p.add_argument(
        "--architecture",
        default="HfAuto",
        help="HfLlama, HfDeepseek or HfAuto (Torchtitan is not supported yet)",
    )
    p.add_argument(
        "--data-path",
        default=DEFAULT_DATA,
        help="directory of token files (.ds/.npy), or of preprocessed parquet files",
    )
    p.add_argument("--sequence-length", type=int, default=128, help="tokens per sequence")
    p.add_argument(
        "--token-size", type=int, default=2, choices=(2, 4), help="bytes per token in the files"
    )
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--total-batch", type=int, default=8, help="sequences per step")
    p.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1")
    p.add_argument("--beta2", type=float, default=0.95, help="AdamW beta2")
    p.add_argument("--weight-decay", type=float, default=0.1, help="weight decay")
    p.add_argument("--eps", type=float, default=1e-8, help="AdamW epsilon")
    p.add_argument("--learning-rate", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warmup steps")
    p.add_argument(
        "--total-steps", type=int, default=200, help="last step (the cosine schedule's length)"
    )
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp32")
    p.add_argument(
        "--grad-accum-in-fp32", action="store_true", help="accumulate gradients in float32"
    )
    p.add_argument("--compression-chunk", type=int, default=64, help="DisTrO DCT chunk size")
    p.add_argument("--compression-topk", type=int, default=4, help="DisTrO values kept per chunk")
    p.add_argument("--compression-decay", type=float, default=0.999, help="DisTrO momentum decay")
    p.add_argument("--distro", action="store_true", help="DisTrO instead of AdamW")
    p.add_argument(
        "--distro-quantization", action="store_true", help="1-bit DisTrO results (signs)"
    )
    p.add_argument("--peers", type=int, default=1, help="simulated DisTrO peers (replicas)")
    p.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=("eager", "sdpa", "flash_attention_2"),
        help="attention kernel",
    )
    p.add_argument("--start-step", type=int, default=1, help="first step (its batch and LR)")
    p.add_argument(
        "--seed", type=parse_unsigned(32), help="shuffle the samples with this seed (a u32)"
    )
    p.add_argument("--save-path", help="write a Hugging Face checkpoint here at the end")
    add_verbose_flag(p)
    return p


def find_repository(start: Path | None = None) -> Path | None:
    """The nearest directory from `start` (the working directory) up that holds the tiny run's
    model: the repository's root when run inside it."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if (directory / DEFAULT_MODEL / "config.json").is_file():
            return directory
    return None


def resolve_defaults(args: argparse.Namespace, start: Path | None = None) -> None:
    """The default --model and --data-path, relative to the repository's root; a default that
    is absent is a `UserError` saying how to get it (paths the user gave are left alone)."""
    if args.model != DEFAULT_MODEL and args.data_path != DEFAULT_DATA:
        return
    root = find_repository(start)
    if args.model == DEFAULT_MODEL and args.init_config is None:
        if root is None:
            raise UserError(
                f"no model at {DEFAULT_MODEL} (the default --model): run {PROG} from the "
                "repository, or pass --model or --init-config"
            )
        args.model = str(root / DEFAULT_MODEL)
    if args.data_path == DEFAULT_DATA:
        data = (root or Path.cwd()) / DEFAULT_DATA
        if not data.is_dir():
            raise UserError(
                f"no data at {DEFAULT_DATA} (the default --data-path): run scripts/setup.sh "
                "(it writes the tiny dataset), or pass --data-path"
            )
        args.data_path = str(data)


def _optimizer(args: argparse.Namespace) -> OptimizerDefinition:
    clip = None if args.max_grad_norm == 0 else args.max_grad_norm
    optimizer: OptimizerDefinition
    if args.distro:
        optimizer = OptimizerDefinition.Distro(
            Distro(
                clip_grad_norm=clip,
                weight_decay=args.weight_decay,
                compression_decay=args.compression_decay,
                compression_topk=args.compression_topk,
                compression_chunk=args.compression_chunk,
                quantize_1bit=args.distro_quantization,
            )
        )
        return optimizer
    optimizer = OptimizerDefinition.AdamW(
        AdamW(
            betas=[args.beta1, args.beta2],
            weight_decay=args.weight_decay,
            eps=args.eps,
            clip_grad_norm=clip,
        )
    )
    return optimizer


def _load_model(args: argparse.Namespace, seed: int) -> CausalLM:
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
    model = Path(args.model)
    if (model / "config.json").is_file() and not any(model.glob("*.safetensors")):
        # A config without weights (the tiny run's model): random init, as its clients do.
        return CausalLM.from_config(load_config_json(model / "config.json"), options)
    return CausalLM.from_pretrained(args.model, options)


def seed_shuffle(seed: int | None) -> Shuffle:
    """Upstream's `--seed` -> `Shuffle`: the u32's big-endian bytes end a zeroed 32-byte seed."""
    from psyche.core.data_shuffle import Shuffle

    shuffle: Shuffle = (
        Shuffle.DontShuffle()
        if seed is None
        else Shuffle.Seeded(bytes(28) + seed.to_bytes(4, "big"))
    )
    return shuffle


def _open_dataset(args: argparse.Namespace) -> Any:
    """The local provider, else (as upstream) the preprocessed provider's train split."""
    from psyche.core.token_size import TokenSize
    from psyche.data_provider import (
        DataProviderError,
        LocalDataProvider,
        PreprocessedDataProvider,
        Split,
    )

    shuffle = seed_shuffle(args.seed)
    dataset: LocalDataProvider | PreprocessedDataProvider
    try:
        dataset = LocalDataProvider.new_from_directory(
            args.data_path,
            TokenSize.from_num_bytes(args.token_size),
            args.sequence_length,
            shuffle,
        )
        print(f"Loaded local dataset with {dataset.num_sequences()} samples", flush=True)
        return dataset
    except DataProviderError as local_error:
        print(
            f"Failed to load with local data provider. {local_error} "
            "Trying preprocessed data provider instead",
            flush=True,
        )
        try:
            dataset = PreprocessedDataProvider.new_from_directory(
                args.data_path, args.sequence_length, shuffle, Split.Train, None
            )
        except DataProviderError as e:
            raise UserError(f"{local_error}; preprocessed data: {e}") from e
    print(f"Loaded preprocessed dataset with {dataset.num_sequences()} samples", flush=True)
    return dataset


def _read_batch(dataset: Any, ids: BatchId) -> Batch:
    """Samples `ids` as a training batch (int64 token ids); a failed read is a `UserError`."""
    import trio

    from psyche.data_provider import DataProviderError, LocalDataProvider
    from psyche.modeling.trainer import Batch

    try:
        if isinstance(dataset, LocalDataProvider):
            return Batch.from_rows(dataset.read_batch(ids))
        samples = trio.run(dataset.get_samples, ids)  # in memory: the call never waits
    except DataProviderError as e:
        raise UserError(str(e)) from e
    return Batch.from_samples(samples)


def main(argv: Sequence[str] | None = None) -> int:
    """The `psyche-train` command (exit codes and signals: `psyche.core.cli`)."""
    return run_command(PROG, _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.peers < 1:
        parser.error("--peers must be at least 1")
    if args.peers > 1 and not args.distro:
        parser.error("--peers needs --distro (simulated peers exchange DisTrO results)")
    if args.total_batch % args.peers:
        parser.error("--total-batch must be divisible by --peers")
    resolve_defaults(args)

    dataset = _open_dataset(args)
    try:
        return _train(args, dataset)
    finally:
        close = getattr(dataset, "close", None)  # the local provider unmaps its files
        if close is not None:
            close()


def _train(args: argparse.Namespace, dataset: Any) -> int:
    """Load the replicas, run `psyche.modeling.train_loop.train_steps` on the dataset's
    batches and report each step; save with --save-path (also when interrupted)."""
    from psyche.modeling.causal_lm import ModelLoadError
    from psyche.modeling.train_loop import train_steps
    from psyche.modeling.trainer import Trainer

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

    print(f"Loading {args.init_config or args.model}", flush=True)
    try:
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
    except ModelLoadError as e:
        raise UserError(str(e)) from e
    print("Done loading, starting training.", flush=True)

    tokens_per_step = args.total_batch * args.sequence_length
    started = time.perf_counter()
    steps_done = 0
    interrupted = False
    steps = train_steps(
        trainers,
        lambda ids: _read_batch(dataset, ids),
        start_step=args.start_step,
        total_steps=args.total_steps,
        total_batch=args.total_batch,
        distro=args.distro,
        quantize=args.distro_quantization,
    )
    try:
        for report in steps:
            ids = report.batch_id
            print(
                f"step: {report.step}, duration: {report.duration:.2f}, "
                f"batch: B[{ids.start}, {ids.end}], loss: {report.loss:.4f}, "
                f"tokens/s: {tokens_per_step / report.duration:.0f}",
                flush=True,
            )
            steps_done += 1
            if not math.isfinite(report.loss):
                print("psyche-train: loss is not finite, stopping", file=sys.stderr)
                return 1
    except KeyboardInterrupt:  # stop training, keep what was trained (saved with --save-path)
        from psyche.core.cli import interrupted_by

        print(f"interrupted by {interrupted_by()}, stopping", file=sys.stderr)
        interrupted = True
    total = time.perf_counter() - started
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
    if interrupted:
        from psyche.core.cli import interrupt_exit_code

        return interrupt_exit_code()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
