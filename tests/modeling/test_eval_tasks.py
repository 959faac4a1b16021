"""Every evaluation task on a tiny dataset written in its hub format: the documents' prompts are
upstream's, and the scores of a tiny random Llama match a hand count (one plain forward pass per
choice, `eval_support.hand_count`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from psyche.core.running_average import RunningAverage
from psyche.modeling.eval import DatasetSource, Task, tasktype_from_name
from psyche.modeling.eval.harness import EvalTaskOptions
from psyche.modeling.eval.tasks.ceval import SUBJECT_MAPPING

from .eval_support import hand_count, write_rows

MMLU_PREAMBLE = "The following are multiple choice questions (with answers) about {}.\n\n"


def run_task(name: str, root: Path, model: Any, tokenizer: Any) -> tuple[Any, dict[str, float]]:
    """The task's documents and its scores over all of them (few-shot 0, as a client runs it)."""
    task_type = tasktype_from_name(name, DatasetSource(root=root))
    prepared = Task(task_type, 0, 42).prepare(tokenizer)
    results = RunningAverage()
    out = prepared.run(EvalTaskOptions(model=model, live_results=results, confident_only=False))
    assert out.documents == prepared.num
    assert not out.cancelled
    return task_type.get_documents(), out.scores


def check_scores(scores: dict[str, float], expected: dict[str, float]) -> None:
    assert scores.keys() == expected.keys()
    for key, value in expected.items():
        assert scores[key] == pytest.approx(value, abs=1e-12), key


ARC_ROWS = [
    {
        "id": "q1",
        "question": "Which gas do plants take in?",
        "choices": {"text": ["oxygen", "carbon dioxide", "helium", "neon"], "label": list("ABCD")},
        "answerKey": "B",
    },
    {
        "id": "q2",
        "question": "What melts ice fastest?",
        "choices": {"text": ["salt", "sand", "a very large amount of sugar"], "label": list("ABC")},
        "answerKey": "A",
    },
    {
        "id": "q3",
        "question": "Which is a mammal?",
        "choices": {"text": ["shark", "whale", "trout", "eel"], "label": ["1", "2", "3", "4"]},
        "answerKey": "2",
    },
    {
        "id": "q4",
        "question": "What does a compass point to?",
        "choices": {
            "text": ["north", "the sun", "water", "the ground below"],
            "label": list("ABCD"),
        },
        "answerKey": "A",
    },
]


@pytest.mark.parametrize(
    ("name", "subset"), [("arc_easy", "ARC-Easy"), ("ARC-Challenge", "ARC-Challenge")]
)
def test_arc(name: str, subset: str, tmp_path: Path, model: Any, tokenizer: Any) -> None:
    # Parquet with a struct column, as the hub's converted files.
    write_rows(tmp_path, "allenai/ai2_arc", subset, "test", ARC_ROWS, fmt="parquet")
    write_rows(tmp_path, "allenai/ai2_arc", subset, "train", ARC_ROWS[:1], fmt="parquet")
    docs, scores = run_task(name, tmp_path, model, tokenizer)
    assert docs[0].text == "Question: Which gas do plants take in?\nAnswer:"
    assert docs[0].choices == ("oxygen", "carbon dioxide", "helium", "neon")
    assert [d.answer for d in docs] == [1, 0, 1, 0]
    expected = [
        (f"Question: {r['question']}\nAnswer:", r["choices"]["text"], a)
        for r, a in zip(ARC_ROWS, [1, 0, 1, 0])
    ]
    check_scores(scores, hand_count(model, tokenizer, expected, norm=True, uncond=True))


BOOLQ_ROWS = [
    {"question": "is the sky blue", "passage": "The sky looks blue by day.", "idx": 0, "label": 1},
    {"question": "do fish fly", "passage": "Most fish swim and never fly.", "idx": 1, "label": 0},
    {"question": "is ice cold", "passage": "Ice is frozen water.", "idx": 2, "label": 1},
    {"question": "is fire wet", "passage": "Fire is hot and dry.", "idx": 3, "label": 0},
    {"question": "can birds sing", "passage": "Many birds sing at dawn.", "idx": 4, "label": 1},
]


