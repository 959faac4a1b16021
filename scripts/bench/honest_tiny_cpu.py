"""Honest witness checks in the setting of `tests/e2e/test_training.py` (issue 25: 0 honest
results refused over at least 2,000 honest checks), the shipped DisTrO screening beside the rule
on one result (`relative_results` 1, the baseline), on the same checks of the same runs.

Three members of tiny-cpu (its model config, the tiny-cpu dataset with a per-run shuffle, the
8 rows of a round split 3/3/2 in a shuffled order, DisTrO c16 k8 1-bit, cosine LR 3e-3 with 10
warmup steps, clip 1), one process, results applied two rounds later as the client does; every
member screens the others' results with both settings (its votes follow the shipped ones).
Printed: honest checks, refusals under each rule, the lowest `t` over the level, and each
refusal.

    .venv/bin/python scripts/bench/honest_tiny_cpu.py --runs 10 --rounds 40

No downloads: the dataset is written from CPython's pydoc topics (`write_tiny_dataset`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from psyche.centralized.tiny_run import write_tiny_dataset
from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.definitions import CosineLR, LearningRateSchedule, OptimizerDefinition
from psyche.core.token_size import TokenSize
from psyche.data_provider.local import LocalDataProvider
from psyche.modeling.causal_lm import CausalLM, ModelOptions
from psyche.modeling.research import DistroSettings
from psyche.modeling.screening import DISTRO_SCREENING, WitnessScreen
from psyche.modeling.serialized_distro import decode_transmittable
from psyche.modeling.trainer import Batch, Trainer

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu"
RULES = {
    "shipped": DISTRO_SCREENING,
    "one result": dataclasses.replace(DISTRO_SCREENING, relative_results=1),
}


def trainer(seed: int) -> Trainer:
    config = json.loads((TINY / "model" / "config.json").read_text())
    model = CausalLM.from_config(config, ModelOptions(architecture="HfLlama", seed=seed))
    schedule = LearningRateSchedule.Cosine(
        CosineLR(base_lr=3e-3, warmup_init_lr=0.0, final_lr=3e-4, warmup_steps=10, total_steps=200)
    )
    settings = DistroSettings(compression_chunk=16, compression_topk=8, clip_grad_norm=1.0)
    return Trainer(model, schedule, OptimizerDefinition.Distro(settings.definition()), 1)


def run(seed: int, rounds: int, data_dir: Path, figures: dict[str, dict[str, object]]) -> None:
    rng = random.Random(seed)
    shuffle = Shuffle.Seeded(bytes(rng.randrange(256) for _ in range(32)))
    data = LocalDataProvider.new_from_directory(data_dir, TokenSize.TwoBytes, 128, shuffle)
    members = [trainer(1000 + seed) for _ in range(3)]
    screens = {
        k: [WitnessScreen(t.screening_reader(), s) for t in members] for k, s in RULES.items()
    }  # type: ignore[arg-type]
    prev: list[list] = [[] for _ in members]  # type: ignore[type-arg]
    applied: dict[int, list] = {}  # type: ignore[type-arg]
    kept: dict[tuple[str, int], list] = {}  # type: ignore[type-arg]
    for step in range(1, rounds + 1):
        due = applied.pop(step - 2, None)
        if due is not None:
            for t in members:
                t.optimize(step, distro_results=due)
        order = list(range(3))
        rng.shuffle(order)
        first, rows = (step - 1) * 8, {}
        for place, member in enumerate(order):
            rows[member] = BatchId(first, first + (2 if place == 2 else 3) - 1)
            first += 2 if place == 2 else 3
        prepared, references = [], []
        for i, t in enumerate(members):
            out = t.train_exact(
                step, Batch.from_rows(data.read_batch(rows[i])), warmup_lr_between=None,
                zero_optim=False, prev_self_distro_results=prev[i],
            )  # fmt: skip
            t.decay_weights(step, warmup_lr_between=None)
            prepared.append(t.prepare_result(out, step=step, batch_id=rows[i]))
            references.append(t.screening_reference())
            prev[i] = [out.distro_results]
        received = [
            members[0].results_from_payload(decode_transmittable(p.payload.to_bytes()))
            for p in prepared
        ]
        votes = [1, 1, 1]
        for kind, witnesses in screens.items():
            fig = figures[kind]
            for w, screen in enumerate(witnesses):
                open_rounds = kept.setdefault((kind, w), [])
                if len(open_rounds) == 2:  # a client closes round N - 1 when N + 1 starts
                    open_rounds.pop(0).close()
                rnd = screen.open_round()
                open_rounds.append(rnd)
                rnd.set_reference(references[w], prepared[w].sent)
                levels = {i: screen._level_list(rnd) for i in range(3) if i != w}
                checked = {i: rnd.check(i, received[i]) for i in levels}
                for i, v in rnd.settle(checked).items():
                    fig["checks"] += 1  # type: ignore[operator]
                    if levels[i]:
                        ratio = v.measure.agreement / min(levels[i])
                        fig["lowest t/level"] = min(fig["lowest t/level"], ratio)  # type: ignore[call-overload]
                    if not v.passed:
                        fig["refused"].append(
                            f"run {seed} round {step} {w}<-{i} ({rows[i]}): {v.problem}"
                        )  # type: ignore[attr-defined]
                    votes[i] += kind == "shipped" and v.passed
        applied[step] = [received[i] for i in range(3) if votes[i] >= 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    figures = {k: {"checks": 0, "refused": [], "lowest t/level": float("inf")} for k in RULES}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_dataset(tmp, tokenizer_path=TINY / "model" / "tokenizer.json")
        for seed in range(args.seed, args.seed + args.runs):
            run(seed, args.rounds, Path(tmp), figures)
    print(
        f"{args.runs} runs of {args.rounds} rounds, 3 members, {time.perf_counter() - started:.0f} s"
    )
    for kind, fig in figures.items():
        refused = fig["refused"]
        print(
            f"  {kind:11s} honest checks {fig['checks']}, refused {len(refused)}, lowest t/level {fig['lowest t/level']:.3f}"
        )  # type: ignore[arg-type]
        for line in refused:  # type: ignore[attr-defined]
            print(f"    {line}")


if __name__ == "__main__":
    main()
