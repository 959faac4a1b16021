"""MMLU CF, MMLU's cloze form (upstream `tasks/mmlu_cf.rs`): cais/mmlu subset all, test split
scored, validation split for few-shot by subject; "Question: ...\\nAnswer:" scored on each
option's full text instead of its letter."""

from __future__ import annotations

from psyche.modeling.eval.document import (
    Document,
    check_answer,
    field,
    int_field,
    rust_trim,
    string_field,
    string_list,
)
from psyche.modeling.eval.loading import DatasetSource, Row
from psyche.modeling.eval.tasks.mmlu import REPO, SUBSET, mmlu_preamble
from psyche.modeling.eval.traits import LogLikelihoodTask, by_category


class MMLUCF(LogLikelihoodTask):
    NAME = "MMLU CF"

    def __init__(self, test_rows: list[Row], validation_rows: list[Row]) -> None:
        self.name = self.NAME
        self._test = test_rows
        self._validation = validation_rows

    @classmethod
    def load(cls, source: DatasetSource) -> MMLUCF:
        return cls(source.load(REPO, "test", SUBSET), source.load(REPO, "validation", SUBSET))

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        subject = string_field(row, "subject").replace("_", " ")
        question = rust_trim(string_field(row, "question"))
        choices = tuple(string_list(field(row, "choices"), "choices"))
        return Document(
            text=f"Question: {question}\nAnswer:",
            choices=choices,
            answer=check_answer(int_field(row, "answer"), choices),
            category=subject,
            cot_content=None,
            eval_name=cls.NAME,
        )

    def get_documents(self) -> list[Document]:
        return [self.row_to_document(r) for r in self._test]

    def get_fewshot_documents(self) -> dict[str, list[Document]]:
        return by_category([self.row_to_document(r) for r in self._validation])

    def get_preamble(self, category: str) -> str:
        return mmlu_preamble(category)
