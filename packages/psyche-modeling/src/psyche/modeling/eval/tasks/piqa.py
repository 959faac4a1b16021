"""PIQA (upstream `tasks/piqa.rs`): ybisk/piqa, validation split scored, train split for
few-shot; "Question: {goal}\\nAnswer:" with the two solutions."""

from __future__ import annotations

from psyche.modeling.eval.document import Document, check_answer, int_field, string_field
from psyche.modeling.eval.loading import DatasetSource, Row
from psyche.modeling.eval.traits import LogLikelihoodTask

REPO = "ybisk/piqa"


class PIQA(LogLikelihoodTask):
    NAME = "PIQA"

    def __init__(self, validation_rows: list[Row], train_rows: list[Row]) -> None:
        self.name = self.NAME
        self._validation = validation_rows
        self._train = train_rows

    @classmethod
    def load(cls, source: DatasetSource) -> PIQA:
        return cls(source.load(REPO, "validation"), source.load(REPO, "train"))

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        choices = (string_field(row, "sol1"), string_field(row, "sol2"))
        return Document(
            text=f"Question: {string_field(row, 'goal')}\nAnswer:",
            choices=choices,
            answer=check_answer(int_field(row, "label"), choices),
            category=None,
            cot_content=None,
            eval_name=cls.NAME,
        )

    def get_documents(self) -> list[Document]:
        return [self.row_to_document(r) for r in self._validation]

    def get_fewshot_documents(self) -> dict[str, list[Document]]:
        return {"default": [self.row_to_document(r) for r in self._train]}
