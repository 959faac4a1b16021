"""Upstream's evaluation tasks (`shared/eval/src/tasks`) and how a task name picks one."""

from __future__ import annotations

from collections.abc import Callable

from psyche.modeling.eval.loading import DatasetSource
from psyche.modeling.eval.tasks.arc import ArcChallenge, ArcEasy
from psyche.modeling.eval.tasks.boolq import BoolQ
from psyche.modeling.eval.tasks.ceval import CEval
from psyche.modeling.eval.tasks.hellaswag import Hellaswag
from psyche.modeling.eval.tasks.mmlu import MMLU
from psyche.modeling.eval.tasks.mmlu_cf import MMLUCF
from psyche.modeling.eval.tasks.mmlu_pro import MMLUPro
from psyche.modeling.eval.tasks.openbookqa import OpenbookQA
from psyche.modeling.eval.tasks.piqa import PIQA
from psyche.modeling.eval.traits import TaskType

__all__ = [
    "ALL_TASK_NAMES",
    "MMLU",
    "MMLUCF",
    "PIQA",
    "ArcChallenge",
    "ArcEasy",
    "BoolQ",
    "CEval",
    "Hellaswag",
    "MMLUPro",
    "OpenbookQA",
    "UnknownTaskError",
    "canonical_task_name",
    "check_task_names",
    "tasktype_from_name",
]

# Upstream's `ALL_TASK_NAMES` order.
_TASKS: tuple[tuple[str, Callable[[DatasetSource], TaskType]], ...] = (
    (ArcChallenge.NAME, ArcChallenge.load),
    (ArcEasy.NAME, ArcEasy.load),
    (BoolQ.NAME, BoolQ.load),
    (CEval.NAME, CEval.load),
    (Hellaswag.NAME, Hellaswag.load),
    (MMLUPro.NAME, MMLUPro.load),
    (MMLU.NAME, MMLU.load),
    (MMLUCF.NAME, MMLUCF.load),
    (OpenbookQA.NAME, OpenbookQA.load),
    (PIQA.NAME, PIQA.load),
)

ALL_TASK_NAMES: tuple[str, ...] = tuple(name for name, _ in _TASKS)


class UnknownTaskError(ValueError):
    """A task name that is none of upstream's."""


def canonical_task_name(name: str) -> str:
    """Upstream's key for a name: lower case, every non-alphanumeric ASCII character `_`
    ("ARC-Easy" and "arc_easy" are both `arc_easy`, "MMLU Pro" is `mmlu_pro`)."""
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in name.lower())


_BY_KEY = {canonical_task_name(name): load for name, load in _TASKS}


def check_task_names(eval_tasks: str) -> list[str]:
    """The task names of a comma-separated `--eval-tasks` value, each checked against
    `ALL_TASK_NAMES` without loading anything (for a command line to refuse a typo at once)."""
    names = eval_tasks.split(",")
    for name in names:
        if canonical_task_name(name) not in _BY_KEY:
            raise UnknownTaskError(
                f"unknown evaluation task {name!r}; expected one of {', '.join(ALL_TASK_NAMES)}"
            )
    return names


def tasktype_from_name(name: str, source: DatasetSource | None = None) -> TaskType:
    """Load the task called `name` (any spelling `canonical_task_name` maps to one of
    `ALL_TASK_NAMES`) with its datasets from `source` (the hub by default)."""
    load = _BY_KEY.get(canonical_task_name(name))
    if load is None:
        raise UnknownTaskError(
            f"unknown evaluation task {name!r}; expected one of {', '.join(ALL_TASK_NAMES)}"
        )
    return load(source or DatasetSource())
