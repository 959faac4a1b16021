"""Few-shot prompts as upstream builds them: a category's first examples for MMLU, MMLU CF and
ARC, examples shuffled per document by one seeded ChaCha8 generator for the others; the same
seed always gives the same prompts, and `eval_task_max_docs` keeps the first documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from psyche.core.rng import ChaCha8Rng
from psyche.modeling.eval import DatasetSource, Task, tasktype_from_name
from psyche.modeling.eval.harness import bos_token_id, seed_bytes

from ..core.rand_reference import reference_shuffle
from .eval_support import write_rows


def context_of(prepared: Any, doc_index: int, tokenizer: Any) -> str:
    """The context a prepared document's first request holds (BOS and the choice removed)."""
    doc = prepared.llh_docs[doc_index]
    request = doc.requests[0]
    return tokenizer.decode(list(request[1 : len(request) - doc.choices_token_len[0]]))


PIQA_TRAIN = [
    {"goal": f"Goal {i}", "sol1": f"first {i}", "sol2": f"second {i}", "label": i % 2}
    for i in range(6)
]
PIQA_VALIDATION = [
    {"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Smash it.", "label": 0},
    {"goal": "Dry hair", "sol1": "Use a fork.", "sol2": "Use a towel.", "label": 1},
    {"goal": "Cool soup", "sol1": "Blow on it.", "sol2": "Boil it.", "label": 0},
]


def piqa(tmp_path: Path) -> Any:
    write_rows(tmp_path, "ybisk/piqa", "plain_text", "validation", PIQA_VALIDATION)
    write_rows(tmp_path, "ybisk/piqa", "plain_text", "train", PIQA_TRAIN)
    return tasktype_from_name("piqa", DatasetSource(root=tmp_path))


def test_seed_layout() -> None:
    assert seed_bytes(42) == bytes(24) + bytes([0, 0, 0, 0, 0, 0, 0, 42])
    assert seed_bytes(0x0102030405060708)[24:] == bytes([1, 2, 3, 4, 5, 6, 7, 8])


def test_shuffled_fewshot_prompt_matches_a_hand_built_one(tmp_path: Path, tokenizer: Any) -> None:
    prepared = Task(piqa(tmp_path), 2, 42).prepare(tokenizer)
    # One generator for the whole task, drawn from document after document.
    rng = ChaCha8Rng(bytes(24) + (42).to_bytes(8, "big"))
    shots = [
        f"Question: Goal {i}\nAnswer: " + ("first", "second")[i % 2] + f" {i}" for i in range(6)
    ]
    for doc_index, row in enumerate(PIQA_VALIDATION):
        order = reference_shuffle(shots, rng)
        expected = f"{order[0]}\n\n{order[1]}\n\nQuestion: {row['goal']}\nAnswer:"
        assert context_of(prepared, doc_index, tokenizer) == expected
    first = reference_shuffle(shots, ChaCha8Rng(seed_bytes(42)))
    # The literal prompt of document 0 for seed 42 (what rand 0.9 gives upstream).
    assert context_of(prepared, 0, tokenizer) == (
        f"{first[0]}\n\n{first[1]}\n\nQuestion: Open a jar\nAnswer:"
    )
    assert first[:2] != shots[:2]  # the seed does reorder these examples


def test_same_seed_same_prompts_other_seed_other_prompts(tmp_path: Path, tokenizer: Any) -> None:
    task_type = piqa(tmp_path)
    a = Task(task_type, 3, 7).prepare(tokenizer)
    b = Task(task_type, 3, 7).prepare(tokenizer)
    c = Task(task_type, 3, 8).prepare(tokenizer)
    assert [d.requests for d in a.llh_docs] == [d.requests for d in b.llh_docs]
    assert [d.requests for d in a.llh_docs] != [d.requests for d in c.llh_docs]


def test_max_docs_keeps_the_first_documents(tmp_path: Path, tokenizer: Any) -> None:
    task_type = piqa(tmp_path)
    full = Task(task_type, 2, 42).prepare(tokenizer)
    limited = Task(task_type, 2, 42).prepare(tokenizer, limit=2)
    assert limited.num == 2
    assert full.num == 3
    assert [d.requests for d in limited.llh_docs] == [d.requests for d in full.llh_docs[:2]]


