"""Pre-tokenized files in a local directory (upstream `LocalDataProvider`).

Files are raw little-endian token streams (`.npy` included: it has no NumPy header here). Each
file is cut into sequences of `seq_len` tokens at offsets `range(0, size - seq_bytes, seq_bytes)`
(upstream's bound: a file of exactly k sequences yields k - 1), files in directory-listing order,
then the whole list of sequences is optionally shuffled with upstream's seeded shuffle.

Files are memory-mapped, never read whole. A mapped file that shrinks while in use would kill the
process with SIGBUS on access, so every read first checks the file's current size.
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
from psyche.data_provider.rng import ChaCha8Rng, shuffle_permutation
from psyche.data_provider.types import (
    DATA_FILE_EXTENSIONS,
    DataProviderError,
    TokenizedData,
    batch_bounds,
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
        size = os.fstat(self.fd).st_size
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
        self._files = files
        self._tokens = [f.as_tokens(token_size) for f in files]
        self._file_index = file_index
        self._byte_offset = byte_offset
        self._token_offset = byte_offset // token_size.num_bytes
        self._run = sequence_runs(file_index, byte_offset, seq_len * token_size.num_bytes)
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
        try:
            root = Path(directory).resolve(strict=True)
        except OSError as e:
            raise DataProviderError(f"Failed to open data directory {directory}: {e}") from e
        paths = list_data_files(root)
        if not paths:
            raise DataProviderError(f"No training data files in directory {root}")
        token_bytes = token_size.num_bytes
        seq_bytes = seq_len * token_bytes
        files: list[_MappedFile] = []
        try:
            for path in paths:
                try:
                    files.append(_MappedFile.open(path))
                except OSError as e:
                    raise DataProviderError(f"couldn't open training data file {path}: {e}") from e
            index_parts, offset_parts = [], []
            for i, f in enumerate(files):
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
                index_parts.append(np.full(len(offsets), i, dtype=np.int32))
                offset_parts.append(offsets)
        except BaseException:
            for f in files:
                f.close()
            raise
        file_index = np.concatenate(index_parts)
        byte_offset = np.concatenate(offset_parts)
        match shuffle:
            case Shuffle.Seeded(seed):
                perm = shuffle_permutation(len(file_index), ChaCha8Rng(seed))
                file_index, byte_offset = file_index[perm], byte_offset[perm]
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

    def read_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        """The samples of a batch, read synchronously (the local reads are memory copies)."""
        start, end = batch_bounds(data_ids)
        n = len(self._file_index)
        if end >= n:
            raise DataProviderError(
                f"index {max(start, n)} is out of bounds, we only have {n} samples."
            )
        count = end - start + 1
        seq_len = self.seq_len
        if self._run[start] == self._run[end]:
            # Consecutive sequences of one file: one slice.
            file = int(self._file_index[start])
            self._files[file].check_still_whole()
            first = int(self._token_offset[start])
            block = self._tokens[file][first : first + seq_len * count].reshape(count, seq_len)
        else:
            files = self._file_index[start : end + 1].tolist()
            for i in set(files):
                self._files[i].check_still_whole()
            tokens = self._tokens
            offsets = self._token_offset[start : end + 1].tolist()
            block = np.stack([tokens[f][o : o + seq_len] for f, o in zip(files, offsets)])
        return TokenizedData.from_rows(block.astype(np.int32))

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        return self.read_samples(data_ids)

    def __iter__(self) -> Iterator[TokenizedData]:
        for i in range(self.num_sequences()):
            yield from self.read_samples(BatchId(i, i))

    def close(self) -> None:
        self._tokens = []  # views of the maps: drop them before unmapping
        for f in self._files:
            f.close()
        self._files = []

    def __enter__(self) -> LocalDataProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
