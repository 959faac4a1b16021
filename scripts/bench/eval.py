"""Evaluation time per task on the tiny run's model (configs/tiny-cpu: a 0.2M-parameter Llama,
random weights, its byte-level tokenizer), against upstream's procedure in the same run.

    .venv/bin/python scripts/bench/eval.py            # ~1-2 minutes on 2 cores
    .venv/bin/python scripts/bench/eval.py --quick    # smaller, for a smoke test

Each task gets a synthetic dataset of `--docs` documents in its hub format (written to a
temporary directory; questions and choices are seeded random words, choice counts as the real
task's). For each task the script prints:

* prepare: loading the files and building and tokenizing every request (done once per run);
* run: `PreparedTask.run` over every document (what `EvalRunner.run_some` spends per document),
  as ms per document (best of `--passes` passes, alternating with the baseline's);
* upstream: the same documents scored the way upstream's harness runs them, one sequence per
  forward pass (each choice, then each unconditional tail), as ms per document; ratio = run /
  upstream.

MMLU Pro generates (5-shot prompts, greedy, up to 1024 tokens, the model's 256-token window):
its baseline is upstream's loop that passes the whole window through the model for every token,
against the package's KV cache (which the window's sliding voids once the sequence fills it);
the script checks that both produce the same tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from psyche.core.running_average import RunningAverage
from psyche.modeling.causal_lm import CausalLM, ModelOptions, load_config_json
from psyche.modeling.eval import DatasetSource, Task, tasktype_from_name
from psyche.modeling.eval.harness import (
    EvalTaskOptions,
    PreparedTask,
    TokenizedLLHDocument,
    _inference,
    _last_argmax,
    generate_greedy,
)
from psyche.modeling.eval.tasks.ceval import SUBJECT_MAPPING

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "configs" / "tiny-cpu" / "model"
WORDS = [
    "the",
    "a",
    "water",
    "light",
    "plant",
    "cell",
    "energy",
    "heat",
    "rock",
    "river",
    "cloud",
    "seed",
    "animal",
    "tool",
    "metal",
    "wood",
    "sound",
    "force",
    "motion",
    "earth",
    "moon",
    "sun",
    "star",
    "salt",
    "sugar",
    "glass",
    "paper",
    "fire",
    "ice",
    "wind",
    "rain",
    "soil",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write(root: Path, repo: str, subset: str | None, split: str, rows: list[dict]) -> None:
    folder = root / repo / (subset or "default") / split
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "0000.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    )


def make_datasets(root: Path, n: int, n_generate: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    letters = "ABCD"

    def arc(k: int) -> list[dict]:
        return [
            {
                "question": words(rng, 12) + "?",
                "choices": {
                    "text": [words(rng, rng.randint(1, 5)) for _ in range(4)],
                    "label": list(letters),
                },
                "answerKey": rng.choice(letters),
            }
            for _ in range(k)
        ]

    for subset in ("ARC-Easy", "ARC-Challenge"):
        write(root, "allenai/ai2_arc", subset, "test", arc(n))
        write(root, "allenai/ai2_arc", subset, "train", arc(5))
    boolq = [
        {"question": words(rng, 8), "passage": words(rng, 60), "idx": i, "label": rng.randint(0, 1)}
        for i in range(n)
    ]
    write(root, "aps/super_glue", "boolq", "validation", boolq)
    write(root, "aps/super_glue", "boolq", "train", boolq[:5])
    hellaswag = [
        {
            "activity_label": rng.choice(["Baking", "Running", "Gardening"]),
            "ctx_a": words(rng, 20) + ".",
            "ctx_b": words(rng, 4),
            "endings": [words(rng, rng.randint(8, 20)) for _ in range(4)],
            "label": str(rng.randint(0, 3)),
        }
        for _ in range(n)
    ]
    write(root, "Rowan/hellaswag", None, "validation", hellaswag)
    write(root, "Rowan/hellaswag", None, "train", hellaswag[:10])
    mmlu = [
        {
            "question": words(rng, 15) + "?",
            "subject": rng.choice(["high_school_biology", "college_physics"]),
            "choices": [words(rng, rng.randint(1, 6)) for _ in range(4)],
            "answer": rng.randint(0, 3),
        }
        for _ in range(n)
    ]
    write(root, "cais/mmlu", "all", "test", mmlu)
    write(root, "cais/mmlu", "all", "dev", mmlu[:10])
    write(root, "cais/mmlu", "all", "validation", mmlu[:10])
    obqa = [
        {
            "question_stem": words(rng, 10),
            "choices": {
                "text": [words(rng, rng.randint(1, 5)) for _ in range(4)],
                "label": list(letters),
            },
            "answerKey": rng.choice(letters),
        }
        for _ in range(n)
    ]
    write(root, "allenai/openbookqa", "main", "test", obqa)
    write(root, "allenai/openbookqa", "main", "validation", obqa[:5])
    piqa = [
        {
            "goal": words(rng, 8),
            "sol1": words(rng, 15),
            "sol2": words(rng, 15),
            "label": rng.randint(0, 1),
        }
        for _ in range(n)
    ]
    write(root, "ybisk/piqa", "plain_text", "validation", piqa)
    write(root, "ybisk/piqa", "plain_text", "train", piqa[:5])
    per_subject = -(-n // len(SUBJECT_MAPPING))
    for subject, _ in SUBJECT_MAPPING:
        rows = [
            {
                "question": words(rng, 12),
                **{x: words(rng, 2) for x in letters},
                "answer": rng.choice(letters),
            }
            for _ in range(per_subject)
        ]
        write(root, "ceval/ceval-exam", subject, "val", rows)
        write(root, "ceval/ceval-exam", subject, "dev", rows[:1])
    pro = [
        {
            "question": words(rng, 15) + "?",
            "options": [words(rng, 3) for _ in range(10)],
            "answer": rng.choice("ABCDEFGHIJ"),
            "cot_content": "A: Let's think step by step. "
            + words(rng, 20)
            + ". The answer is (A).",
            "category": "physics",
        }
        for _ in range(max(n_generate, 5))
    ]
    write(root, "TIGER-Lab/MMLU-Pro", None, "test", pro[:n_generate])
    write(root, "TIGER-Lab/MMLU-Pro", None, "validation", pro)


def upstream_loglikelihood(model: CausalLM, doc: TokenizedLLHDocument) -> None:
    """Upstream's loop for one document: one forward per choice, then one per unconditional tail."""
    for request, n in zip(doc.requests, doc.choices_token_len):
        ids = torch.tensor([request[:-1]])
        logits, _ = model.forward(ids, num_logits_to_keep=n)
        logits.float().log_softmax(-1).gather(
            -1, torch.tensor([request[len(request) - n :]]).unsqueeze(-1)
        ).sum()
    for request, n in zip(doc.requests, doc.acc_uncond_tokens_len):
        tail = request[len(request) - n :]
        logits, _ = model.forward(torch.tensor([tail[:-1]]))
        logits.float().log_softmax(-1).gather(-1, torch.tensor([tail[1:]]).unsqueeze(-1)).sum()


