"""`blob_hash` is BLAKE3 of the bytes whatever route it takes (one thread below a MiB, BLAKE3's
pool above): a provider and a downloader on either side of the threshold name a blob alike."""

from __future__ import annotations

import random

import blake3
import pytest

from psyche.network.ticket import THREADED_HASH_MIN_BYTES, blob_hash


@pytest.mark.parametrize(
    "size",
    [
        0,
        1,
        98_600,
        THREADED_HASH_MIN_BYTES - 1,
        THREADED_HASH_MIN_BYTES,
        3 * THREADED_HASH_MIN_BYTES + 7,
    ],
)
def test_blob_hash_is_blake3_on_both_sides_of_the_thread_threshold(size: int) -> None:
    data = random.Random(size).randbytes(size)
    assert blob_hash(data) == blake3.blake3(data).digest()
    assert blob_hash(memoryview(data)) == blob_hash(bytearray(data))
