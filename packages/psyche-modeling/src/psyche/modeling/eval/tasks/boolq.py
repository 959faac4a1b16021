"""BoolQ (upstream `tasks/boolq.rs`): aps/super_glue subset boolq, validation split scored, train
split for few-shot, "{passage}\\nQuestion: {question}?\\nAnswer:" with choices "no" / "yes"."""

from __future__ import annotations

from psyche.modeling.eval.document import Document, int_field, string_field
from psyche.modeling.eval.loading import Row
from psyche.modeling.eval.traits import LogLikelihoodTask, Splits, SplitsTask


class BoolQ(SplitsTask, LogLikelihoodTask):
    NAME = "BoolQ"
    SPLITS = Splits("aps/super_glue", scored="validation", fewshot="train", subset="boolq")

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        question = string_field(row, "question")
        passage = string_field(row, "passage")
        return cls.document(
            f"{passage}\nQuestion: {question}?\nAnswer:", ("no", "yes"), int_field(row, "label")
        )
