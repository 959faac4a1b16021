"""HellaSwag (upstream `tasks/hellaswag.rs`): Rowan/hellaswag, validation split scored, train
split for few-shot grouped by activity label; context and endings cleaned as upstream does."""

from __future__ import annotations

import re

from psyche.modeling.eval.document import (
    Document,
    DocumentError,
    field,
    rust_trim,
    string_field,
    string_list,
)
from psyche.modeling.eval.loading import Row
from psyche.modeling.eval.traits import LogLikelihoodTask, Splits, SplitsTask

_BRACKETED = re.compile(r"\[.*?\]")


def preprocess(text: str) -> str:
    """Upstream's `preprocess`: trim, " [title]" -> ". ", drop "[...]", "  " -> " " (one pass)."""
    processed = rust_trim(text)
    processed = processed.replace(" [title]", ". ")
    processed = _BRACKETED.sub("", processed)
    return processed.replace("  ", " ")


def capitalize(text: str) -> str:
    """Upper-case the first character (Rust's `to_uppercase`, which may give several)."""
    return text[:1].upper() + text[1:]


class Hellaswag(SplitsTask, LogLikelihoodTask):
    NAME = "Hellaswag"
    SPLITS = Splits(
        "Rowan/hellaswag", scored="validation", fewshot="train", fewshot_by_category=True
    )

    @classmethod
    def row_to_document(cls, row: Row) -> Document:
        activity_label = string_field(row, "activity_label")
        ctx_a = string_field(row, "ctx_a")
        ctx_b = capitalize(string_field(row, "ctx_b"))
        choices = tuple(preprocess(e) for e in string_list(field(row, "endings"), "endings"))
        label = string_field(row, "label")
        if not label.isascii() or not label.isdigit():
            raise DocumentError(f"label {label!r} is not a number")
        return cls.document(
            preprocess(f"{activity_label}: {ctx_a} {ctx_b}"),
            choices,
            int(label),
            category=activity_label,
        )
