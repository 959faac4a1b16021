"""OpenBookQA (upstream `tasks/openbookqa.rs`): allenai/openbookqa subset main, test split
scored, validation split for few-shot; the bare question stem with the choice texts."""

from __future__ import annotations

from psyche.modeling.eval.document import (
    Document,
    choice_texts,
    choices_group,
    letter_index,
    string_field,
)
from psyche.modeling.eval.loading import Row
from psyche.modeling.eval.traits import LogLikelihoodTask, Splits, SplitsTask


class OpenbookQA(SplitsTask, LogLikelihoodTask):
    NAME = "OpenBookQA"
    SPLITS = Splits("allenai/openbookqa", scored="test", fewshot="validation", subset="main")

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        choices = choice_texts(choices_group(row))
        # Upstream accepts A-D only.
        answer = letter_index(string_field(row, "answerKey"), "answerKey", letters=4)
        return cls.document(string_field(row, "question_stem"), choices, answer)