def test_boolq(tmp_path: Path, model: Any, tokenizer: Any) -> None:
    write_rows(tmp_path, "aps/super_glue", "boolq", "validation", BOOLQ_ROWS)
    write_rows(tmp_path, "aps/super_glue", "boolq", "train", BOOLQ_ROWS[:2])
    docs, scores = run_task("boolq", tmp_path, model, tokenizer)
    assert docs[0].text == "The sky looks blue by day.\nQuestion: is the sky blue?\nAnswer:"
    assert docs[0].choices == ("no", "yes")
    expected = [
        (f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:", ["no", "yes"], r["label"])
        for r in BOOLQ_ROWS
    ]
    check_scores(scores, hand_count(model, tokenizer, expected, norm=False, uncond=False))


def hellaswag_row(label: str, ctx_a: str, ctx_b: str, endings: list[str], answer: int) -> dict:
    return {
        "ind": 0,
        "activity_label": label,
        "ctx_a": ctx_a,
        "ctx_b": ctx_b,
        "ctx": f"{ctx_a} {ctx_b}",
        "endings": endings,
        "source_id": "x",
        "split": "val",
        "split_type": "indomain",
        "label": str(answer),
    }


HELLASWAG_ROWS = [
    hellaswag_row(
        "Home and Garden [title]",
        " [header] How to water a plant [title] Fill a can.",
        "then pour  slowly",
        ["onto the soil. [step] Stop", "into the sink", "on the cat", "over your shoes now"],
        0,
    ),
    hellaswag_row(
        "Baking", "A man mixes flour.", "he", ["bakes bread", "sings", "runs", "sleeps"], 0
    ),
    hellaswag_row(
        "Baking", "A woman cracks eggs.", "she", ["whisks them", "dives", "naps", "paints"], 0
    ),
    hellaswag_row(
        "Running", "A runner ties shoes.", "the runner", ["starts", "eats", "reads", "swims"], 0
    ),
]


def test_hellaswag(tmp_path: Path, model: Any, tokenizer: Any) -> None:
    write_rows(tmp_path, "Rowan/hellaswag", None, "validation", HELLASWAG_ROWS)
    write_rows(tmp_path, "Rowan/hellaswag", None, "train", HELLASWAG_ROWS)
    docs, scores = run_task("hellaswag", tmp_path, model, tokenizer)
    # trim, " [title]" -> ". ", "[...]" dropped, "  " -> " " in one pass (three spaces leave
    # two), ctx_b capitalized.
    assert docs[0].text == "Home and Garden. :  How to water a plant. Fill a can. Then pour slowly"
    assert docs[0].choices == (
        "onto the soil. Stop",
        "into the sink",
        "on the cat",
        "over your shoes now",
    )
    assert docs[1].text == "Baking: A man mixes flour. He"
    assert docs[0].category == "Home and Garden [title]"
    expected = [(d.text, d.choices, 0) for d in docs[1:]]
    expected.insert(0, (docs[0].text, docs[0].choices, 0))
    check_scores(scores, hand_count(model, tokenizer, expected, norm=True, uncond=False))


MMLU_ROWS = [
    {
        "question": "  What carries oxygen in blood?\n",
        "subject": "high_school_biology",
        "choices": ["plasma", "red cells", "platelets", "bone"],
        "answer": 1,
    },
    {
        "question": "What is 2 + 3?",
        "subject": "elementary_mathematics",
        "choices": ["4", "5", "6", "23"],
        "answer": 1,
    },
    {
        "question": "Which organ pumps blood?",
        "subject": "high_school_biology",
        "choices": ["lung", "liver", "heart", "skin"],
        "answer": 2,
    },
    {
        "question": "What is 10 / 2?",
        "subject": "elementary_mathematics",
        "choices": ["2", "5", "8", "20"],
        "answer": 1,
    },
]


def test_mmlu(tmp_path: Path, model: Any, tokenizer: Any) -> None:
    write_rows(tmp_path, "cais/mmlu", "all", "test", MMLU_ROWS)
    write_rows(tmp_path, "cais/mmlu", "all", "dev", MMLU_ROWS)
    docs, scores = run_task("MMLU", tmp_path, model, tokenizer)
    assert docs[0].text == (
        "What carries oxygen in blood?\nA. plasma\nB. red cells\nC. platelets\nD. bone\nAnswer:"
    )
    assert docs[0].choices == ("A", "B", "C", "D")
    assert docs[0].category == "high school biology"
    expected = []
    for r in MMLU_ROWS:
        q = r["question"].strip()
        options = "\n".join(f"{letter}. {c}" for letter, c in zip("ABCD", r["choices"]))
        context = MMLU_PREAMBLE.format(r["subject"].replace("_", " ")) + f"{q}\n{options}\nAnswer:"
        expected.append((context, ["A", "B", "C", "D"], r["answer"]))
    check_scores(scores, hand_count(model, tokenizer, expected, norm=False, uncond=False))


def test_mmlu_cf(tmp_path: Path, model: Any, tokenizer: Any) -> None:
    write_rows(tmp_path, "cais/mmlu", "all", "test", MMLU_ROWS)
    write_rows(tmp_path, "cais/mmlu", "all", "validation", MMLU_ROWS)
    docs, scores = run_task("mmlu_cf", tmp_path, model, tokenizer)
    assert docs[0].text == "Question: What carries oxygen in blood?\nAnswer:"
    assert docs[0].choices == ("plasma", "red cells", "platelets", "bone")
    expected = [
        (
            MMLU_PREAMBLE.format(r["subject"].replace("_", " "))
            + f"Question: {r['question'].strip()}\nAnswer:",
            r["choices"],
            r["answer"],
        )
        for r in MMLU_ROWS
    ]
    check_scores(scores, hand_count(model, tokenizer, expected, norm=True, uncond=True))


OBQA_ROWS = [
    {
        "id": "1",
        "question_stem": "The sun is responsible for",
        "choices": {
            "text": ["puppies learning", "plants sprouting", "rocks", "ice"],
            "label": list("ABCD"),
        },
        "answerKey": "B",
    },
    {
        "id": "2",
        "question_stem": "A magnet attracts",
        "choices": {"text": ["wood", "glass", "iron nails", "paper"], "label": list("ABCD")},
        "answerKey": "C",
    },
    {
        "id": "3",
        "question_stem": "Water boils at",
        "choices": {"text": ["100 degrees Celsius", "0 C", "5 C", "1 C"], "label": list("ABCD")},
        "answerKey": "A",
    },
]


def test_openbookqa(tmp_path: Path, model: Any, tokenizer: Any) -> None:
    write_rows(tmp_path, "allenai/openbookqa", "main", "test", OBQA_ROWS, fmt="parquet")
    write_rows(tmp_path, "allenai/openbookqa", "main", "validation", OBQA_ROWS, fmt="parquet")
    docs, scores = run_task("openbookqa", tmp_path, model, tokenizer)
    assert docs[0].text == "The sun is responsible for"
    assert [d.answer for d in docs] == [1, 2, 0]
    expected = [(r["question_stem"], r["choices"]["text"], a) for r, a in zip(OBQA_ROWS, [1, 2, 0])]
    check_scores(scores, hand_count(model, tokenizer, expected, norm=True, uncond=False))


PIQA_ROWS = [
    {
        "goal": "Open a jar",
        "sol1": "Twist the lid.",
        "sol2": "Hit it repeatedly with a hammer.",
        "label": 0,
    },
    {"goal": "Dry wet hair", "sol1": "Use a towel.", "sol2": "Use a fork.", "label": 0},
    {"goal": "Cool soup", "sol1": "Boil it longer.", "sol2": "Blow on it.", "label": 1},
    {
        "goal": "Sharpen a pencil",
        "sol1": "Use a sharpener.",
        "sol2": "Soak it in milk overnight.",
        "label": 0,
    },
    {
        "goal": "Light a room",
        "sol1": "Close the curtains.",
        "sol2": "Switch on a lamp.",
        "label": 1,
    },
]


def test_piqa(tmp_path: Path, model: Any, tokenizer: Any) -> None:
    # No subset: any config folder matches (the hub's is "plain_text").
    write_rows(tmp_path, "ybisk/piqa", "plain_text", "validation", PIQA_ROWS)
    write_rows(tmp_path, "ybisk/piqa", "plain_text", "train", PIQA_ROWS[:3])
    docs, scores = run_task("piqa", tmp_path, model, tokenizer)
    assert docs[0].text == "Question: Open a jar\nAnswer:"
    assert docs[0].choices == ("Twist the lid.", "Hit it repeatedly with a hammer.")
    expected = [
        (f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], r["label"]) for r in PIQA_ROWS
    ]
    check_scores(scores, hand_count(model, tokenizer, expected, norm=True, uncond=True))


