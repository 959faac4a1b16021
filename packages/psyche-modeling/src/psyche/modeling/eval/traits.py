"""The two kinds of task upstream has (`traits.rs`): scored by comparing the loglikelihoods of
fixed choices, or by generating an answer and extracting a letter from it."""

from __future__ import annotations

from abc import ABC, abstractmethod

from psyche.modeling.eval.document import Document


class LogLikelihoodTask(ABC):
    """Documents (the scored ones) and few-shot documents by category (`"default"` when the task
    has no categories)."""

    name: str

    @abstractmethod
    def get_documents(self) -> list[Document]: ...

    @abstractmethod
    def get_fewshot_documents(self) -> dict[str, list[Document]]: ...

    def get_preamble(self, category: str) -> str:
        return ""

    def __str__(self) -> str:
        return self.name


class GenerateUntilTask(ABC):
    """Documents answered by free generation until a stop string, then a regex's first group."""

    name: str

    @abstractmethod
    def get_documents(self) -> list[Document]: ...

    @abstractmethod
    def get_fewshot_documents(self) -> dict[str, list[Document]]: ...

    @abstractmethod
    def get_stop_string(self) -> list[str]: ...

    @abstractmethod
    def get_answer_extraction_regex(self) -> str: ...

    def __str__(self) -> str:
        return self.name


TaskType = LogLikelihoodTask | GenerateUntilTask


def by_category(documents: list[Document]) -> dict[str, list[Document]]:
    """Documents grouped by category in first-seen order (documents without one are dropped,
    as upstream's `if let Some(category)`)."""
    groups: dict[str, list[Document]] = {}
    for doc in documents:
        if doc.category is not None:
            groups.setdefault(doc.category, []).append(doc)
    return groups
