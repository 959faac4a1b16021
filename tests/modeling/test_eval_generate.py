"""MMLU Pro, the generation task: upstream's chain-of-thought prompt, greedy decoding equal to a
plain recompute-everything loop (context window included), resumption after an interruption,
and scoring of the last "answer is (X)" with a model scripted to answer."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from psyche.core.running_average import RunningAverage
from psyche.modeling.eval import DatasetSource, Task, tasktype_from_name
from psyche.modeling.eval.harness import EvalTaskOptions, generate_greedy

from .eval_support import tiny_model, write_rows


def pro_row(question: str, options: list[str], answer: str, category: str, cot: str = "") -> dict:
    return {
        "question_id": 0,
        "question": question,
        "options": options,
        "answer": answer,
        "answer_index": "ABCDEFGHIJ".index(answer),
        "cot_content": cot,
        "category": category,
        "src": "x",
    }


VALIDATION = [
    pro_row(
        "What is 1+1?",
        ["1", "2", "3"],
        "B",
        "math",
        "A: Let's think step by step. The answer is (B).",
    ),
    pro_row(
        "What is 2+2?", ["4", "5"], "A", "math", "A: Let's think step by step. The answer is (A)."
    ),
    pro_row("Which is a cell part?", ["nucleus", "rock"], "A", "biology", "A: The answer is (A)."),
]
TEST = [
    pro_row("What is 3+3?", ["6", "7", "8"], "C", "math"),
    pro_row("What is 5-1?", ["4", "3"], "A", "math"),
    pro_row("What holds DNA?", ["nucleus", "wall", "pond"], "C", "biology"),
]


def mmlu_pro(tmp_path: Path) -> Any:
    write_rows(tmp_path, "TIGER-Lab/MMLU-Pro", None, "test", TEST, fmt="parquet")
    write_rows(tmp_path, "TIGER-Lab/MMLU-Pro", None, "validation", VALIDATION, fmt="parquet")
    return tasktype_from_name("mmlu_pro", DatasetSource(root=tmp_path))


def test_prompt_matches_a_hand_built_one(tmp_path: Path, tokenizer: Any) -> None:
    prepared = Task(mmlu_pro(tmp_path), 1, 42).prepare(tokenizer)
    expected = (
        "The following are multiple choice questions (with answers) about math. Think step by "
        'step and then finish your answer with "the answer is (X)" where X is the correct '
        "letter choice.\n"
        "Question:\nWhat is 1+1?\nOptions:\nA. 1\nB. 2\nC. 3\n"
        "Answer: Let's think step by step. The answer is (B).\n\n"
        "Question:\nWhat is 3+3?\nOptions:\nA. 6\nB. 7\nC. 8\n"
        "Answer: Let's think step by step."
    )
    request = prepared.generate_requests[0]
    assert request.request_str == expected
    # No special tokens, as upstream encodes generation prompts.
    assert list(request.request) == tokenizer.encode(expected, add_special_tokens=False).ids
    assert [r.answer for r in prepared.generate_requests] == [2, 0, 2]
    assert prepared.main_metric_name() == "acc"


def hand_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """Upstream's loop: the whole (window-truncated) sequence through the model for each token,
    the last of equal maxima."""
    sequence, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            if len(sequence) > model.max_context_length:
                sequence = sequence[len(sequence) - model.max_context_length :]
            logits = model.model(torch.tensor([sequence]), use_cache=False).logits[0, -1]
            best = logits.max()
            token = max(i for i in range(logits.shape[0]) if logits[i] == best)
            sequence.append(token)
            out.append(token)
    return out


@pytest.mark.parametrize("prompt_len", [20, 60])
def test_greedy_decoding_equals_recomputing_everything(tokenizer: Any, prompt_len: int) -> None:
    # No end-of-sequence token in reach (id 600 > vocab): every run generates all 12 tokens.
    # The 60-token prompt crosses the 64-token window after 4 tokens.
    model = tiny_model(seed=3, eos_token_id=600)
    prompt = [
        int(x)
        for x in torch.randint(1, 512, (prompt_len,), generator=torch.Generator().manual_seed(0))
    ]
    generated: list[int] = []
    done = generate_greedy(model, tokenizer, prompt, generated, stop_strings=(), max_tokens=12)
    assert done
    assert len(generated) == 12
    assert generated == hand_greedy(model, prompt, 12)
    assert model.model.training  # the train mode is restored


def test_interrupted_generation_resumes_to_the_same_tokens(tokenizer: Any) -> None:
    model = tiny_model(seed=3, eos_token_id=600)
    prompt = list(range(5, 25))
    whole: list[int] = []
    generate_greedy(model, tokenizer, prompt, whole, stop_strings=(), max_tokens=10)
    calls = iter(range(100))
    partial: list[int] = []
    stopped = lambda: next(calls) >= 4  # noqa: E731
    assert not generate_greedy(
        model, tokenizer, prompt, partial, stop_strings=(), max_tokens=10, stopped=stopped
    )
    assert partial == whole[:4]
    assert generate_greedy(model, tokenizer, prompt, partial, stop_strings=(), max_tokens=10)
    assert partial == whole


def scripted_model(tokenizer: Any, chain: list[int], eos: int = 0) -> Any:
    """A tiny Llama whose greedy next token depends only on the current one: attention and MLP
    outputs are zeroed (the hidden state is the token's embedding), and the output head maps
    chain[i]'s normalized embedding to chain[i + 1]."""
    model = tiny_model(seed=5, eos_token_id=eos)
    hf = model.model
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = hf.model.embed_tokens.weight
        normed = embed / embed.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
        head = torch.zeros_like(hf.lm_head.weight)
        for current, following in itertools.pairwise(chain):
            head[following] += normed[current]
        hf.lm_head.weight.copy_(head)
    return model


def ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_generation_stops_at_the_stop_string(tokenizer: Any) -> None:
    chain = [ids(tokenizer, ".")[0], *ids(tokenizer, "Question:")]
    assert len(set(chain)) == len(chain)
    model = scripted_model(tokenizer, chain)
    generated: list[int] = []
    assert generate_greedy(
        model, tokenizer, ids(tokenizer, "step by step."), generated, stop_strings=("Question:",)
    )
    assert tokenizer.decode(generated) == "Question:"


def test_score_is_the_last_answer_in_the_generated_text(tmp_path: Path, tokenizer: Any) -> None:
    # Every prompt ends with "step by step."; the model continues " answer is (C)" and then
    # emits its end-of-sequence token (0).
    chain = [ids(tokenizer, ".")[0], *ids(tokenizer, " answer is (C)"), 0]
    assert len(set(chain)) == len(chain)
    model = scripted_model(tokenizer, chain)
    prepared = Task(mmlu_pro(tmp_path), 5, 42).prepare(tokenizer)
    results = RunningAverage()
    out = prepared.run(EvalTaskOptions(model=model, live_results=results, confident_only=False))
    # Answers are C, A, C: two hits.
    assert out.documents == 3
    assert out.scores == {"acc": pytest.approx(2 / 3)}
    assert out.next_index == 3
    assert not prepared.cache


def test_a_deadline_keeps_the_partial_generation_for_the_next_run(
    tmp_path: Path, tokenizer: Any
) -> None:
    chain = [ids(tokenizer, ".")[0], *ids(tokenizer, " answer is (C)"), 0]
    model = scripted_model(tokenizer, chain)
    prepared = Task(mmlu_pro(tmp_path), 0, 42).prepare(tokenizer)
    results = RunningAverage()
    first = prepared.run(EvalTaskOptions(model=model, live_results=results, deadline=0.0))
    assert first.cancelled
    assert first.documents == 0
    assert first.next_index == 0
    out = prepared.run(
        EvalTaskOptions(model=model, live_results=results, confident_only=False, limit=1)
    )
    assert out.documents == 1
    assert out.next_index == 1
    assert out.scores == {"acc": 1.0}
