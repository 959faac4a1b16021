"""MMLU-Pro (upstream `tasks/mmlu_pro.rs`): TIGER-Lab/MMLU-Pro, test split scored by generation
(chain of thought until "Question:", then the last "answer is (X)"), validation split's worked
answers as few-shot examples of the same category."""

from __future__ import annotations

from psyche.modeling.eval.document import (
    Document,
    check_answer,
    field,
    letter_index,
    string_field,
    string_list,
)
from psyche.modeling.eval.loading import DatasetSource, Row
from psyche.modeling.eval.traits import GenerateUntilTask, by_category

REPO = "TIGER-Lab/MMLU-Pro"


class MMLUPro(GenerateUntilTask):
    NAME = "MMLU Pro"

    def __init__(self, test_rows: list[Row], validation_rows: list[Row]) -> None:
        self.name = self.NAME
        self._test = test_rows
        self._validation = validation_rows

    @classmethod
    def load(cls, source: DatasetSource) -> MMLUPro:
        return cls(source.load(REPO, "test"), source.load(REPO, "validation"))

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        choices = tuple(string_list(field(row, "options"), "options"))
        return Document(
            text=string_field(row, "question"),
            choices=choices,
            answer=check_answer(letter_index(string_field(row, "answer"), "answer"), choices),
            category=string_field(row, "category"),
            cot_content=string_field(row, "cot_content"),
            eval_name=cls.NAME,
        )

    def get_documents(self) -> list[Document]:
        return [self.row_to_document(r) for r in self._test]

    def get_fewshot_documents(self) -> dict[str, list[Document]]:
        return by_category([self.row_to_document(r) for r in self._validation])

    def get_stop_string(self) -> list[str]:
        return ["Question:"]

    def get_answer_extraction_regex(self) -> str:
        # Matches "answer is A", "answer is (F)", ...
        return r"answer is \(?([ABCDEFGHIJ])\)?"