def upstream_generate(
    model: CausalLM, tokenizer: Any, prompt: list[int], steps: int, stops: tuple[str, ...]
) -> list[int]:
    """Upstream's generation loop: the whole window through the model for every token, and the
    generated text decoded for the stop strings after each."""
    sequence, out = list(prompt), []
    for _ in range(steps):
        if len(sequence) > model.max_context_length:
            del sequence[: len(sequence) - model.max_context_length]
        logits, _ = model.forward(torch.tensor([sequence]), num_logits_to_keep=1)
        token = _last_argmax(logits[0, -1])
        sequence.append(token)
        out.append(token)
        text = tokenizer.decode(out, skip_special_tokens=False)
        any(stop in text for stop in stops)
    return out


def bench_task(
    name: str, fewshot: int, source: DatasetSource, model: CausalLM, tokenizer: Any, passes: int
) -> tuple[str, int, float, float, float]:
    """(name, documents, prepare s, run s, upstream s); run and upstream are the best of
    `passes` alternating passes (one for generation), to damp a shared machine's noise."""
    start = time.perf_counter()
    prepared: PreparedTask = Task(tasktype_from_name(name, source), fewshot, 42).prepare(tokenizer)
    prepare_s = time.perf_counter() - start
    if prepared.generate_requests is not None:
        return (
            prepared.name,
            prepared.num,
            prepare_s,
            *bench_generation(prepared, model, tokenizer),
        )
    run_s = upstream_s = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        prepared.run(
            EvalTaskOptions(model=model, live_results=RunningAverage(), confident_only=False)
        )
        run_s = min(run_s, time.perf_counter() - start)
        start = time.perf_counter()
        with _inference(model):  # the same eval mode and no autograd as the package's run
            for doc in prepared.llh_docs or []:
                upstream_loglikelihood(model, doc)
        upstream_s = min(upstream_s, time.perf_counter() - start)
    return prepared.name, prepared.num, prepare_s, run_s, upstream_s


