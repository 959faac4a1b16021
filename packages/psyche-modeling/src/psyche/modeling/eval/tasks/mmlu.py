"""MMLU (upstream `tasks/mmlu.rs`): cais/mmlu subset all, test split scored, dev split for
few-shot by subject; the question with lettered options, scored on the letters."""

from __future__ import annotations

from psyche.modeling.eval.document import (
    ASCII_UPPERCASE,
    Document,
    field,
    int_field,
    rust_trim,
    string_field,
    string_list,
)
from psyche.modeling.eval.loading import Row
from psyche.modeling.eval.traits import LogLikelihoodTask, Splits, SplitsTask


def mmlu_fields(row: Row) -> tuple[str, list[str], int, str]:
    """A cais/mmlu row's question (trimmed), options, answer index and subject (its category)."""
    return (
        rust_trim(string_field(row, "question")),
        string_list(field(row, "choices"), "choices"),
        int_field(row, "answer"),
        string_field(row, "subject").replace("_", " "),
    )


def mmlu_preamble(category: str) -> str:
    return f"The following are multiple choice questions (with answers) about {category}.\n\n"


class MMLU(SplitsTask, LogLikelihoodTask):
    NAME = "MMLU"
    SPLITS = Splits(
        "cais/mmlu", scored="test", fewshot="dev", subset="all", fewshot_by_category=True
    )

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        question, options, answer, subject = mmlu_fields(row)
        lettered = [f"{ASCII_UPPERCASE[i]}. {o}" for i, o in enumerate(options)]
        return cls.document(
            f"{question}\n{chr(10).join(lettered)}\nAnswer:",
            tuple(ASCII_UPPERCASE[i] for i in range(len(options))),
            answer,
            category=subject,
        )

    def get_preamble(self, category: str) -> str:
        return mmlu_preamble(category)
