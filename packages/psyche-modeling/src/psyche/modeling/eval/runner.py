"""Evaluations between rounds: what a client runs while it waits (upstream's `ModelTaskRunner`,
`shared/client/src/state/evals.rs`), and a whole evaluation at once (`examples/evaluate.rs`).

`EvalRunner.run_some` does a bounded slice of work and returns: it visits the tasks in a random
order, scores up to 10 documents of each from where that task stopped last time (documents
cycle, so scores become a moving average over the latest pass), generates one prompt token per
visit, and stops between documents when its document budget is spent, its time is up or its
cancel token is set. A client calls it in a worker thread once its round's training is done and
sets the token when the next round's training starts, as upstream cancels its evaluation thread;
`scores()` is safe to read from other threads meanwhile.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psyche.core.running_average import RunningAverage
from psyche.modeling.causal_lm import CausalLM
from psyche.modeling.eval.harness import EvalTaskOptions, PreparedTask, Task
from psyche.modeling.eval.loading import DatasetSource
from psyche.modeling.eval.prompt import PromptTask
from psyche.modeling.eval.tasks import canonical_task_name, tasktype_from_name
from psyche.modeling.trainer import CancelToken

DEFAULT_EVAL_SEED = 42
DOCS_PER_TURN = 10
"""Documents of one task per visit (upstream's `limit`; its 1 for MMLU Pro never applies, since
it compares against "mmlu_pro" while the task is called "MMLU Pro")."""


def fewshot_for(task_arg: str) -> int:
    """Upstream's few-shot count for a `--eval-tasks` entry: 5 for exactly `mmlu_pro`, else 0."""
    return 5 if task_arg == "mmlu_pro" else 0


def eval_tasks_from_args(
    eval_tasks: str, eval_seed: int = DEFAULT_EVAL_SEED, source: DatasetSource | None = None
) -> list[Task]:
    """The tasks of a comma-separated `--eval-tasks` value (upstream `eval_tasks_from_args`);
    loads their datasets. Raises `UnknownTaskError` or `DatasetLoadError`."""
    return [
        Task(tasktype_from_name(arg, source), fewshot_for(arg), eval_seed)
        for arg in eval_tasks.split(",")
    ]


def metric_key(task_name: str) -> str:
    """A tracker's key for a task's score (upstream logs `eval/<lower-case, _ for the rest>`)."""
    return f"eval/{canonical_task_name(task_name)}"


@dataclass
class _RunningTask:
    task: PreparedTask
    results: RunningAverage
    next_index: int = 0


@dataclass(frozen=True)
class TaskScore:
    """A task's reported score: its value, how many documents it averages and how many the
    task holds. Partial when fewer: `--eval-task-max-docs` cut the task short, or its first
    pass is not done; a tracker must not show it as the task's score."""

    value: float
    documents: int
    total: int

    @property
    def partial(self) -> bool:
        return self.documents < self.total


@dataclass(frozen=True)
class RunReport:
    """What one `run_some` did: documents scored, prompt tokens generated, seconds, and why it
    returned ("max_docs", "deadline", "cancelled", or "idle": nothing left that it could do)."""

    documents: int
    prompt_tokens: int
    seconds: float
    stopped_by: str


