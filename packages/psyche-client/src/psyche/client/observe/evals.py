"""Evaluations between rounds (upstream `shared/client/src/state/evals.rs`): what the client
evaluates. `EvalOptions` is the evaluations' settings as the options give them (`--eval-tasks`,
`--eval-seed`, `--eval-task-max-docs`, `--eval-data-dir`, `--prompt-task`), checked without
loading anything (`problems`); `EvalSettings.from_options` reads the tasks' datasets (blocking),
and `eval_worker.EvalWorker` scores them while the trainer is idle.

    settings = EvalSettings.from_options(options.evals)   # datasets read here (blocking)

A score over fewer documents than its task holds is reported as partial (`split_scores`). This
module imports nothing heavy (`TrainOptions` composes `EvalOptions`): the modeling package's
evaluation code is imported where it is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psyche.modeling.eval import Task, TaskScore


def split_scores(task_scores: Mapping[str, TaskScore]) -> tuple[dict[str, float], frozenset[str]]:
    """Each task's score, and the tasks whose score is partial (over fewer documents than the
    task holds: `--eval-task-max-docs` cut it short, or its first pass is not done). Trackers
    log a partial score under its own name (`psyche.metrics.names.eval_key`)."""
    scores = {name: score.value for name, score in task_scores.items()}
    return scores, frozenset(name for name, score in task_scores.items() if score.partial)


class EvalSetupError(ValueError):
    """`--eval-tasks` names a task whose dataset cannot be read; the message says which."""


@dataclass(frozen=True)
class EvalOptions:
    """The evaluations as the options ask for them (nothing loaded)."""

    tasks: str | None = None
    """Task names, comma-separated (`--eval-tasks`)."""
    seed: int = 42
    """Seed of the few-shot shuffles (`--eval-seed`)."""
    max_docs: int | None = None
    """Documents per task (`--eval-task-max-docs`; all if None)."""
    data_dir: Path | None = None
    """Where the datasets are (`--eval-data-dir`; the Hugging Face hub if None)."""
    prompt_task: bool = False
    """Continue a prompt one token between rounds (`--prompt-task`)."""

    @property
    def enabled(self) -> bool:
        return bool(self.tasks) or self.prompt_task

    def problems(self) -> list[str]:
        """A typo in a task name, or a task option without tasks (datasets are read later)."""
        if self.tasks:
            from psyche.modeling.eval import UnknownTaskError, check_task_names

            try:
                check_task_names(self.tasks)
            except UnknownTaskError as e:
                return [f"--eval-tasks {self.tasks}: {e}"]
        elif self.max_docs is not None or self.data_dir is not None:
            return ["--eval-task-max-docs and --eval-data-dir need --eval-tasks"]
        return []


@dataclass(frozen=True)
class EvalSettings:
    """What the client evaluates: tasks with their datasets loaded, and the prompt task."""

    tasks: tuple[Task, ...]
    max_docs: int | None = None
    prompt_task: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.tasks) or self.prompt_task

    @classmethod
    def from_options(cls, options: EvalOptions) -> EvalSettings:
        """The tasks of `options` (datasets from its `data_dir`, else the Hugging Face hub).
        Blocking: reads the datasets. Raises `EvalSetupError` for a dataset that cannot be
        read."""
        from psyche.modeling.eval import (
            DatasetLoadError,
            DatasetSource,
            UnknownTaskError,
            eval_tasks_from_args,
        )

        tasks: list[Task] = []
        if options.tasks:
            source = DatasetSource(root=Path(options.data_dir) if options.data_dir else None)
            try:
                tasks = eval_tasks_from_args(options.tasks, options.seed, source)
            except (DatasetLoadError, UnknownTaskError) as e:
                raise EvalSetupError(f"--eval-tasks {options.tasks}: {e}") from None
        return cls(tuple(tasks), options.max_docs, options.prompt_task)


__all__ = ["EvalOptions", "EvalSettings", "EvalSetupError", "split_scores"]
