"""What a task hands the harness: one question, its choices and the right one (upstream `traits.rs`).

A document is plain data: every task turns its dataset rows into documents, and the harness builds
prompts and scores from documents alone, so tasks never see a model or a tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ASCII_UPPERCASE: tuple[str, ...] = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")

# Rust's `char::is_whitespace` (the Unicode White_Space property), which `str::trim` strips.
# Python's `str.strip()` also strips U+001C..U+001F, which Rust keeps; prompts follow Rust.
_RUST_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def rust_trim(text: str) -> str:
    """Rust's `str::trim`: upstream trims questions with it before building prompts."""
    return text.strip(_RUST_WHITESPACE)


class DocumentError(ValueError):
    """A dataset row lacks what its task needs (a missing column, an unknown answer key)."""


@dataclass(frozen=True)
class Document:
    """One evaluation item, as upstream's `Document`.

    `text` ends where the answer starts (usually with "Answer:"); each choice is appended after
    one space. `category` groups few-shot examples (MMLU's subject, Hellaswag's activity);
    `cot_content` is MMLU-Pro's worked answer for its few-shot examples.
    """

    text: str
    choices: tuple[str, ...]
    answer: int
    category: str | None
    cot_content: str | None
    eval_name: str


def field(row: Any, name: str) -> object:
    """`row[name]`, or a `DocumentError` that names the column."""
    try:
        return row[name]
    except (KeyError, TypeError, IndexError) as e:
        raise DocumentError(f"dataset row has no column {name!r}") from e


def string_field(row: object, name: str) -> str:
    value = field(row, name)
    if not isinstance(value, str):
        raise DocumentError(f"column {name!r} should be a string, got {type(value).__name__}")
    return value


def int_field(row: object, name: str) -> int:
    value = field(row, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DocumentError(f"column {name!r} should be an integer, got {type(value).__name__}")
    return value


def string_list(value: object, name: str) -> list[str]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise DocumentError(f"column {name!r} should be a list of strings")
    return list(value)


def choices_group(row: object) -> dict[str, object]:
    """The `choices` column of AllenAI's multiple-choice datasets (ARC, OpenBookQA): one group
    of parallel `text` and `label` lists."""
    group = field(row, "choices")
    if not isinstance(group, dict):
        raise DocumentError("column 'choices' should hold 'text' and 'label' lists")
    return group


def choice_texts(group: dict[str, object]) -> tuple[str, ...]:
    return tuple(string_list(group.get("text"), "choices.text"))


def letter_index(letter: str, name: str, letters: int = len(ASCII_UPPERCASE)) -> int:
    """ "A" -> 0, "B" -> 1, ... (the first `letters` letters)."""
    if letter in ASCII_UPPERCASE[:letters]:
        return ASCII_UPPERCASE.index(letter)
    raise DocumentError(f"invalid answer {letter!r} in column {name!r}")


def check_answer(answer: int, choices: tuple[str, ...]) -> int:
    if not 0 <= answer < len(choices):
        raise DocumentError(f"answer {answer} is not one of the {len(choices)} choices")
    return answer
