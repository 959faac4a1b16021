"""Dataset rows for the evaluation tasks, from the Hugging Face hub or from a local directory.

Upstream (`shared/eval/src/lib.rs` `load_dataset`, `shared/data-provider/src/dataset.rs`
`Dataset::load_dataset`) downloads a dataset repo at the hub's `refs/convert/parquet` revision,
picks the parquet files of one split (and subset) and reads their rows in file-name order. This
module does the same with the same rules, so every task sees the same rows in the same order:

* files laid out as `<subset>/<split>/*.parquet` (the parquet-converted layout) match when the
  folder's name up to its first `-` is the split (case-insensitive) and, when a subset is asked
  for, the folder above is that subset;
* when no file matches that way, files whose name starts with the split (`test-00000-of-1.parquet`)
  are taken instead;
* the matched files are read in the order of their names without extension (a stable sort).

A `DatasetSource` with a `root` reads the same layout from `root/<repo id>/` (for instance
`root/allenai/ai2_arc/ARC-Easy/test/0000.parquet`) and also accepts JSON lines files
(`*.jsonl`, one row per line) there, which is what the tests write. Without a root, the files are
fetched from the hub with `huggingface_hub` (cached in the usual Hugging Face cache; `HF_TOKEN` is
used when set) and read with pyarrow, both installed by `psyche-modeling[eval]`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

PARQUET_REVISION = "refs/convert/parquet"
ROW_FILE_SUFFIXES = (".parquet", ".jsonl")

Row = dict[str, Any]


class DatasetLoadError(RuntimeError):
    """A task's dataset cannot be found or read (no files for the split, unreadable file, no hub)."""


def select_split_files(paths: Sequence[str], split: str, subset: str | None) -> list[str]:
    """The files of `split` (and `subset`) among `paths` (relative, `/`-separated), in read order.

    Upstream's rules (`Dataset::load_dataset`); see the module docstring.
    """
    candidates = [p for p in paths if PurePosixPath(p).suffix.lower() in ROW_FILE_SUFFIXES]
    chosen: list[str] = []
    for p in candidates:
        parts = PurePosixPath(p).parts
        if len(parts) < 2:
            continue
        parent = parts[-2]
        grandparent = parts[-3] if len(parts) >= 3 else None
        if subset is not None and grandparent != subset:
            continue
        if parent.split("-", 1)[0].lower() == split.lower():
            chosen.append(p)
    if not chosen:
        chosen = [p for p in candidates if PurePosixPath(p).name.startswith(split)]
    return sorted(chosen, key=lambda p: PurePosixPath(p).stem)


def read_rows(path: Path) -> list[Row]:
    """Every row of one parquet or JSON lines file, as plain Python values (structs as dicts)."""
    try:
        if path.suffix.lower() == ".jsonl":
            with open(path, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            if not all(isinstance(r, dict) for r in rows):
                raise DatasetLoadError(f"{path}: every line should hold a JSON object")
            return rows
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DatasetLoadError(
                "reading parquet evaluation datasets needs pyarrow: "
                "pip install 'psyche-modeling[eval]'"
            ) from e
        table_rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
        return table_rows
    except DatasetLoadError:
        raise
    except (OSError, ValueError) as e:
        raise DatasetLoadError(f"cannot read {path}: {e}") from e


@dataclass(frozen=True)
class DatasetSource:
    """Where evaluation datasets come from: `root` (a local directory holding `<repo id>/` folders
    in the hub's layout) or, when None, the Hugging Face hub at `revision`."""

    root: Path | None = None
    revision: str = PARQUET_REVISION

    def load(self, repo_id: str, split: str, subset: str | None = None) -> list[Row]:
        """Rows of one split, in upstream's order. Raises `DatasetLoadError` when there are none."""
        if self.root is not None:
            base = Path(self.root) / repo_id
            if not base.is_dir():
                raise DatasetLoadError(f"no directory {base} for dataset {repo_id}")
            relative = sorted(
                p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()
            )
            files = [base / p for p in select_split_files(relative, split, subset)]
        else:
            files = self._fetch(repo_id, split, subset)
        where = f"{repo_id} split {split}" + (f" subset {subset}" if subset else "")
        if not files:
            raise DatasetLoadError(f"no files for {where}")
        rows = [row for path in files for row in read_rows(path)]
        if not rows:
            raise DatasetLoadError(f"empty dataset: {where}")
        return rows

    def _fetch(self, repo_id: str, split: str, subset: str | None) -> list[Path]:
        from huggingface_hub import hf_hub_download, list_repo_files

        token = os.environ.get("HF_TOKEN")
        try:
            listing = list_repo_files(
                repo_id, repo_type="dataset", revision=self.revision, token=token
            )
            return [
                Path(
                    hf_hub_download(
                        repo_id,
                        name,
                        repo_type="dataset",
                        revision=self.revision,
                        token=token,
                    )
                )
                for name in select_split_files(listing, split, subset)
            ]
        except Exception as e:  # network, auth, missing repo: one clear error for the caller
            raise DatasetLoadError(
                f"cannot fetch dataset {repo_id} ({self.revision}) from the hub: {e}"
            ) from e
