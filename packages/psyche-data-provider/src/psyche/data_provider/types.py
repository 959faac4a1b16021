"""What every data provider returns, the interface they share, and their error type."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.rng import ChaCha8Rng, shuffle_permutation
from psyche.core.token_size import TokenSize

# Upstream's on-disk and on-the-wire extensions of pre-tokenized data files.
DATA_FILE_EXTENSIONS = ("npy", "bin", "ds")
PARQUET_EXTENSION = "parquet"


class DataProviderError(Exception):
    """A provider could not produce the samples asked for; the message says which and why."""


def _as_i32(values: np.ndarray | Sequence[int]) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype != np.int32:
        array = array.astype(np.int32)
    return array


def _is_i32(values: object) -> bool:
    return type(values) is np.ndarray and values.dtype == np.int32


def _equal(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return np.array_equal(a, b)


@dataclass(eq=False, slots=True)
class TokenizedData:
    """One training sample (upstream `TokenizedData`): int32 token ids and optional extras.

    Pretraining data has only `input_ids`; preprocessed (parquet) data may carry labels, position
    ids and the lengths of the packed sequences. Arrays of any other integer type are converted.
    """

    input_ids: np.ndarray
    labels: np.ndarray | None = None
    position_ids: np.ndarray | None = None
    sequence_lengths: np.ndarray | None = None

    def __post_init__(self) -> None:
        # Providers build thousands of these per second: skip the conversions when not needed.
        if not _is_i32(self.input_ids):
            self.input_ids = _as_i32(self.input_ids)
        if self.labels is not None and not _is_i32(self.labels):
            self.labels = _as_i32(self.labels)
        if self.position_ids is not None and not _is_i32(self.position_ids):
            self.position_ids = _as_i32(self.position_ids)
        if self.sequence_lengths is not None and not _is_i32(self.sequence_lengths):
            self.sequence_lengths = _as_i32(self.sequence_lengths)

    @classmethod
    def from_input_ids(cls, input_ids: np.ndarray | Sequence[int]) -> TokenizedData:
        return cls(_as_i32(input_ids))

    @classmethod
    def from_rows(cls, block: np.ndarray) -> list[TokenizedData]:
        """One sample per row of an int32 `(count, seq_len)` array (rows are views of it).

        The hot path of every pretraining provider, so it skips `__init__`'s checks.
        """
        if block.dtype != np.int32 or block.ndim != 2:
            raise TypeError("from_rows needs a 2-D int32 array")
        new = object.__new__
        out = []
        for row in block:
            sample = new(cls)
            sample.input_ids = row
            sample.labels = sample.position_ids = sample.sequence_lengths = None
            out.append(sample)
        return out

    @classmethod
    def empty(cls) -> TokenizedData:
        return cls(np.empty(0, dtype=np.int32))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenizedData):
            return NotImplemented
        return (
            np.array_equal(self.input_ids, other.input_ids)
            and _equal(self.labels, other.labels)
            and _equal(self.position_ids, other.position_ids)
            and _equal(self.sequence_lengths, other.sequence_lengths)
        )

    # (defining __eq__ without __hash__ leaves instances unhashable: they are mutable)


def stack_input_ids(samples: Sequence[TokenizedData]) -> np.ndarray:
    """The `input_ids` of equally long samples as one `(len(samples), seq_len)` int32 array."""
    if not samples:
        return np.empty((0, 0), dtype=np.int32)
    return np.stack([s.input_ids for s in samples])


@runtime_checkable
class TokenizedDataProvider(Protocol):
    """Anything that turns a batch of sample ids into samples (one per id, in id order).

    The interface is async (trio): HTTP and TCP providers wait on the network, and the training
    client fetches the next batch while it trains on the current one.
    """

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]: ...


@runtime_checkable
class BatchDataProvider(Protocol):
    """A provider that can also return a whole pretraining batch as one int32 `[n, seq_len]`
    array (no per-sample objects): the fast path of the local provider and the TCP client."""

    async def get_batch(self, data_ids: BatchId) -> np.ndarray: ...


@runtime_checkable
class LengthKnownDataProvider(Protocol):
    def num_sequences(self) -> int: ...


def as_batch_id(data_ids: BatchId) -> BatchId:
    """A `BatchId` for anything with `start` and `end` (e.g. a `ClosedInterval`)."""
    if type(data_ids) is BatchId:
        return data_ids
    return BatchId(int(data_ids.start), int(data_ids.end))


def batch_bounds(data_ids: BatchId) -> tuple[int, int]:
    """`(start, end)` of a batch, refusing the inverted intervals a wire message can carry."""
    start, end = int(data_ids.start), int(data_ids.end)
    if start > end:
        raise DataProviderError(f"invalid batch {data_ids}: start > end")
    return start, end


def sequence_pointers(
    offsets: Sequence[np.ndarray], shuffle: Shuffle
) -> tuple[np.ndarray, np.ndarray]:
    """Every sequence's pointer, as (file index: int32, byte offset: int64) arrays, from each
    file's sequence offsets (`offsets[i]`: file `i`'s): file after file, then in the order
    `shuffle` leaves them (upstream's `slice.shuffle` with the seed's ChaCha8Rng), so that the
    local and the HTTP providers number the same sequences the same way."""
    if not offsets:
        return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64)
    file_index = np.concatenate([np.full(len(o), i, dtype=np.int32) for i, o in enumerate(offsets)])
    byte_offset = np.concatenate(list(offsets))
    match shuffle:
        case Shuffle.Seeded(seed):
            perm = shuffle_permutation(len(file_index), ChaCha8Rng(seed))
            file_index, byte_offset = file_index[perm], byte_offset[perm]
    return file_index, byte_offset


def sequence_runs(file_index: np.ndarray, byte_offset: np.ndarray, seq_bytes: int) -> np.ndarray:
    """Run number of each sequence pointer: consecutive pointers share a run when the second
    directly follows the first in the same file, so a batch whose first and last pointers share a
    run can be read as one slice (or one range request)."""
    if len(file_index) == 0:
        return np.empty(0, dtype=np.int64)
    follows = (file_index[1:] == file_index[:-1]) & (np.diff(byte_offset) == seq_bytes)
    runs = np.empty(len(file_index), dtype=np.int64)
    runs[0] = 0
    np.cumsum(~follows, out=runs[1:])
    return runs


def decode_tokens(
    raw: bytes | bytearray | memoryview | np.ndarray, token_size: TokenSize
) -> np.ndarray:
    """Little-endian u16/u32 tokens as int32 (u32 values of 2**31 and above wrap, as upstream)."""
    dtype = "<u2" if token_size is TokenSize.TwoBytes else "<i4"
    return np.frombuffer(raw, dtype=dtype).astype(np.int32)
