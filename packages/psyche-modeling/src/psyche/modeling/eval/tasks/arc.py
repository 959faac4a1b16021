"""ARC-Easy and ARC-Challenge (upstream `tasks/arc.rs`): allenai/ai2_arc, test split scored,
train split for few-shot, "Question: ...\\nAnswer:" with the choice texts."""

from __future__ import annotations

from dataclasses import replace

from psyche.modeling.eval.document import (
    Document,
    DocumentError,
    choice_texts,
    choices_group,
    string_field,
    string_list,
)
from psyche.modeling.eval.loading import Row
from psyche.modeling.eval.traits import LogLikelihoodTask, Splits, SplitsTask


class Arc(SplitsTask, LogLikelihoodTask):
    """One ARC subset, named as the subset ("ARC-Easy" or "ARC-Challenge")."""

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        question = string_field(row, "question")
        group = choices_group(row)
        choices = choice_texts(group)
        labels = string_list(group.get("label"), "choices.label")
        answer_key = string_field(row, "answerKey")
        if answer_key not in labels:
            raise DocumentError(f"answerKey {answer_key!r} is not one of the labels {labels}")
        return cls.document(f"Question: {question}\nAnswer:", choices, labels.index(answer_key))


class ArcEasy(Arc):
    NAME = "ARC-Easy"
    SPLITS = Splits("allenai/ai2_arc", scored="test", fewshot="train", subset=NAME)


class ArcChallenge(Arc):
    NAME = "ARC-Challenge"
    SPLITS = replace(ArcEasy.SPLITS, subset=NAME)
