"""MMLU CF, MMLU's cloze form (upstream `tasks/mmlu_cf.rs`): cais/mmlu subset all, test split
scored, validation split for few-shot by subject; "Question: ...\\nAnswer:" scored on each
option's full text instead of its letter."""

from __future__ import annotations

from dataclasses import replace

from psyche.modeling.eval.document import Document
from psyche.modeling.eval.loading import Row
from psyche.modeling.eval.tasks.mmlu import MMLU, mmlu_fields


class MMLUCF(MMLU):
    """MMLU's dataset, subject few-shot and preamble; the few-shot examples from the validation
    split, and each option's text scored."""

    NAME = "MMLU CF"
    SPLITS = replace(MMLU.SPLITS, fewshot="validation")

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        question, options, answer, subject = mmlu_fields(row)
        return cls.document(
            f"Question: {question}\nAnswer:", tuple(options), answer, category=subject
        )
