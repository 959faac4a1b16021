"""A minimal reader of local token files for `psyche-train` (upstream's LocalDataProvider layout).

A directory of raw little-endian token streams (`.ds`, `.bin`, `.npy`; the `.npy` files upstream
uses carry no NumPy header) is cut into sequences of `seq_len` tokens. Files are taken in
directory-listing order and sequences at offsets `range(0, file_size - seq_bytes, seq_bytes)`,
as upstream does. Upstream shuffles with ChaCha8; until the data-provider package supplies that,
a seed here shuffles with NumPy's PCG64 instead (same sequences, different order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA_FILE_EXTENSIONS = ("npy", "bin", "ds")


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class _Pointer:
    file: int
    offset: int


class LocalTokenDataset:
    def __init__(
        self, directory: str | os.PathLike[str], token_size: int, seq_len: int, seed: int | None
    ) -> None:
        if token_size not in (2, 4):
            raise DataError(f"token size must be 2 or 4 bytes, got {token_size}")
        if seq_len < 1:
            raise DataError("sequence length must be at least 1")
        root = Path(directory)
        if not root.is_dir():
            raise DataError(f"{root} is not a directory")
        self.token_size = token_size
        self.seq_len = seq_len
        self.files: list[np.memmap] = []
        pointers: list[_Pointer] = []
        seq_bytes = seq_len * token_size
        dtype = np.dtype("<u2" if token_size == 2 else "<u4")
        with os.scandir(root) as entries:
            paths = [Path(e.path) for e in entries if e.is_file()]
        for path in paths:
            if path.name.rsplit(".", 1)[-1] not in DATA_FILE_EXTENSIONS:
                continue
            size = path.stat().st_size
            if size < token_size:
                continue
            index = len(self.files)
            self.files.append(np.memmap(path, dtype=dtype, mode="r", shape=(size // token_size,)))
            pointers.extend(_Pointer(index, off) for off in range(0, size - seq_bytes, seq_bytes))
        if not self.files:
            raise DataError(f"no training data files ({', '.join(DATA_FILE_EXTENSIONS)}) in {root}")
        if seed is not None:
            order = np.random.Generator(np.random.PCG64(seed)).permutation(len(pointers))
            pointers = [pointers[i] for i in order]
        self.pointers = pointers

    def __len__(self) -> int:
        return len(self.pointers)

    def get_samples(self, start: int, end: int) -> np.ndarray:
        """Sequences `start..=end` as an int64 array `[end - start + 1, seq_len]`."""
        if end >= len(self.pointers):
            raise DataError(
                f"index {end} is out of bounds, we only have {len(self.pointers)} samples."
            )
        rows = []
        for i in range(start, end + 1):
            ptr = self.pointers[i]
            first = ptr.offset // self.token_size
            rows.append(self.files[ptr.file][first : first + self.seq_len])
        tokens = np.stack(rows).astype(np.int64)
        if self.token_size == 4:
            # u32 tokens are cast to i32 upstream
            tokens = tokens.astype(np.uint32).view(np.int32).astype(np.int64)
        return tokens
