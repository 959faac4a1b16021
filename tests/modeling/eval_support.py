"""Shared pieces of the evaluation tests: the tiny run's tokenizer, a tiny random Llama, datasets
written in the hub's layout, and an independent hand count of upstream's scores.

The hand count runs one plain forward pass per sequence (no batching, no padding, no KV cache)
and follows upstream's harness as written in `harness.rs`, without the package's code."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_JSON = ROOT / "configs" / "tiny-cpu" / "model" / "tokenizer.json"
VOCAB = 512


def load_tokenizer() -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER_JSON))


def tiny_model(seed: int = 1337, **overrides: Any) -> Any:
    from psyche.modeling.causal_lm import CausalLM, ModelOptions
    from psyche.modeling.configs import llama_config_dict

    config = llama_config_dict("tiny", vocab_size=VOCAB, **overrides)
    return CausalLM.from_config(config, ModelOptions(device="cpu", dtype="fp32", seed=seed))


def write_rows(
    root: Path,
    repo: str,
    subset: str | None,
    split: str,
    rows: Sequence[dict[str, Any]],
    fmt: str = "jsonl",
    name: str = "0000",
) -> Path:
    """`root/<repo>/<subset or "default">/<split>/<name>.<fmt>` with the rows."""
    folder = root / repo / (subset or "default") / split
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


def _sum_logprobs(model: Any, sequence: list[int], start: int) -> float:
    """Sum over positions t >= start of log p(sequence[t] | sequence[:t]), one plain forward."""
    with torch.no_grad():
        logits = model.model(torch.tensor([sequence[:-1]]), use_cache=False).logits[0]
    logprobs = logits.float().log_softmax(-1)
    return float(sum(logprobs[t - 1, sequence[t]] for t in range(start, len(sequence))))


def hand_loglikelihoods(
    model: Any, tokenizer: Any, context: str, choices: Sequence[str]
) -> list[float]:
    """Each choice's loglikelihood: `[1] + tokens(context) + the tokens that tokenizing
    `context + " " + choice` adds`, its choice tokens scored (the tokenizer has no `<s>`)."""
    context_ids = tokenizer.encode(context, add_special_tokens=False).ids
    out = []
    for choice in choices:
        full = tokenizer.encode(f"{context} {choice}", add_special_tokens=False).ids
        sequence = [1, *context_ids, *full[len(context_ids) :]]
        out.append(_sum_logprobs(model, sequence, 1 + len(context_ids)))
    return out


def hand_unconditional(
    model: Any, tokenizer: Any, context: str, choices: Sequence[str]
) -> list[float]:
    """The loglikelihood of each request's shortest tail that decodes to "Answer: {choice}",
    every token after the tail's first one scored."""
    context_ids = tokenizer.encode(context, add_special_tokens=False).ids
    out = []
    for choice in choices:
        full = tokenizer.encode(f"{context} {choice}", add_special_tokens=False).ids
        choice_ids = full[len(context_ids) :]
        request = [1, *context_ids, *choice_ids]
        n = next(
            n
            for n in range(len(choice_ids), len(full))
            if f"Answer: {choice}"
            in tokenizer.decode(full[len(full) - n :], skip_special_tokens=False)
        )
        out.append(_sum_logprobs(model, request[len(request) - n :], 1))
    return out


def first_max(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def hand_count(
    model: Any,
    tokenizer: Any,
    docs: Sequence[tuple[str, Sequence[str], int]],
    norm: bool,
    uncond: bool,
) -> dict[str, float]:
    """acc (and acc_norm: loglikelihood over the choice's UTF-8 bytes; acc_uncond: minus the
    unconditional loglikelihood) over `(context, choices, answer)` documents."""
    hits = {"acc": 0, "acc_norm": 0, "acc_uncond": 0}
    for context, choices, answer in docs:
        lls = hand_loglikelihoods(model, tokenizer, context, choices)
        hits["acc"] += first_max(lls) == answer
        if norm:
            normed = [ll / len(c.encode("utf-8")) for ll, c in zip(lls, choices)]
            hits["acc_norm"] += first_max(normed) == answer
        if uncond:
            unc = hand_unconditional(model, tokenizer, context, choices)
            hits["acc_uncond"] += first_max([a - b for a, b in zip(lls, unc)]) == answer
    keys = ["acc"] + (["acc_norm"] if norm else []) + (["acc_uncond"] if uncond else [])
    return {k: hits[k] / len(docs) for k in keys}
