"""Which files make a split (upstream's `Dataset::load_dataset` rules) and reading them."""

from __future__ import annotations

from pathlib import Path

import pytest

from psyche.modeling.eval import DatasetLoadError, DatasetSource, select_split_files

from .eval_support import write_rows

CONVERTED = [
    "ARC-Easy/test/0001.parquet",
    "ARC-Easy/test/0000.parquet",
    "ARC-Easy/train/0000.parquet",
    "ARC-Challenge/test/0000.parquet",
    "README.md",
]


def test_converted_layout_picks_the_subset_and_split_in_name_order() -> None:
    assert select_split_files(CONVERTED, "test", "ARC-Easy") == [
        "ARC-Easy/test/0000.parquet",
        "ARC-Easy/test/0001.parquet",
    ]
    assert select_split_files(CONVERTED, "TRAIN", "ARC-Easy") == ["ARC-Easy/train/0000.parquet"]
    # No subset asked for: every subset's files of the split (stable order for equal names).
    assert select_split_files(CONVERTED, "test", None) == [
        "ARC-Easy/test/0000.parquet",
        "ARC-Challenge/test/0000.parquet",
        "ARC-Easy/test/0001.parquet",
    ]


def test_split_folder_names_count_up_to_their_first_dash() -> None:
    files = ["default/train-part/0000.parquet", "default/validation/0000.parquet"]
    assert select_split_files(files, "train", None) == ["default/train-part/0000.parquet"]
    assert select_split_files(files, "val", None) == []


def test_files_named_after_the_split_when_no_folder_matches() -> None:
    files = ["data/test-00000-of-00001.parquet", "data/validation-00000.parquet", "data/x.jsonl"]
    assert select_split_files(files, "test", None) == ["data/test-00000-of-00001.parquet"]
    # Upstream's prefix rule: "val" also takes "validation..." files in this layout.
    assert select_split_files(files, "val", None) == ["data/validation-00000.parquet"]


def test_local_parquet_and_jsonl_rows_in_file_order(tmp_path: Path) -> None:
    rows_a = [{"q": "a", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "n": 1}]
    rows_b = [{"q": "b", "choices": {"text": ["z"], "label": ["A"]}, "n": 2}]
    write_rows(tmp_path, "org/data", "main", "test", rows_b, fmt="parquet", name="0001")
    write_rows(tmp_path, "org/data", "main", "test", rows_a, fmt="jsonl", name="0000")
    assert DatasetSource(root=tmp_path).load("org/data", "test", "main") == rows_a + rows_b


def test_unreadable_and_empty_files_are_clear_errors(tmp_path: Path) -> None:
    folder = tmp_path / "org" / "data" / "main" / "test"
    folder.mkdir(parents=True)
    (folder / "0000.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetLoadError, match=r"cannot read .*0000\.parquet"):
        DatasetSource(root=tmp_path).load("org/data", "test", "main")
    (folder / "0000.parquet").unlink()
    (folder / "0000.jsonl").write_text("\n")
    with pytest.raises(DatasetLoadError, match="empty dataset: org/data split test subset main"):
        DatasetSource(root=tmp_path).load("org/data", "test", "main")
