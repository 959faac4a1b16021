"""All-zero samples for runs that test the machinery, not the model (upstream `DummyDataProvider`)."""

from __future__ import annotations

import numpy as np

from psyche.core.batch_id import BatchId
from psyche.core.token_size import TokenSize
from psyche.data_provider.types import DataProviderError, TokenizedData, batch_bounds


class DummyDataProvider:
    def __init__(self, token_size: TokenSize, seq_len: int, num_sequences: int) -> None:
        self.token_size = token_size
        self.seq_len = seq_len
        self._num_sequences = num_sequences

    def num_sequences(self) -> int:
        return self._num_sequences

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        start, end = batch_bounds(data_ids)
        # Upstream rejects only ids *greater* than the count, so id == count is served.
        if end > self._num_sequences:
            first_bad = max(start, self._num_sequences + 1)
            raise DataProviderError(f"id {first_bad} > self.num_sequences {self._num_sequences}")
        return [
            TokenizedData(np.zeros(self.seq_len, dtype=np.int32)) for _ in range(end - start + 1)
        ]
