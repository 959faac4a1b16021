"""MMLU-Pro (upstream `tasks/mmlu_pro.rs`): TIGER-Lab/MMLU-Pro, test split scored by generation
(chain of thought until "Question:", then the last "answer is (X)"), validation split's worked
answers as few-shot examples of the same category."""

from __future__ import annotations

from psyche.modeling.eval.document import (
    Document,
    field,
    letter_index,
    string_field,
    string_list,
)
from psyche.modeling.eval.loading import Row
from psyche.modeling.eval.traits import GenerateUntilTask, Splits, SplitsTask


class MMLUPro(SplitsTask, GenerateUntilTask):
    NAME = "MMLU Pro"
    SPLITS = Splits(
        "TIGER-Lab/MMLU-Pro", scored="test", fewshot="validation", fewshot_by_category=True
    )

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        return cls.document(
            string_field(row, "question"),
            tuple(string_list(field(row, "options"), "options")),
            letter_index(string_field(row, "answer"), "answer"),
            category=string_field(row, "category"),
            cot_content=string_field(row, "cot_content"),
        )

    def get_stop_string(self) -> list[str]:
        return ["Question:"]

    def get_answer_extraction_regex(self) -> str:
        # Matches "answer is A", "answer is (F)", ...
        return r"answer is \(?([ABCDEFGHIJ])\)?"