def test_ceval(tmp_path: Path, model: Any, tokenizer: Any) -> None:
    # Every subject needs its val and dev files; two subjects hold the scored documents.
    scored = {
        "accountant": [
            {
                "id": 0,
                "question": " 下列哪项是资产？ ",
                "A": "现金",
                "B": "负债",
                "C": "费用",
                "D": "收入",
                "answer": "A",
                "explanation": "",
            },
            {
                "id": 1,
                "question": "利润等于？",
                "A": "收入减费用",
                "B": "资产",
                "C": "负债",
                "D": "零",
                "answer": "A",
                "explanation": "",
            },
        ],
        "law": [
            {
                "id": 0,
                "question": "宪法是？",
                "A": "普通法",
                "B": "根本法",
                "C": "习惯",
                "D": "合同",
                "answer": "B",
                "explanation": "",
            },
        ],
    }
    filler = [
        {
            "id": 0,
            "question": "一加一？",
            "A": "一",
            "B": "二",
            "C": "三",
            "D": "四",
            "answer": "B",
            "explanation": "",
        }
    ]
    for i, (subject, _) in enumerate(SUBJECT_MAPPING):
        # The filler documents' answers cycle through the letters.
        val = scored.get(subject, [{**filler[0], "answer": "ABCD"[i % 4]}])
        write_rows(tmp_path, "ceval/ceval-exam", subject, "val", val)
        write_rows(tmp_path, "ceval/ceval-exam", subject, "dev", filler)
    docs, scores = run_task("ceval-valid", tmp_path, model, tokenizer)
    assert len(docs) == len(SUBJECT_MAPPING) - 2 + 3
    assert docs[0].text == (
        "以下是中国关于注册会计师的单项选择题，请选出其中的正确答案。\n\n"
        "下列哪项是资产？\nA. 现金\nB. 负债\nC. 费用\nD. 收入\n答案："
    )
    assert docs[0].category == "注册会计师"
    expected = [(d.text, ["A", "B", "C", "D"], d.answer) for d in docs]
    # accountant x2, then advanced_mathematics (subject 1)
    assert [d.answer for d in docs[:3]] == [0, 0, 1]
    check_scores(scores, hand_count(model, tokenizer, expected, norm=False, uncond=False))
