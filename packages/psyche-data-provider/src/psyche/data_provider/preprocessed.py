"""Already-packed samples from parquet files (upstream `PreprocessedDataProvider` and `Dataset`).

Each row is one sample: a required `inputs` list of exactly `seq_len` integers and optional
`labels`, `position_ids` (same length) and `sequence_lengths` (any length). Files are chosen by
upstream's split rules: first the Hugging Face parquet-converter layout (`<subset>/<split>-*/x.parquet`),
else any parquet file whose name starts with the split. The whole dataset is held in memory, as
upstream does, and batch ids wrap around its length.
"""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.rng import ChaCha8Rng, shuffle_permutation
from psyche.data_provider.local import data_directory
from psyche.data_provider.types import (
    PARQUET_EXTENSION,
    DataProviderError,
    TokenizedData,
    batch_bounds,
)


class Split(Enum):
    Train = "train"
    Validation = "validation"
    Test = "test"
    Dev = "dev"
    Val = "val"

    def __str__(self) -> str:
        return self.value


# The order in which a split is guessed when none is asked for.
SPLITS = (Split.Train, Split.Test, Split.Validation, Split.Dev, Split.Val)


def _is_parquet(path: Path) -> bool:
    return path.suffix[1:].lower() == PARQUET_EXTENSION


def select_dataset_files(
    files: list[Path], split: Split | None, subset: str | None
) -> tuple[list[Path], Split]:
    """Upstream `Dataset::load_dataset`'s choice of files and split (files sorted by stem)."""
    chosen: list[Path] = []
    for file in files:
        if not _is_parquet(file):
            continue
        split_dir, subset_dir = file.parent.name, file.parent.parent.name
        if subset is not None and subset_dir != subset:
            continue
        actual = split_dir.split("-")[0].lower()
        if split is not None:
            if actual == split.value:
                chosen.append(file)
        else:
            for candidate in SPLITS:
                if actual == candidate.value:
                    chosen.append(file)
                    split = candidate
                    break
    if not chosen:
        # Ad-hoc layout: the file name starts with the split's name.
        chosen = [
            f for f in files if _is_parquet(f) and (split is None or f.name.startswith(split.value))
        ]
    if not chosen:
        raise DataProviderError("No files in dataset")
    if split is None:
        raise DataProviderError("Could not determine split")
    chosen.sort(key=lambda p: p.stem)
    return chosen, split


def _int_lists(
    table: pa.Table, column: str, required_len: int | None, file: Path
) -> list[np.ndarray]:
    array = table.column(column).combine_chunks()
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        raise DataProviderError(f"{file}: column `{column}` is {array.type}, not a list")
    value_type = array.type.value_type
    if not (pa.types.is_integer(value_type) or pa.types.is_boolean(value_type)):
        raise DataProviderError(f"{file}: column `{column}` holds {value_type}, not integers")
    if array.null_count:
        raise DataProviderError(f"{file}: column `{column}` has missing rows")
    offsets = array.offsets.to_numpy()
    # Integers of any width become i32 with wrap-around, booleans 0/1, as upstream casts them.
    values = array.values.to_numpy(zero_copy_only=False).astype(np.int32)
    rows = [values[offsets[i] : offsets[i + 1]] for i in range(len(array))]
    if required_len is not None:
        for row in rows:
            if len(row) != required_len:
                raise DataProviderError(
                    f"{file}: `{column}` has length {len(row)} instead of {required_len}"
                )
    return rows


def load_samples(files: list[Path], seq_len: int) -> list[TokenizedData]:
    try:
        first = pq.ParquetFile(files[0])
    except (OSError, pa.ArrowException) as e:
        raise DataProviderError(f"Error reading parquet file {files[0]}: {e}") from e
    if first.metadata.num_rows == 0:
        raise DataProviderError("Empty dataset")
    columns = set(first.schema_arrow.names)
    if "inputs" not in columns:
        raise DataProviderError("Dataset does not have `inputs` column")
    optional = [c for c in ("labels", "position_ids", "sequence_lengths") if c in columns]
    samples: list[TokenizedData] = []
    for file in files:
        try:
            table = pq.read_table(file, columns=["inputs", *optional])
        except (OSError, pa.ArrowException) as e:
            raise DataProviderError(f"Error reading parquet file {file}: {e}") from e
        inputs = _int_lists(table, "inputs", seq_len, file)
        extras = {
            name: _int_lists(table, name, None if name == "sequence_lengths" else seq_len, file)
            for name in optional
        }
        for i, row in enumerate(inputs):
            samples.append(
                TokenizedData(
                    row,
                    labels=extras["labels"][i] if "labels" in extras else None,
                    position_ids=extras["position_ids"][i] if "position_ids" in extras else None,
                    sequence_lengths=(
                        extras["sequence_lengths"][i] if "sequence_lengths" in extras else None
                    ),
                )
            )
    return samples


class PreprocessedDataProvider:
    def __init__(self, samples: list[TokenizedData]) -> None:
        self._samples = samples

    @classmethod
    def new_from_directory(
        cls,
        directory: str | os.PathLike[str],
        seq_len: int,
        shuffle: Shuffle,
        split: Split | None,
        subset: str | None,
    ) -> PreprocessedDataProvider:
        _, files = data_directory(directory, (PARQUET_EXTENSION,))
        chosen, _ = select_dataset_files(files, split, subset)
        samples = load_samples(chosen, seq_len)
        match shuffle:
            case Shuffle.Seeded(seed):
                perm = shuffle_permutation(len(samples), ChaCha8Rng(seed))
                samples = [samples[i] for i in perm.tolist()]
        return cls(samples)

    def num_sequences(self) -> int:
        return len(self._samples)

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        start, end = batch_bounds(data_ids)
        n = len(self._samples)
        if n == 0:
            raise DataProviderError("No data available")
        first, last = start % n, end % n
        if first <= last:
            return self._samples[first : last + 1]
        return self._samples[first:] + self._samples[: last + 1]