class EvalRunner:
    """Prepared tasks (tokenized once), their live scores, and the optional prompt task.

    One `run_some` at a time; `scores`, `all_scores` and the prompt accessors may be called
    concurrently from another thread.
    """

    def __init__(
        self,
        tasks: Sequence[Task],
        tokenizer: Any,
        *,
        max_docs: int | None = None,
        prompt_task: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        self._rng = rng or random.Random()
        self._tasks = [
            _RunningTask(task.prepare(tokenizer, max_docs), RunningAverage()) for task in tasks
        ]
        self.prompt: PromptTask | None = (
            PromptTask.random(tokenizer, self._rng) if prompt_task else None
        )

    @classmethod
    def from_args(
        cls,
        eval_tasks: str | None,
        tokenizer: Any,
        *,
        eval_seed: int = DEFAULT_EVAL_SEED,
        eval_task_max_docs: int | None = None,
        prompt_task: bool = False,
        source: DatasetSource | None = None,
        rng: random.Random | None = None,
    ) -> EvalRunner:
        """A runner for the client's flags (`--eval-tasks`, `--eval-seed`,
        `--eval-task-max-docs`, `--prompt-task`). Blocking: loads and tokenizes datasets."""
        tasks = eval_tasks_from_args(eval_tasks, eval_seed, source) if eval_tasks else []
        return cls(tasks, tokenizer, max_docs=eval_task_max_docs, prompt_task=prompt_task, rng=rng)

    @property
    def task_names(self) -> list[str]:
        return [t.task.name for t in self._tasks]

    @property
    def prompt_index(self) -> int:
        """The prompt being continued (0 without a prompt task, as upstream)."""
        return 0 if self.prompt is None else self.prompt.selected_prompt

    def take_prompt_results(self) -> list[int]:
        return [] if self.prompt is None else self.prompt.take_results()

    def scores(self) -> dict[str, float]:
        """Each task's main metric (acc_norm where upstream has it, else acc), for the tasks
        with enough documents scored to report (upstream `current_eval_results`)."""
        return {name: score.value for name, score in self.task_scores().items()}

    def task_scores(self) -> dict[str, TaskScore]:
        """`scores` with how many documents each averages and how many its task holds."""
        out = {}
        for t in self._tasks:
            metric = t.task.main_metric_name()
            value = t.results.sample(metric)
            if value is not None:
                # the average is over the last `num` documents (its window), once that many
                documents = min(t.results.all_time_pushes(metric) or 0, t.task.num)
                total = t.task.num if t.task.total_docs is None else t.task.total_docs
                out[t.task.name] = TaskScore(value, documents, total)
        return out

    def all_scores(self) -> dict[str, dict[str, float]]:
        """Every reported metric of every task."""
        return {
            t.task.name: {k: v for k, v in t.results.get_all_averages().items() if v is not None}
            for t in self._tasks
        }

    def run_some(
        self,
        model: CausalLM,
        *,
        max_docs: int | None = None,
        seconds: float | None = None,
        cancel: CancelToken | None = None,
    ) -> RunReport:
        """Score at most `max_docs` documents, for at most about `seconds` (checked between
        documents and generated tokens), until `cancel` is set. At least one bound is needed."""
        if max_docs is None and seconds is None and cancel is None:
            raise ValueError("run_some needs max_docs, seconds or cancel")
        start = time.monotonic()
        deadline = None if seconds is None else start + seconds
        docs = tokens = 0

        def report(stopped_by: str) -> RunReport:
            return RunReport(docs, tokens, time.monotonic() - start, stopped_by)

        units: list[_RunningTask | PromptTask] = [*self._tasks]
        if self.prompt is not None:
            units.append(self.prompt)
        while True:
            progressed = False
            self._rng.shuffle(units)
            for unit in units:
                if cancel is not None and cancel.is_set():
                    return report("cancelled")
                if deadline is not None and time.monotonic() >= deadline:
                    return report("deadline")
                if max_docs is not None and docs >= max_docs:
                    return report("max_docs")
                if isinstance(unit, PromptTask):
                    if unit.run(model, cancel):
                        tokens += 1
                        progressed = True
                    continue
                limit = DOCS_PER_TURN if max_docs is None else min(DOCS_PER_TURN, max_docs - docs)
                result = unit.task.run(
                    EvalTaskOptions(
                        model=model,
                        skip_and_step_by=(unit.next_index, 1),
                        live_results=unit.results,
                        cancel=cancel,
                        limit=limit,
                        deadline=deadline,
                    )
                )
                unit.next_index = result.next_index
                docs += result.documents
                progressed = progressed or result.documents > 0
            if not progressed:
                return report("idle")


def evaluate(
    tasks: Sequence[Task],
    model: CausalLM,
    tokenizer: Any,
    *,
    limit: int | None = None,
) -> dict[str, dict[str, float]]:
    """Every document of every task once, start to end (upstream's evaluate example with one
    GPU): each task's averages over all its scored documents."""
    out = {}
    for task in tasks:
        results = RunningAverage()
        task.prepare(tokenizer).run(
            EvalTaskOptions(model=model, live_results=results, limit=limit, confident_only=False)
        )
        out[task.name] = {
            k: (0.0 if v is None else v) for k, v in results.get_all_averages().items()
        }
    return out
