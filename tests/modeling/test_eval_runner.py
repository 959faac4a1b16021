"""`EvalRunner`, what a client runs between rounds: bounded slices that resume where they
stopped and cycle, scores reported once enough documents are in, cancellation from another
thread, the prompt task, and the client flags' parsing."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from psyche.core.running_average import RunningAverage
from psyche.modeling.eval import (
    DatasetLoadError,
    DatasetSource,
    EvalRunner,
    Task,
    UnknownTaskError,
    check_task_names,
    eval_tasks_from_args,
    get_prompt_texts,
    metric_key,
    tasktype_from_name,
)
from psyche.modeling.eval.harness import EvalTaskOptions
from psyche.modeling.eval.runner import fewshot_for

from .eval_support import hand_count, write_rows

PIQA_ROWS = [
    {
        "goal": f"Do thing {i}",
        "sol1": f"Way {i}.",
        "sol2": f"Another longer way {i}.",
        "label": i % 2,
    }
    for i in range(5)
]
BOOLQ_ROWS = [
    {"question": f"is {i} even", "passage": f"The number {i}.", "idx": i, "label": int(i % 2 == 0)}
    for i in range(4)
]


@pytest.fixture
def source(tmp_path: Path) -> DatasetSource:
    write_rows(tmp_path, "ybisk/piqa", "plain_text", "validation", PIQA_ROWS)
    write_rows(tmp_path, "ybisk/piqa", "plain_text", "train", PIQA_ROWS)
    write_rows(tmp_path, "aps/super_glue", "boolq", "validation", BOOLQ_ROWS)
    write_rows(tmp_path, "aps/super_glue", "boolq", "train", BOOLQ_ROWS)
    return DatasetSource(root=tmp_path)


def piqa_runner(source: DatasetSource, tokenizer: Any) -> EvalRunner:
    return EvalRunner.from_args("piqa", tokenizer, source=source, rng=random.Random(0))


def test_slices_resume_cycle_and_report_once_half_the_documents_are_in(
    source: DatasetSource, tokenizer: Any, model: Any
) -> None:
    runner = piqa_runner(source, tokenizer)
    expected = hand_count(
        model,
        tokenizer,
        [
            (f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], r["label"])
            for r in PIQA_ROWS
        ],
        norm=True,
        uncond=True,
    )
    report = runner.run_some(model, max_docs=2)
    assert (report.documents, report.stopped_by) == (2, "max_docs")
    # 2 of 5 documents: under upstream's half (reported above int(0.5 * 5) = 2 samples).
    assert runner.scores() == {}
    assert runner.run_some(model, max_docs=3).documents == 3
    assert runner.scores() == {"PIQA": pytest.approx(expected["acc_norm"])}
    assert runner.all_scores()["PIQA"] == pytest.approx(expected)
    # Seven more documents wrap around twice over the same five: a window of one pass each.
    assert runner.run_some(model, max_docs=7).documents == 7
    assert runner.all_scores()["PIQA"] == pytest.approx(expected)
    assert model.model.training


def test_a_set_cancel_or_a_spent_deadline_scores_nothing(
    source: DatasetSource, tokenizer: Any, model: Any
) -> None:
    runner = piqa_runner(source, tokenizer)
    cancel = threading.Event()
    cancel.set()
    assert runner.run_some(model, cancel=cancel).stopped_by == "cancelled"
    report = runner.run_some(model, seconds=0.0)
    assert (report.documents, report.stopped_by) == (0, "deadline")
    with pytest.raises(ValueError, match="needs max_docs, seconds or cancel"):
        runner.run_some(model)


def test_cancel_from_another_thread_stops_a_running_slice(
    source: DatasetSource, tokenizer: Any, model: Any
) -> None:
    runner = EvalRunner.from_args("piqa,boolq", tokenizer, source=source, rng=random.Random(1))
    cancel = threading.Event()
    reports = []
    worker = threading.Thread(target=lambda: reports.append(runner.run_some(model, cancel=cancel)))
    worker.start()
    deadline = time.monotonic() + 120
    while len(runner.scores()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    cancel.set()
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert reports[0].stopped_by == "cancelled"
    assert reports[0].documents >= 6
    assert set(runner.scores()) == {"PIQA", "BoolQ"}


def test_the_prompt_task_fills_its_buffer_and_hands_it_over(tokenizer: Any, model: Any) -> None:
    runner = EvalRunner([], tokenizer, prompt_task=True, rng=random.Random(3))
    assert 0 <= runner.prompt_index < len(get_prompt_texts()) == 8
    report = runner.run_some(model, seconds=120)
    # 16 tokens (MAX_TOKENS_TO_SEND) wait for the client; then there is nothing to do.
    assert (report.prompt_tokens, report.stopped_by) == (16, "idle")
    tokens = runner.take_prompt_results()
    assert len(tokens) == 16
    assert all(0 <= t < 512 for t in tokens)
    assert runner.take_prompt_results() == []
    assert runner.run_some(model, max_docs=1).prompt_tokens == 16
    same = EvalRunner([], tokenizer, prompt_task=True, rng=random.Random(3))
    same.run_some(model, seconds=120)
    assert same.take_prompt_results() == tokens  # a seeded generator repeats itself


def test_client_flags(source: DatasetSource, tokenizer: Any) -> None:
    # Upstream gives 5 few-shot examples to exactly "mmlu_pro", none to any other spelling.
    tasks = eval_tasks_from_args("piqa,BoolQ", 7, source)
    assert [(t.name, t.num_fewshot, t.random_seed) for t in tasks] == [
        ("PIQA", 0, 7),
        ("BoolQ", 0, 7),
    ]
    assert (fewshot_for("mmlu_pro"), fewshot_for("MMLU Pro")) == (5, 0)
    with pytest.raises(UnknownTaskError, match="unknown evaluation task 'squad'"):
        eval_tasks_from_args("piqa,squad", 42, source)
    # Checked without loading anything, for a command line.
    assert check_task_names("arc_easy,MMLU Pro,ceval-valid") == [
        "arc_easy",
        "MMLU Pro",
        "ceval-valid",
    ]
    with pytest.raises(UnknownTaskError, match="unknown evaluation task 'mmlu pro2'"):
        check_task_names("mmlu,mmlu pro2")
    assert metric_key("ARC-Easy") == "eval/arc_easy"
    assert metric_key("MMLU Pro") == "eval/mmlu_pro"
    assert metric_key("CEval-valid") == "eval/ceval_valid"
    runner = EvalRunner.from_args("piqa,boolq", tokenizer, source=source, eval_task_max_docs=2)
    assert runner.task_names == ["PIQA", "BoolQ"]
    assert runner.prompt is None
    assert runner.prompt_index == 0


def test_missing_datasets_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetLoadError, match=r"no directory .*allenai/ai2_arc"):
        tasktype_from_name("arc_easy", DatasetSource(root=tmp_path))
    write_rows(tmp_path, "allenai/ai2_arc", "ARC-Easy", "train", [{"question": "q"}])
    with pytest.raises(
        DatasetLoadError, match="no files for allenai/ai2_arc split test subset ARC-Easy"
    ):
        tasktype_from_name("arc_easy", DatasetSource(root=tmp_path))


def test_confident_only_holds_back_partial_averages(
    source: DatasetSource, tokenizer: Any, model: Any
) -> None:
    prepared = Task(tasktype_from_name("boolq", source), 0, 42).prepare(tokenizer)
    results = RunningAverage()
    out = prepared.run(EvalTaskOptions(model=model, live_results=results, limit=2))
    # 4 documents: reported after more than int(0.5 * 4) = 2.
    assert out.documents == 2
    assert out.scores == {"acc": 0.0}
    assert results.sample("acc") is None
    prepared.run(
        EvalTaskOptions(
            model=model, live_results=results, skip_and_step_by=(out.next_index, 1), limit=1
        )
    )
    assert results.sample("acc") is not None


def test_a_score_over_fewer_documents_than_its_task_is_partial(
    source: DatasetSource, tokenizer: Any, model: Any
) -> None:
    """Issue 24, item 13: a score reported before a whole pass over the task, or over a task
    that `--eval-task-max-docs` cut short, says so (`TaskScore.partial`); the client logs it
    under its own name. Before, such a score went to the trackers as the task's."""
    runner = piqa_runner(source, tokenizer)
    runner.run_some(model, max_docs=3)  # reported (over half), but 3 of 5 documents
    (score,) = runner.task_scores().values()
    assert (score.documents, score.total, score.partial) == (3, 5, True)
    assert runner.scores() == {"PIQA": score.value}
    runner.run_some(model, max_docs=2)  # the pass is complete
    (score,) = runner.task_scores().values()
    assert (score.documents, score.total, score.partial) == (5, 5, False)
    runner.run_some(model, max_docs=7)  # a window of one pass, whatever the cycling
    assert runner.task_scores()["PIQA"].documents == 5
    # a task cut to 4 of its 5 documents stays partial after any number of passes
    short = EvalRunner.from_args("piqa", tokenizer, source=source, eval_task_max_docs=4)
    short.run_some(model, max_docs=12)
    (score,) = short.task_scores().values()
    assert (score.documents, score.total, score.partial) == (4, 5, True)
