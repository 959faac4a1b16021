"""The two kinds of task upstream has (`traits.rs`): scored by comparing the loglikelihoods of
fixed choices, or by generating an answer and extracting a letter from it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Self

from psyche.modeling.eval.document import Document, check_answer
from psyche.modeling.eval.loading import DatasetSource, Row


class EvalTask(ABC):
    """What both kinds of task have: a name, the scored documents, and the few-shot documents by
    category (`"default"` when the task has no categories)."""

    name: str

    @abstractmethod
    def get_documents(self) -> list[Document]: ...

    @abstractmethod
    def get_fewshot_documents(self) -> dict[str, list[Document]]: ...

    def __str__(self) -> str:
        return self.name


class LogLikelihoodTask(EvalTask):
    """Scored by the loglikelihoods of fixed choices, after a category's preamble."""

    def get_preamble(self, category: str) -> str:
        return ""


class GenerateUntilTask(EvalTask):
    """Documents answered by free generation until a stop string, then a regex's first group."""

    @abstractmethod
    def get_stop_string(self) -> list[str]: ...

    @abstractmethod
    def get_answer_extraction_regex(self) -> str: ...


TaskType = LogLikelihoodTask | GenerateUntilTask


def by_category(documents: list[Document]) -> dict[str, list[Document]]:
    """Documents grouped by category in first-seen order (documents without one are dropped,
    as upstream's `if let Some(category)`)."""
    groups: dict[str, list[Document]] = {}
    for doc in documents:
        if doc.category is not None:
            groups.setdefault(doc.category, []).append(doc)
    return groups


@dataclass(frozen=True)
class Splits:
    """Where a `SplitsTask`'s rows come from: the dataset (`repo`, `subset`), the split whose
    rows are scored and the split whose rows are the few-shot examples, grouped by category when
    `fewshot_by_category` (else all under "default", as upstream)."""

    repo: str
    scored: str
    fewshot: str
    subset: str | None = None
    fewshot_by_category: bool = False


class SplitsTask:
    """A task over two splits of one dataset (`SPLITS`): a task names them and says how one row
    becomes a document (`row_to_document`); mixed in before `LogLikelihoodTask` or
    `GenerateUntilTask`."""

    NAME: ClassVar[str]
    SPLITS: ClassVar[Splits]

    def __init__(self, scored_rows: list[Row], fewshot_rows: list[Row]) -> None:
        self.name = self.NAME
        self._scored = scored_rows
        self._fewshot = fewshot_rows

    @classmethod
    def load(cls, source: DatasetSource) -> Self:
        splits = cls.SPLITS
        return cls(
            source.load(splits.repo, splits.scored, splits.subset),
            source.load(splits.repo, splits.fewshot, splits.subset),
        )

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        raise NotImplementedError

    @classmethod
    def document(
        cls,
        text: str,
        choices: tuple[str, ...],
        answer: int,
        *,
        category: str | None = None,
        cot_content: str | None = None,
    ) -> Document:
        """This task's document; `answer` (an index into `choices`) is checked."""
        return Document(
            text=text,
            choices=choices,
            answer=check_answer(answer, choices),
            category=category,
            cot_content=cot_content,
            eval_name=cls.NAME,
        )

    def get_documents(self) -> list[Document]:
        return [self.row_to_document(r) for r in self._scored]

    def get_fewshot_documents(self) -> dict[str, list[Document]]:
        documents = [self.row_to_document(r) for r in self._fewshot]
        if self.SPLITS.fewshot_by_category:
            return by_category(documents)
        return {"default": documents}
