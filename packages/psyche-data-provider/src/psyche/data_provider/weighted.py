"""A mix of datasets sampled by weight (upstream `WeightedDataProvider`).

Sample s of the mix comes from the provider whose drawn count lags its share the most
(`w_i * max(s, 1) - drawn_i`, first provider on ties); each provider yields its samples in order
and, once exhausted, repeats them. With a seed, the mix is then shuffled by a backward
Fisher-Yates over ChaCha8 (upstream's own loop, not rand's slice shuffle). The mix is as long as
all providers together; a batch id past its end reads provider 0's sample 0 (upstream quirk).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.rng import ChaCha8Rng, backward_fisher_yates_permutation
from psyche.data_provider.types import DataProviderError, TokenizedData, batch_bounds

log = logging.getLogger(__name__)


class SizedProvider(Protocol):
    def num_sequences(self) -> int: ...

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]: ...


def normalize(weights: Sequence[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def build_weighted_index(
    n_samples: int, weights: Sequence[float], dataset_sizes: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Upstream's `build_weighted_index`: (provider, sample) for each of `n_samples` positions."""
    num = len(weights)
    dataset_index = np.empty(n_samples, dtype=np.int64)
    sample_index = np.empty(n_samples, dtype=np.int64)
    drawn = [0] * num
    next_unique = [0] * num
    exhausted = [False] * num
    candidates = [i for i in range(num) if dataset_sizes[i] != 0]
    for s in range(n_samples):
        x = float(max(s, 1))
        best_error = float("-inf")
        chosen = 0
        for i in candidates:
            error = weights[i] * x - float(drawn[i])
            if error > best_error:
                best_error = error
                chosen = i
        size = dataset_sizes[chosen]
        if not exhausted[chosen]:
            sample = next_unique[chosen]
            next_unique[chosen] += 1
            if next_unique[chosen] == size:
                exhausted[chosen] = True
        else:
            sample = drawn[chosen] % size
        dataset_index[s] = chosen
        sample_index[s] = sample
        drawn[chosen] += 1
    return dataset_index, sample_index


class WeightedDataProvider:
    """Samples from several providers in proportion to `weights` (or to their sizes if None)."""

    def __init__(
        self,
        providers: Sequence[SizedProvider],
        weights: Sequence[float] | None,
        shuffle: Shuffle,
    ) -> None:
        sizes = [p.num_sequences() for p in providers]
        if weights is None:
            weights = normalize([float(s) for s in sizes])
        else:
            if len(weights) != len(providers):
                raise ValueError("Number of providers must match number of weights")
            weights = normalize([float(w) for w in weights])
        self.providers = list(providers)
        self.weights = weights
        num_samples = sum(sizes)
        dataset_index, sample_index = build_weighted_index(num_samples, weights, sizes)
        match shuffle:
            case Shuffle.Seeded(seed):
                perm = backward_fisher_yates_permutation(num_samples, ChaCha8Rng(seed))
                dataset_index, sample_index = dataset_index[perm], sample_index[perm]
        self._dataset_index = dataset_index
        self._sample_index = sample_index
        log.info("Created weighted data provider with %d samples", num_samples)

    def num_sequences(self) -> int:
        return len(self._dataset_index)

    def sample_info(self, index: int) -> tuple[int, int]:
        if index >= len(self._dataset_index):
            return 0, 0
        return int(self._dataset_index[index]), int(self._sample_index[index])

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        start, end = batch_bounds(data_ids)
        requests: list[list[tuple[int, int]]] = [[] for _ in self.providers]
        for position, data_id in enumerate(range(start, end + 1)):
            provider, sample = self.sample_info(data_id)
            requests[provider].append((position, sample))
        results: list[TokenizedData | None] = [None] * (end - start + 1)
        for provider, wanted in enumerate(requests):
            if not wanted:
                continue
            wanted.sort(key=lambda item: item[1])
            runs: list[list[tuple[int, int]]] = [[wanted[0]]]
            for item in wanted[1:]:
                if item[1] == runs[-1][-1][1] + 1:
                    runs[-1].append(item)
                else:
                    runs.append([item])
            for run in runs:
                samples = await self.providers[provider].get_samples(BatchId(run[0][1], run[-1][1]))
                for (slot, _), data in zip(run, samples):
                    results[slot] = data
        complete = [r for r in results if r is not None and len(r.input_ids) > 0]
        if len(complete) != len(results):
            raise DataProviderError("Failed to get all requested samples")
        return complete

    async def aclose(self) -> None:
        for p in self.providers:
            close = getattr(p, "aclose", None)
            if close is not None:
                await close()
