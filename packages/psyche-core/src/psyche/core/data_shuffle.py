"""Whether a data provider shuffles its sequences, and with which 32-byte seed."""

from __future__ import annotations

from typing import Annotated

from psyche.core.serde import DataEnum, FixedBytes, variant


class Shuffle(DataEnum):
    DontShuffle = variant()
    Seeded = variant(Annotated[bytes, FixedBytes(32)])
