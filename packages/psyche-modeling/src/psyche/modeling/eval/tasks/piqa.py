"""PIQA (upstream `tasks/piqa.rs`): ybisk/piqa, validation split scored, train split for
few-shot; "Question: {goal}\\nAnswer:" with the two solutions."""

from __future__ import annotations

from psyche.modeling.eval.document import Document, int_field, string_field
from psyche.modeling.eval.loading import Row
from psyche.modeling.eval.traits import LogLikelihoodTask, Splits, SplitsTask


class PIQA(SplitsTask, LogLikelihoodTask):
    NAME = "PIQA"
    SPLITS = Splits("ybisk/piqa", scored="validation", fewshot="train")

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        return cls.document(
            f"Question: {string_field(row, 'goal')}\nAnswer:",
            (string_field(row, "sol1"), string_field(row, "sol2")),
            int_field(row, "label"),
        )
