"""MMLU (upstream `tasks/mmlu.rs`): cais/mmlu subset all, test split scored, dev split for
few-shot by subject; the question with lettered options, scored on the letters."""

from __future__ import annotations

from psyche.modeling.eval.document import (
    ASCII_UPPERCASE,
    Document,
    check_answer,
    field,
    int_field,
    rust_trim,
    string_field,
    string_list,
)
from psyche.modeling.eval.loading import DatasetSource, Row
from psyche.modeling.eval.traits import LogLikelihoodTask, by_category

REPO = "cais/mmlu"
SUBSET = "all"


def mmlu_preamble(category: str) -> str:
    return f"The following are multiple choice questions (with answers) about {category}.\n\n"


class MMLU(LogLikelihoodTask):
    NAME = "MMLU"

    def __init__(self, test_rows: list[Row], dev_rows: list[Row]) -> None:
        self.name = self.NAME
        self._test = test_rows
        self._dev = dev_rows

    @classmethod
    def load(cls, source: DatasetSource) -> MMLU:
        return cls(source.load(REPO, "test", SUBSET), source.load(REPO, "dev", SUBSET))

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        subject = string_field(row, "subject").replace("_", " ")
        question = rust_trim(string_field(row, "question"))
        options = string_list(field(row, "choices"), "choices")
        lettered = [f"{ASCII_UPPERCASE[i]}. {o}" for i, o in enumerate(options)]
        choices = tuple(ASCII_UPPERCASE[i] for i in range(len(options)))
        return Document(
            text=f"{question}\n{chr(10).join(lettered)}\nAnswer:",
            choices=choices,
            answer=check_answer(int_field(row, "answer"), choices),
            category=subject,
            cot_content=None,
            eval_name=cls.NAME,
        )

    def get_documents(self) -> list[Document]:
        return [self.row_to_document(r) for r in self._test]

    def get_fewshot_documents(self) -> dict[str, list[Document]]:
        return by_category([self.row_to_document(r) for r in self._dev])

    def get_preamble(self, category: str) -> str:
        return mmlu_preamble(category)
