"""Width of one token in a pre-tokenized data file."""

from __future__ import annotations

from psyche.core.serde import RustEnum


class TokenSize(RustEnum):
    TwoBytes = 0
    FourBytes = 1

    @property
    def num_bytes(self) -> int:
        return 2 if self is TokenSize.TwoBytes else 4

    @classmethod
    def from_num_bytes(cls, num_bytes: int) -> TokenSize:
        if num_bytes == 2:
            return cls.TwoBytes
        if num_bytes == 4:
            return cls.FourBytes
        raise ValueError(f"Unsupported token bytes length {num_bytes}")
