"""ARC-Easy and ARC-Challenge (upstream `tasks/arc.rs`): allenai/ai2_arc, test split scored,
train split for few-shot, "Question: ...\\nAnswer:" with the choice texts."""

from __future__ import annotations

from psyche.modeling.eval.document import (
    Document,
    DocumentError,
    check_answer,
    field,
    string_field,
    string_list,
)
from psyche.modeling.eval.loading import DatasetSource, Row
from psyche.modeling.eval.traits import LogLikelihoodTask

REPO = "allenai/ai2_arc"


def row_to_document(row: Row, name: str) -> Document:
    question = string_field(row, "question")
    choices_and_labels = field(row, "choices")
    if not isinstance(choices_and_labels, dict):
        raise DocumentError("column 'choices' should hold 'text' and 'label' lists")
    choices = tuple(string_list(choices_and_labels.get("text"), "choices.text"))
    labels = string_list(choices_and_labels.get("label"), "choices.label")
    answer_key = string_field(row, "answerKey")
    if answer_key not in labels:
        raise DocumentError(f"answerKey {answer_key!r} is not one of the labels {labels}")
    return Document(
        text=f"Question: {question}\nAnswer:",
        choices=choices,
        answer=check_answer(labels.index(answer_key), choices),
        category=None,
        cot_content=None,
        eval_name=name,
    )


class Arc(LogLikelihoodTask):
    """One ARC subset; `name` is the subset ("ARC-Easy" or "ARC-Challenge")."""

    def __init__(self, name: str, test_rows: list[Row], train_rows: list[Row]) -> None:
        self.name = name
        self._test = test_rows
        self._train = train_rows

    @classmethod
    def load_subset(cls, name: str, source: DatasetSource) -> Arc:
        return cls(
            name,
            source.load(REPO, "test", name),
            source.load(REPO, "train", name),
        )

    def get_documents(self) -> list[Document]:
        return [row_to_document(r, self.name) for r in self._test]

    def get_fewshot_documents(self) -> dict[str, list[Document]]:
        return {"default": [row_to_document(r, self.name) for r in self._train]}


class ArcEasy(Arc):
    NAME = "ARC-Easy"

    @classmethod
    def load(cls, source: DatasetSource) -> Arc:
        return Arc.load_subset(cls.NAME, source)


class ArcChallenge(Arc):
    NAME = "ARC-Challenge"

    @classmethod
    def load(cls, source: DatasetSource) -> Arc:
        return Arc.load_subset(cls.NAME, source)
