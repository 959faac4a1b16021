"""Pre-tokenized files in a local directory (upstream `LocalDataProvider`).

Files are raw little-endian token streams (`.npy` included: it has no NumPy header here). Each
file is cut into sequences of `seq_len` tokens at offsets `range(0, size - seq_bytes, seq_bytes)`
(upstream's bound: a file of exactly k sequences yields k - 1), files in directory-listing order,
then the whole list of sequences is optionally shuffled with upstream's seeded shuffle.

Files are memory-mapped, never read whole. A mapped file that shrinks while in use would kill the
process with SIGBUS on access, so every read first checks the file's current size.

Every sequence starts at a multiple of `seq_len` tokens in its file, so each file is viewed as a
2-D `[rows, seq_len]` array and a sequence pointer is a (file, row) pair. A batch is gathered
from those views in one vectorized step per file into one int32 `[n, seq_len]` array
(`read_batch`); the per-sample API (`get_samples`) hands out rows of that array.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.token_size import TokenSize
from psyche.data_provider.types import (
    DATA_FILE_EXTENSIONS,
    DataProviderError,
    TokenizedData,
    batch_bounds,
    sequence_pointers,
    sequence_runs,
)

log = logging.getLogger(__name__)


def _truthy(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


@dataclass(eq=False)
class _MappedFile:
    path: Path
    fd: int
    size: int
    data: mmap.mmap | bytes
    tokens: np.ndarray | None = None  # the whole file as tokens: a view, no copy

    @classmethod
    def open(cls, path: Path) -> _MappedFile:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return cls(path, fd, 0, b"")
            try:
                data: mmap.mmap | bytes = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except OSError as e:
                # Upstream's escape hatch for environments without mmap (e.g. under Valgrind).
                if e.errno != errno.EINVAL or not _truthy(os.environ.get("ALLOW_FAIL_MMAP", "")):
                    raise
                log.warning("mmap of %s failed (%s); reading it into memory instead", path, e)
                data = Path(path).read_bytes()
            return cls(path, fd, size, data)
        except BaseException:
            os.close(fd)
            raise

    def check_still_whole(self) -> None:
        # lseek to the end reports the current size at a third of fstat's cost (the fd is never
        # read from: the bytes come through the map).
        size = os.lseek(self.fd, 0, os.SEEK_END)
        if size < self.size:
            raise DataProviderError(
                f"{self.path} shrank from {self.size} to {size} bytes while in use "
                "(truncated or being rewritten?)"
            )

    def as_tokens(self, token_size: TokenSize) -> np.ndarray:
        if self.tokens is None:
            dtype = "<u2" if token_size is TokenSize.TwoBytes else "<i4"
            whole = self.size - self.size % token_size.num_bytes
            self.tokens = np.frombuffer(self.data, dtype=dtype, count=whole // token_size.num_bytes)
        return self.tokens

    def close(self) -> None:
        self.tokens = None  # release the buffer export before unmapping
        if isinstance(self.data, mmap.mmap):
            self.data.close()
        os.close(self.fd)


def list_data_files(
    directory: Path, extensions: tuple[str, ...] = DATA_FILE_EXTENSIONS
) -> list[Path]:
    """Files with a data extension, in the order the OS lists them (upstream uses `read_dir`)."""
    try:
        entries = list(os.scandir(directory))
    except OSError as e:
        raise DataProviderError(f"couldn't load training data from {directory}: {e}") from e
    return [Path(entry.path) for entry in entries if Path(entry.name).suffix[1:] in extensions]


def data_directory(
    directory: str | os.PathLike[str], extensions: tuple[str, ...] = DATA_FILE_EXTENSIONS
) -> tuple[Path, list[Path]]:
    """A data directory, resolved, and its data files (`list_data_files`); a
    `DataProviderError` when it cannot be opened or holds none."""
    try:
        root = Path(directory).resolve(strict=True)
    except OSError as e:
        raise DataProviderError(f"Failed to open data directory {directory}: {e}") from e
    paths = list_data_files(root, extensions)
    if not paths:
        raise DataProviderError(f"No training data files in directory {root}")
    return root, paths


def sequence_offsets(file_size: int, seq_bytes: int) -> np.ndarray:
    """Upstream's `(0..size - seq_bytes).step_by(seq_bytes)`; empty for files of one sequence or
    less (where upstream's unsigned subtraction would underflow)."""
    if file_size <= seq_bytes:
        return np.empty(0, dtype=np.int64)
    return np.arange(0, file_size - seq_bytes, seq_bytes, dtype=np.int64)


class LocalDataProvider:
    """Sequences of `seq_len` tokens from memory-mapped files; see the module docstring."""

    def __init__(
        self,
        files: list[_MappedFile],
        file_index: np.ndarray,
        byte_offset: np.ndarray,
        seq_len: int,
        token_size: TokenSize,
    ) -> None:
        seq_bytes = seq_len * token_size.num_bytes
        if len(byte_offset) and (byte_offset % seq_bytes).any():
            raise ValueError("every sequence must start at a multiple of seq_len tokens")
        self._files = files
        # Each file as rows of seq_len tokens (a view of the map; a partial last row is cut).
        self._rows: list[np.ndarray] = []
        for f in files:
            tokens = f.as_tokens(token_size)
            whole = len(tokens) // seq_len
            self._rows.append(tokens[: whole * seq_len].reshape(whole, seq_len))
        self._file_index = file_index
        self._byte_offset = byte_offset
        self._row = byte_offset // seq_bytes
        self._run = sequence_runs(file_index, byte_offset, seq_bytes)
        self._one_file = len(files) == 1
        self.seq_len = seq_len
        self.token_size = token_size

    @classmethod
    def new_from_directory(
        cls,
        directory: str | os.PathLike[str],
        token_size: TokenSize,
        seq_len: int,
        shuffle: Shuffle,
    ) -> LocalDataProvider:
        if seq_len <= 0:
            raise DataProviderError(f"seq_len must be positive, got {seq_len}")
        root, paths = data_directory(directory)
        token_bytes = token_size.num_bytes
        seq_bytes = seq_len * token_bytes
        files: list[_MappedFile] = []
        try:
            for path in paths:
                try:
                    files.append(_MappedFile.open(path))
                except OSError as e:
                    raise DataProviderError(f"couldn't open training data file {path}: {e}") from e
            per_file: list[np.ndarray] = []
            for f in files:
                if f.size % token_bytes:
                    raise DataProviderError(
                        f"{f.path} is {f.size} bytes, not a whole number of {token_bytes}-byte "
                        "tokens (wrong token_size, or a truncated file)"
                    )
                offsets = sequence_offsets(f.size, seq_bytes)
                if len(offsets) == 0:
                    log.warning(
                        "%s (%d bytes) holds no complete sequence of %d tokens beyond the last",
                        f.path,
                        f.size,
                        seq_len,
                    )
                per_file.append(offsets)
        except BaseException:
            for f in files:
                f.close()
            raise
        file_index, byte_offset = sequence_pointers(per_file, shuffle)
        log.info(
            "Loaded %d files (%d bytes) of training data from directory %s: %d sequences",
            len(files),
            sum(f.size for f in files),
            root,
            len(file_index),
        )
        return cls(files, file_index, byte_offset, seq_len, token_size)

    def num_sequences(self) -> int:
        return len(self._file_index)

    def read_batch(self, data_ids: BatchId) -> np.ndarray:
        """The batch's sequences as one new int32 `[n, seq_len]` array, read synchronously (the
        local reads are memory copies). The hot path: a run of consecutive sequences of one file
        is one slice, anything else one gather per file."""
        start, end = batch_bounds(data_ids)
        n = len(self._file_index)
        if end >= n:
            raise DataProviderError(
                f"index {max(start, n)} is out of bounds, we only have {n} samples."
            )
        run = self._run
        if run.item(start) == run.item(end):
            file = self._file_index.item(start)
            self._files[file].check_still_whole()
            row = self._row.item(start)
            # astype always copies: the result never aliases the map.
            window: np.ndarray = self._rows[file][row : row + end - start + 1].astype(np.int32)
            return window
        rows = self._row[start : end + 1]
        if self._one_file:
            self._files[0].check_still_whole()
            picked: np.ndarray = self._rows[0][rows].astype(np.int32)
            return picked
        files = self._file_index[start : end + 1]
        out = np.empty((end - start + 1, self.seq_len), dtype=np.int32)
        for file in np.unique(files).tolist():
            self._files[file].check_still_whole()
            mine = files == file
            out[mine] = self._rows[file][rows[mine]]
        return out

    def read_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        """`read_batch` as one `TokenizedData` per sequence (rows of the batch array)."""
        return TokenizedData.from_rows(self.read_batch(data_ids))

    async def get_batch(self, data_ids: BatchId) -> np.ndarray:
        return self.read_batch(data_ids)

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        return self.read_samples(data_ids)

    def __iter__(self) -> Iterator[TokenizedData]:
        for i in range(self.num_sequences()):
            yield from self.read_samples(BatchId(i, i))

    def close(self) -> None:
        self._rows = []  # views of the maps: drop them before unmapping
        for f in self._files:
            f.close()
        self._files = []

    def __enter__(self) -> LocalDataProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
