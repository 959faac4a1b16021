"""Evaluations during training, as upstream's `shared/eval`: ARC-Easy, ARC-Challenge, BoolQ,
HellaSwag, MMLU, MMLU CF, MMLU Pro, OpenBookQA, PIQA and C-Eval scored the way upstream scores
them, and the prompt task.

    from psyche.modeling.eval import DatasetSource, EvalRunner

    runner = EvalRunner.from_args("arc_easy,hellaswag", tokenizer, eval_task_max_docs=100)
    runner.run_some(model, seconds=5.0, cancel=stop_event)   # between rounds, in a thread
    runner.scores()                                          # {"ARC-Easy": 0.41, ...}

Datasets come from the Hugging Face hub (`pip install 'psyche-modeling[eval]'`) or from a local
directory in the hub's layout (`DatasetSource(root=...)`). Importing this package is cheap.
"""

from __future__ import annotations

from psyche.core.lazy import lazy_exports

_EXPORTS = {
    "ASCII_UPPERCASE": ".document",
    "Document": ".document",
    "DocumentError": ".document",
    "DatasetLoadError": ".loading",
    "DatasetSource": ".loading",
    "select_split_files": ".loading",
    "LogLikelihoodTask": ".traits",
    "GenerateUntilTask": ".traits",
    "ALL_TASK_NAMES": ".tasks",
    "UnknownTaskError": ".tasks",
    "canonical_task_name": ".tasks",
    "check_task_names": ".tasks",
    "tasktype_from_name": ".tasks",
    "EvalTaskOptions": ".harness",
    "PreparedTask": ".harness",
    "PreparedTaskResult": ".harness",
    "Task": ".harness",
    "PromptTask": ".prompt",
    "PROMPT_TASK_NAME": ".prompt",
    "get_prompt_texts": ".prompt",
    "DEFAULT_EVAL_SEED": ".runner",
    "EvalRunner": ".runner",
    "RunReport": ".runner",
    "TaskScore": ".runner",
    "eval_tasks_from_args": ".runner",
    "evaluate": ".runner",
    "metric_key": ".runner",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
