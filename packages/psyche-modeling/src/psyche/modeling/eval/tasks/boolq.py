"""BoolQ (upstream `tasks/boolq.rs`): aps/super_glue subset boolq, validation split scored, train
split for few-shot, "{passage}\\nQuestion: {question}?\\nAnswer:" with choices "no" / "yes"."""

from __future__ import annotations

from psyche.modeling.eval.document import Document, check_answer, int_field, string_field
from psyche.modeling.eval.loading import DatasetSource, Row
from psyche.modeling.eval.traits import LogLikelihoodTask

REPO = "aps/super_glue"
SUBSET = "boolq"


class BoolQ(LogLikelihoodTask):
    NAME = "BoolQ"

    def __init__(self, validation_rows: list[Row], train_rows: list[Row]) -> None:
        self.name = self.NAME
        self._validation = validation_rows
        self._train = train_rows

    @classmethod
    def load(cls, source: DatasetSource) -> BoolQ:
        return cls(source.load(REPO, "validation", SUBSET), source.load(REPO, "train", SUBSET))

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        question = string_field(row, "question")
        passage = string_field(row, "passage")
        choices = ("no", "yes")
        return Document(
            text=f"{passage}\nQuestion: {question}?\nAnswer:",
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
