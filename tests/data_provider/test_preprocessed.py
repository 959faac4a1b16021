"""PreprocessedDataProvider on parquet files the tests write."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.rng import ChaCha8Rng, shuffle_permutation
from psyche.data_provider import DataProviderError, PreprocessedDataProvider, Split
from psyche.data_provider.preprocessed import select_dataset_files

pytestmark = pytest.mark.anyio
SEQ = 4


def write_rows(
    path: Path, first: int, rows: int, *, extras: bool = True, value_type: pa.DataType | None = None
) -> None:
    value_type = value_type or pa.int32()
    path.parent.mkdir(parents=True, exist_ok=True)
    inputs = [[first + r] * SEQ for r in range(rows)]
    columns = {"inputs": pa.array(inputs, type=pa.large_list(value_type))}
    if extras:
        columns["labels"] = pa.array(
            [[-100] * SEQ for _ in range(rows)], type=pa.large_list(pa.int32())
        )
        columns["position_ids"] = pa.array([list(range(SEQ))] * rows, type=pa.list_(pa.int64()))
        columns["sequence_lengths"] = pa.array([[SEQ]] * rows, type=pa.large_list(pa.int64()))
    pq.write_table(pa.table(columns), path)


async def test_ad_hoc_layout_rows_in_file_then_row_order(tmp_path: Path) -> None:
    write_rows(tmp_path / "train-b.parquet", 100, 2)
    write_rows(tmp_path / "train-a.parquet", 0, 3)
    write_rows(tmp_path / "test-a.parquet", 500, 2)
    p = PreprocessedDataProvider.new_from_directory(
        tmp_path, SEQ, Shuffle.DontShuffle(), Split.Train, None
    )
    assert p.num_sequences() == 5
    samples = await p.get_samples(BatchId(0, 4))
    assert [int(s.input_ids[0]) for s in samples] == [0, 1, 2, 100, 101]  # files sorted by stem
    s = samples[0]
    assert s.labels.tolist() == [-100] * SEQ
    assert s.position_ids.tolist() == list(range(SEQ))
    assert s.sequence_lengths.tolist() == [SEQ]
    assert s.input_ids.dtype == np.int32


async def test_batches_wrap_around_and_shuffle_is_seeded(tmp_path: Path) -> None:
    write_rows(tmp_path / "train.parquet", 0, 5, extras=False)
    p = PreprocessedDataProvider.new_from_directory(
        tmp_path, SEQ, Shuffle.DontShuffle(), Split.Train, None
    )
    assert [int(s.input_ids[0]) for s in await p.get_samples(BatchId(3, 6))] == [3, 4, 0, 1]
    assert [int(s.input_ids[0]) for s in await p.get_samples(BatchId(7, 8))] == [2, 3]
    assert (await p.get_samples(BatchId(0, 0)))[0].labels is None
    seed = bytes(range(1, 33))
    shuffled = PreprocessedDataProvider.new_from_directory(
        tmp_path, SEQ, Shuffle.Seeded(seed), Split.Train, None
    )
    perm = shuffle_permutation(5, ChaCha8Rng(seed)).tolist()
    assert [int(s.input_ids[0]) for s in await shuffled.get_samples(BatchId(0, 4))] == perm


def test_split_selection_rules(tmp_path: Path) -> None:
    # parquet-converter layout: <subset>/<split>-*/file.parquet
    files = [
        tmp_path / "default" / "train-00" / "0.parquet",
        tmp_path / "default" / "test" / "0.parquet",
        tmp_path / "other" / "train" / "1.parquet",
    ]
    chosen, split = select_dataset_files(files, None, None)
    assert split is Split.Train
    assert [f.parent.name for f in chosen] == ["train-00", "train"]
    chosen, split = select_dataset_files(files, Split.Test, None)
    assert chosen == [files[1]]
    assert split is Split.Test
    chosen, _ = select_dataset_files(files, Split.Train, "other")
    assert chosen == [files[2]]
    with pytest.raises(DataProviderError, match="Could not determine split"):
        select_dataset_files([tmp_path / "data" / "x.parquet"], None, None)
    with pytest.raises(DataProviderError, match="No files in dataset"):
        select_dataset_files([tmp_path / "data" / "x.parquet"], Split.Validation, None)


def test_bad_datasets_are_clear_errors(tmp_path: Path) -> None:
    def load(directory: Path) -> PreprocessedDataProvider:
        return PreprocessedDataProvider.new_from_directory(
            directory, SEQ, Shuffle.DontShuffle(), Split.Train, None
        )

    with pytest.raises(DataProviderError, match="No training data files"):
        load(tmp_path)
    wrong_len = tmp_path / "len"
    wrong_len.mkdir()
    pq.write_table(
        pa.table({"inputs": pa.array([[1, 2, 3]], type=pa.list_(pa.int32()))}),
        wrong_len / "train.parquet",
    )
    with pytest.raises(DataProviderError, match="`inputs` has length 3 instead of 4"):
        load(wrong_len)
    no_inputs = tmp_path / "cols"
    no_inputs.mkdir()
    pq.write_table(
        pa.table({"tokens": pa.array([[1] * SEQ], type=pa.list_(pa.int32()))}),
        no_inputs / "train.parquet",
    )
    with pytest.raises(DataProviderError, match="does not have `inputs` column"):
        load(no_inputs)
    floats = tmp_path / "floats"
    write_rows(floats / "train.parquet", 0, 1, extras=False, value_type=pa.float32())
    with pytest.raises(DataProviderError, match="not integers"):
        load(floats)
    empty = tmp_path / "empty"
    empty.mkdir()
    pq.write_table(
        pa.table({"inputs": pa.array([], type=pa.list_(pa.int32()))}), empty / "train.parquet"
    )
    with pytest.raises(DataProviderError, match="Empty dataset"):
        load(empty)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataProviderError, match="Error reading parquet file"):
        load(broken)


async def test_wide_integers_wrap_to_i32(tmp_path: Path) -> None:
    write_rows(tmp_path / "train.parquet", 2**32 + 7, 1, extras=False, value_type=pa.int64())
    p = PreprocessedDataProvider.new_from_directory(
        tmp_path, SEQ, Shuffle.DontShuffle(), Split.Train, None
    )
    assert (await p.get_samples(BatchId(0, 0)))[0].input_ids.tolist() == [7] * SEQ