MMLU_DEV = [
    {"question": "Bio one?", "subject": "virology", "choices": ["a", "b", "c", "d"], "answer": 2},
    {"question": "Math one?", "subject": "algebra", "choices": ["1", "2", "3", "4"], "answer": 0},
    {"question": "Bio two?", "subject": "virology", "choices": ["e", "f", "g", "h"], "answer": 1},
    {"question": "Bio three?", "subject": "virology", "choices": ["i", "j", "k", "l"], "answer": 3},
]
MMLU_TEST = [
    {
        "question": "What is a virus?",
        "subject": "virology",
        "choices": ["a cell", "a particle", "a plant", "a rock"],
        "answer": 1,
    },
]


def test_mmlu_fewshot_is_the_subjects_first_examples(tmp_path: Path, tokenizer: Any) -> None:
    write_rows(tmp_path, "cais/mmlu", "all", "test", MMLU_TEST)
    write_rows(tmp_path, "cais/mmlu", "all", "dev", MMLU_DEV)
    task_type = tasktype_from_name("mmlu", DatasetSource(root=tmp_path))
    for seed in (42, 1):
        prepared = Task(task_type, 2, seed).prepare(tokenizer)
        assert context_of(prepared, 0, tokenizer) == (
            "The following are multiple choice questions (with answers) about virology.\n\n"
            "Bio one?\nA. a\nB. b\nC. c\nD. d\nAnswer: C\n\n"
            "Bio two?\nA. e\nB. f\nC. g\nD. h\nAnswer: B\n\n"
            "What is a virus?\nA. a cell\nB. a particle\nC. a plant\nD. a rock\nAnswer:"
        )
    zero_shot = Task(task_type, 0, 42).prepare(tokenizer)
    assert context_of(zero_shot, 0, tokenizer) == (
        "The following are multiple choice questions (with answers) about virology.\n\n"
        "What is a virus?\nA. a cell\nB. a particle\nC. a plant\nD. a rock\nAnswer:"
    )


def test_hellaswag_fewshot_comes_from_the_documents_activity(
    tmp_path: Path, tokenizer: Any
) -> None:
    def row(label: str, ctx: str, answer: int) -> dict:
        return {
            "activity_label": label,
            "ctx_a": ctx,
            "ctx_b": "",
            "endings": ["x", "y"],
            "label": str(answer),
        }

    train = [row("Baking", "Mix.", 0), row("Running", "Run.", 1), row("Baking", "Knead.", 1)]
    write_rows(tmp_path, "Rowan/hellaswag", None, "train", train)
    write_rows(tmp_path, "Rowan/hellaswag", None, "validation", [row("Baking", "Bake.", 0)])
    task_type = tasktype_from_name("hellaswag", DatasetSource(root=tmp_path))
    prepared = Task(task_type, 2, 42).prepare(tokenizer)
    order = reference_shuffle(["Baking: Mix. x", "Baking: Knead. y"], ChaCha8Rng(seed_bytes(42)))
    assert context_of(prepared, 0, tokenizer) == f"{order[0]}\n\n{order[1]}\n\nBaking: Bake."


def test_requests_start_with_bos_then_context_then_choice(tmp_path: Path, tokenizer: Any) -> None:
    prepared = Task(piqa(tmp_path), 0, 42).prepare(tokenizer)
    context = tokenizer.encode("Question: Open a jar\nAnswer:", add_special_tokens=False).ids
    full = tokenizer.encode("Question: Open a jar\nAnswer: Smash it.", add_special_tokens=False).ids
    assert prepared.llh_docs[0].requests[1] == (1, *context, *full[len(context) :])
    # `<s>` is BOS where the tokenizer has it; id 1 otherwise (upstream's rule).
    assert bos_token_id(tokenizer) == 1
    from tokenizers import Tokenizer

    with_s = Tokenizer.from_str(tokenizer.to_str())
    with_s.add_special_tokens(["<s>"])
    assert bos_token_id(with_s) == with_s.token_to_id("<s>") != 1