def bench_generation(
    prepared: PreparedTask, model: CausalLM, tokenizer: Any
) -> tuple[float, float]:
    """Each document generated by the package, then the same number of tokens by upstream's loop."""
    run_s = upstream_s = 0.0
    for request in prepared.generate_requests or []:
        generated: list[int] = []
        start = time.perf_counter()
        generate_greedy(
            model, tokenizer, request.request, generated, stop_strings=prepared.stop_tokens
        )
        run_s += time.perf_counter() - start
        start = time.perf_counter()
        with _inference(model):
            upstream = upstream_generate(
                model, tokenizer, list(request.request), len(generated), prepared.stop_tokens
            )
        upstream_s += time.perf_counter() - start
        assert upstream == generated, "the KV cache changed the greedy tokens"
    return run_s, upstream_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--docs", type=int, default=200, help="documents per loglikelihood task")
    p.add_argument("--generate-docs", type=int, default=3, help="MMLU Pro documents")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--passes", type=int, default=3, help="alternating passes per task (best counts)"
    )
    p.add_argument("--quick", action="store_true", help="20 documents, 1 generated")
    args = p.parse_args()
    if args.quick:
        args.docs, args.generate_docs = 20, 1
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    model = CausalLM.from_config(
        load_config_json(MODEL_DIR / "config.json"),
        ModelOptions(device="cpu", dtype="fp32", seed=1337),
    )
    tasks = [
        ("arc_easy", 0),
        ("arc_challenge", 0),
        ("boolq", 0),
        ("hellaswag", 0),
        ("mmlu", 0),
        ("mmlu_cf", 0),
        ("openbookqa", 0),
        ("piqa", 0),
        ("ceval_valid", 0),
        ("mmlu_pro", 5),
    ]
    print(
        f"torch {torch.__version__}, {args.threads} threads, tiny-cpu model, seed 42, few-shot as a client"
    )
    print(
        f"{'task':<14} {'docs':>5} {'prepare s':>10} {'run ms/doc':>11} {'upstream ms/doc':>16} {'ratio':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        make_datasets(Path(tmp), args.docs, args.generate_docs)
        source = DatasetSource(root=Path(tmp))
        total = 0.0
        for name, fewshot in tasks:
            label, n, prepare_s, run_s, upstream_s = bench_task(
                name, fewshot, source, model, tokenizer, args.passes
            )
            total += run_s
            print(
                f"{label:<14} {n:>5} {prepare_s:>10.3f} {1000 * run_s / n:>11.2f} "
                f"{1000 * upstream_s / n:>16.2f} {run_s / upstream_s:>6.2f}"
            )
        print(f"all tasks: {total:.2f} s of scoring")


if __name__ == "__main__":
    main()
