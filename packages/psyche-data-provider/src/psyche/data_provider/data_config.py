"""`data.toml`: the dataset a TCP data server hosts (upstream's centralized `DataServerInfo`)."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Annotated

from psyche.core.data_shuffle import Shuffle
from psyche.core.serde import U64, FixedBytes, SerdeError, from_obj, struct
from psyche.core.token_size import TokenSize
from psyche.data_provider.local import LocalDataProvider


class DataConfigError(ValueError):
    """A data.toml that cannot be read; the message names the file and the field."""


@struct(frozen=True)
class DataServerInfo:
    # A relative `dir` is relative to the data.toml that names it.
    dir: str
    token_size: TokenSize
    seq_len: U64
    shuffle_seed: Annotated[bytes, FixedBytes(32)]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DataServerInfo:
        path = Path(path)
        try:
            obj = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise DataConfigError(f"{path}: cannot read data config: {e}") from e
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise DataConfigError(f"{path}: not valid TOML: {e}") from e
        try:
            info = from_obj(obj, cls, source=str(path))
        except SerdeError as e:
            raise DataConfigError(str(e)) from e
        return dataclasses.replace(info, dir=str(path.parent / info.dir))

    def open_provider(self) -> LocalDataProvider:
        """The seeded local provider the server hosts (upstream always shuffles it)."""
        return LocalDataProvider.new_from_directory(
            self.dir, self.token_size, self.seq_len, Shuffle.Seeded(self.shuffle_seed)
        )
