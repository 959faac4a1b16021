"""LocalDataProvider on files the tests write."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.rng import ChaCha8Rng, shuffle_permutation
from psyche.core.token_size import TokenSize
from psyche.data_provider import DataProviderError, LocalDataProvider, stack_input_ids
from psyche.data_provider.local import list_data_files, sequence_offsets

pytestmark = pytest.mark.anyio
SEED = bytes(range(1, 33))


def test_sequence_offsets_follow_upstreams_exclusive_bound() -> None:
    assert sequence_offsets(3 * 8, 8).tolist() == [0, 8]  # exactly k sequences -> k - 1
    assert sequence_offsets(3 * 8 + 2, 8).tolist() == [0, 8, 16]
    assert sequence_offsets(8, 8).tolist() == []
    assert sequence_offsets(5, 8).tolist() == []  # upstream underflows here; we yield nothing


async def test_reads_sequences_in_file_then_offset_order(tmp_path: Path, write_tokens) -> None:
    write_tokens(tmp_path / "a.ds", range(0, 40))
    write_tokens(tmp_path / "b.npy", range(100, 130))
    write_tokens(tmp_path / "notes.txt", range(5))  # ignored: not a data extension
    order = [p.name for p in list_data_files(tmp_path)]
    assert order == [e.name for e in os.scandir(tmp_path) if e.name != "notes.txt"]
    with LocalDataProvider.new_from_directory(
        tmp_path, TokenSize.TwoBytes, 10, Shuffle.DontShuffle()
    ) as provider:
        # a.ds: 40 tokens -> 3 sequences, b.npy: 30 tokens -> 2 sequences.
        assert provider.num_sequences() == 5
        samples = await provider.get_samples(BatchId(0, 4))
        starts = {"a.ds": [0, 10, 20], "b.npy": [100, 110]}
        expected = [s for name in order for s in starts[name]]
        assert [int(s.input_ids[0]) for s in samples] == expected
        assert all(s.input_ids.dtype == np.int32 and len(s.input_ids) == 10 for s in samples)
        one_by_one = [(await provider.get_samples(BatchId(i, i)))[0] for i in range(5)]
        assert one_by_one == samples
        assert list(provider) == samples
        assert stack_input_ids(samples).shape == (5, 10)


async def test_seeded_shuffle_is_upstreams_and_reproducible(tmp_path: Path, write_tokens) -> None:
    write_tokens(tmp_path / "data.ds", np.arange(1000) % 60000)
    plain = LocalDataProvider.new_from_directory(
        tmp_path, TokenSize.TwoBytes, 7, Shuffle.DontShuffle()
    )
    a = LocalDataProvider.new_from_directory(tmp_path, TokenSize.TwoBytes, 7, Shuffle.Seeded(SEED))
    b = LocalDataProvider.new_from_directory(tmp_path, TokenSize.TwoBytes, 7, Shuffle.Seeded(SEED))
    n = plain.num_sequences()
    everything = await plain.get_samples(BatchId(0, n - 1))
    perm = shuffle_permutation(n, ChaCha8Rng(SEED))
    shuffled = await a.get_samples(BatchId(0, n - 1))
    assert shuffled == [everything[i] for i in perm]
    assert shuffled == await b.get_samples(BatchId(0, n - 1))
    assert shuffled != everything
    for p in (plain, a, b):
        p.close()


async def test_four_byte_tokens_wrap_to_negative_i32(tmp_path: Path, write_tokens) -> None:
    write_tokens(tmp_path / "x.bin", [1, 2**31, 2**32 - 1, 70000, 5, 6, 7, 8, 9], nbytes=4)
    with LocalDataProvider.new_from_directory(
        tmp_path, TokenSize.FourBytes, 4, Shuffle.DontShuffle()
    ) as p:
        (sample,) = await p.get_samples(BatchId(0, 0))
        assert sample.input_ids.tolist() == [1, -(2**31), -1, 70000]


async def test_batch_out_of_range_has_upstreams_message(tmp_path: Path, write_tokens) -> None:
    write_tokens(tmp_path / "x.ds", range(30))
    with LocalDataProvider.new_from_directory(
        tmp_path, TokenSize.TwoBytes, 10, Shuffle.DontShuffle()
    ) as p:
        with pytest.raises(
            DataProviderError, match=r"index 2 is out of bounds, we only have 2 samples\."
        ):
            await p.get_samples(BatchId(1, 5))
        with pytest.raises(DataProviderError, match="start > end"):
            await p.get_samples(BatchId(1, 0))


def test_missing_directory_and_no_data_files(tmp_path: Path, write_tokens) -> None:
    with pytest.raises(DataProviderError, match="Failed to open data directory"):
        LocalDataProvider.new_from_directory(
            tmp_path / "nope", TokenSize.TwoBytes, 4, Shuffle.DontShuffle()
        )
    write_tokens(tmp_path / "readme.md", range(10))
    with pytest.raises(DataProviderError, match="No training data files"):
        LocalDataProvider.new_from_directory(tmp_path, TokenSize.TwoBytes, 4, Shuffle.DontShuffle())


def test_partial_token_means_wrong_token_size_or_truncation(tmp_path: Path) -> None:
    (tmp_path / "x.ds").write_bytes(bytes(4 * 10 + 2))
    with pytest.raises(DataProviderError, match="not a whole number of 4-byte tokens"):
        LocalDataProvider.new_from_directory(
            tmp_path, TokenSize.FourBytes, 4, Shuffle.DontShuffle()
        )
    (tmp_path / "y.ds").write_bytes(bytes(41))
    with pytest.raises(DataProviderError, match="not a whole number of 2-byte tokens"):
        LocalDataProvider.new_from_directory(tmp_path, TokenSize.TwoBytes, 4, Shuffle.DontShuffle())


async def test_short_and_empty_files_hold_no_sequences(tmp_path: Path, write_tokens) -> None:
    write_tokens(tmp_path / "short.ds", range(3))
    (tmp_path / "empty.ds").write_bytes(b"")
    write_tokens(tmp_path / "ok.ds", range(25))
    with LocalDataProvider.new_from_directory(
        tmp_path, TokenSize.TwoBytes, 10, Shuffle.DontShuffle()
    ) as p:
        assert p.num_sequences() == 2
        assert [s.input_ids[0] for s in await p.get_samples(BatchId(0, 1))] == [0, 10]


async def test_file_truncated_while_in_use_is_an_error_not_a_crash(
    tmp_path: Path, write_tokens
) -> None:
    path = write_tokens(tmp_path / "x.ds", range(4096))
    with LocalDataProvider.new_from_directory(
        tmp_path, TokenSize.TwoBytes, 512, Shuffle.DontShuffle()
    ) as p:
        assert len(await p.get_samples(BatchId(0, 6))) == 7
        os.truncate(path, 100)  # reading the mapped pages now would be SIGBUS
        with pytest.raises(DataProviderError, match="shrank from 8192 to 100 bytes"):
            await p.get_samples(BatchId(5, 6))


def test_a_directory_with_a_data_extension_is_reported(tmp_path: Path) -> None:
    (tmp_path / "odd.ds").mkdir()
    with pytest.raises(DataProviderError, match="couldn't open training data file"):
        LocalDataProvider.new_from_directory(tmp_path, TokenSize.TwoBytes, 4, Shuffle.DontShuffle())


def reference_sequences(directory: Path, token_bytes: int, seq_len: int) -> np.ndarray:
    """Upstream's layout computed the slow, obvious way: every sequence of every file (listing
    order, offsets `range(0, size - seq_bytes, seq_bytes)`) as int32 (u32 wraps)."""
    rows = []
    seq_bytes = seq_len * token_bytes
    for path in list_data_files(directory):
        raw = path.read_bytes()
        for offset in range(0, len(raw) - seq_bytes, seq_bytes):
            chunk = raw[offset : offset + seq_bytes]
            dtype = "<u2" if token_bytes == 2 else "<u4"
            rows.append(np.frombuffer(chunk, dtype=dtype).astype(np.int64).astype(np.int32))
    return np.array(rows, dtype=np.int32).reshape(len(rows), seq_len)


@pytest.mark.parametrize("token_size", [TokenSize.TwoBytes, TokenSize.FourBytes])
@pytest.mark.parametrize("shuffled", [False, True])
async def test_batch_path_is_bit_identical_to_the_reference_layout(
    tmp_path: Path, write_tokens, token_size: TokenSize, shuffled: bool
) -> None:
    gen = np.random.default_rng(11)
    nbytes = token_size.num_bytes
    high = 2**16 if nbytes == 2 else 2**32
    for name, length in (("a.ds", 1000), ("b.bin", 77), ("c.npy", 333), ("d.ds", 5)):
        write_tokens(tmp_path / name, gen.integers(0, high, length, dtype=np.int64), nbytes)
    seq_len = 16
    everything = reference_sequences(tmp_path, nbytes, seq_len)
    shuffle = Shuffle.Seeded(SEED) if shuffled else Shuffle.DontShuffle()
    if shuffled:
        everything = everything[shuffle_permutation(len(everything), ChaCha8Rng(SEED))]
    with LocalDataProvider.new_from_directory(tmp_path, token_size, seq_len, shuffle) as p:
        n = p.num_sequences()
        assert n == len(everything)
        batches = [BatchId(0, n - 1), BatchId(0, 0), BatchId(n - 1, n - 1)]
        batches += [
            BatchId(int(s), int(s) + int(k))
            for s, k in zip(gen.integers(0, n - 9, 40), gen.integers(0, 8, 40))
        ]
        for batch in batches:
            got = await p.get_batch(batch)
            expected = everything[batch.start : batch.end + 1]
            assert got.dtype == np.int32
            assert got.flags.c_contiguous
            assert got.flags.writeable
            assert np.array_equal(got, expected), batch
            samples = await p.get_samples(batch)
            assert [s.input_ids.tolist() for s in samples] == expected.tolist()
        # The batch is a copy: writing to it changes nothing the provider returns later.
        got = p.read_batch(BatchId(0, 3))
        got[:] = -7
        assert np.array_equal(p.read_batch(BatchId(0, 3)), everything[:4])
