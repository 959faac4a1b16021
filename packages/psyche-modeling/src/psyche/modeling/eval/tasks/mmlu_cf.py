"""MMLU CF, MMLU's cloze form (upstream `tasks/mmlu_cf.rs`): cais/mmlu subset all, test split
scored, validation split for few-shot by subject; "Question: ...\\nAnswer:" scored on each
option's full text instead of its letter."""

from __future__ import annotations

from psyche.modeling.eval.document import (
    Document,
    field,
    int_field,
    rust_trim,
    string_field,
    string_list,
)
from psyche.modeling.eval.loading import Row
from psyche.modeling.eval.tasks.mmlu import MMLU, mmlu_preamble
from psyche.modeling.eval.traits import LogLikelihoodTask, SplitsTask


class MMLUCF(SplitsTask, LogLikelihoodTask):
    NAME = "MMLU CF"
    REPO = MMLU.REPO
    SUBSET = MMLU.SUBSET
    SCORED_SPLIT = "test"
    FEWSHOT_SPLIT = "validation"
    FEWSHOT_BY_CATEGORY = True

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        question = rust_trim(string_field(row, "question"))
        return cls.document(
            f"Question: {question}\nAnswer:",
            tuple(string_list(field(row, "choices"), "choices")),
            int_field(row, "answer"),
            category=string_field(row, "subject").replace("_", " "),
        )

    def get_preamble(self, category: str) -> str:
        return mmlu_preamble(category)
