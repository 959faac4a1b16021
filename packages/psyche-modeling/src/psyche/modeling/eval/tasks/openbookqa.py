"""OpenBookQA (upstream `tasks/openbookqa.rs`): allenai/openbookqa subset main, test split
scored, validation split for few-shot; the bare question stem with the choice texts."""

from __future__ import annotations

from psyche.modeling.eval.document import (
    Document,
    DocumentError,
    check_answer,
    field,
    letter_index,
    string_field,
    string_list,
)
from psyche.modeling.eval.loading import DatasetSource, Row
from psyche.modeling.eval.traits import LogLikelihoodTask

REPO = "allenai/openbookqa"
SUBSET = "main"


class OpenbookQA(LogLikelihoodTask):
    NAME = "OpenBookQA"

    def __init__(self, test_rows: list[Row], validation_rows: list[Row]) -> None:
        self.name = self.NAME
        self._test = test_rows
        self._validation = validation_rows

    @classmethod
    def load(cls, source: DatasetSource) -> OpenbookQA:
        return cls(source.load(REPO, "test", SUBSET), source.load(REPO, "validation", SUBSET))

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        group = field(row, "choices")
        if not isinstance(group, dict):
            raise DocumentError("column 'choices' should hold 'text' and 'label' lists")
        choices = tuple(string_list(group.get("text"), "choices.text"))
        # Upstream accepts A-D only.
        answer = letter_index(string_field(row, "answerKey"), "answerKey", letters=4)
        return Document(
            text=string_field(row, "question_stem"),
            choices=choices,
            answer=check_answer(answer, choices),
            category=None,
            cot_content=None,
            eval_name=cls.NAME,
        )

    def get_documents(self) -> list[Document]:
        return [self.row_to_document(r) for r in self._test]

    def get_fewshot_documents(self) -> dict[str, list[Document]]:
        return {"default": [self.row_to_document(r) for r in self._validation]}
