"""From a run's data location(s) to a provider (upstream's client `init.rs` mapping), with
fallback to backup locations.

A run config may list several `data_locations`; they must hold the same data, since a batch id
has to give the same tokens wherever it is read. `open_data_provider` opens the first location
that works, and when a fetch later fails there (server gone, file missing, retries exhausted)
the provider logs why and moves to the next location, trying each at most once per batch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import trio

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.identity import SecretKey
from psyche.core.serde import F64, SerdeError, from_obj
from psyche.core.token_size import TokenSize
from psyche.data_provider.dummy import DummyDataProvider
from psyche.data_provider.http import (
    FileURLs,
    HttpConfig,
    HttpDataProvider,
    new_http_client,
    request_with_retries,
)
from psyche.data_provider.local import LocalDataProvider
from psyche.data_provider.preprocessed import PreprocessedDataProvider, Split
from psyche.data_provider.tcp_client import DataProviderTcpClient
from psyche.data_provider.types import DataProviderError, TokenizedData, TokenizedDataProvider
from psyche.data_provider.weighted import WeightedDataProvider

if TYPE_CHECKING:
    from psyche.coordinator.model import (
        HttpLLMTrainingDataLocation,
        HttpTrainingDataLocation,
        LLMTrainingDataLocation,
    )

log = logging.getLogger(__name__)

# Upstream's client serves `Dummy` runs 2048-token zero samples whatever max_seq_len says.
DUMMY_SEQ_LEN = 2048
DUMMY_NUM_SEQUENCES = (1 << 64) - 1


@dataclass(frozen=True)
class ProviderOptions:
    """What a location alone does not say.

    `secret_key` authenticates to a TCP data server (the node's p2p key). A `Local` location
    names only a directory (upstream's client does not support it at all), so its token size
    and shuffle are given here.
    """

    max_seq_len: int
    secret_key: SecretKey | None = None
    http: HttpConfig = field(default_factory=HttpConfig)
    local_token_size: TokenSize = TokenSize.TwoBytes
    local_shuffle: Shuffle = field(default_factory=Shuffle.DontShuffle)


async def file_urls_from_location(
    client: httpx.AsyncClient, location: HttpTrainingDataLocation, config: HttpConfig
) -> FileURLs:
    from psyche.coordinator.model import HttpTrainingDataLocation

    match location:
        case HttpTrainingDataLocation.SingleUrl(url):
            return await FileURLs.from_list(client, [url], config)
        case HttpTrainingDataLocation.NumberedFiles(numbered):
            return await FileURLs.from_template(
                client,
                numbered.url_template,
                numbered.start_index,
                numbered.n_left_pad_zeros,
                numbered.num_files,
                config,
            )
        case HttpTrainingDataLocation.Gcp(gcp):
            directory = gcp.filter_directory or None
            return await FileURLs.from_gcp_bucket(client, gcp.bucket_name, directory, config)
    raise DataProviderError(f"not an HTTP data location: {location!r}")


async def open_http_provider(
    location: HttpLLMTrainingDataLocation, max_seq_len: int, config: HttpConfig
) -> HttpDataProvider:
    return await HttpDataProvider.open(
        lambda client: file_urls_from_location(client, location.location, config),
        location.token_size_in_bytes,
        max_seq_len,
        location.shuffle,
        config,
    )


@dataclass(frozen=True)
class WeightedHttpProvidersConfig:
    """The JSON a `WeightedHttp` location points at: `{"shuffle": ..., "providers": [...]}` where
    providers are `[location, weight]` pairs or bare locations (weighted by their length)."""

    shuffle: Shuffle
    providers: list[HttpLLMTrainingDataLocation]
    weights: list[float] | None

    @classmethod
    def from_obj(cls, obj: Any, source: str) -> WeightedHttpProvidersConfig:
        from psyche.coordinator.model import HttpLLMTrainingDataLocation

        if not isinstance(obj, dict) or set(obj) != {"shuffle", "providers"}:
            raise DataProviderError(
                f"{source}: expected an object with exactly `shuffle` and `providers`"
            )
        try:
            shuffle = from_obj(obj["shuffle"], Shuffle, source=source)
        except SerdeError as e:
            raise DataProviderError(f"{source}: shuffle: {e}") from e
        # serde's untagged enum: the weighted form is tried first, then the bare one.
        try:
            pairs = from_obj(
                obj["providers"], list[tuple[HttpLLMTrainingDataLocation, F64]], source=source
            )
            return cls(shuffle, [p for p, _ in pairs], [w for _, w in pairs])
        except SerdeError as weighted_error:
            try:
                bare = from_obj(obj["providers"], list[HttpLLMTrainingDataLocation], source=source)
            except SerdeError as bare_error:
                raise DataProviderError(
                    f"{source}: providers are neither [location, weight] pairs ({weighted_error})"
                    f" nor locations ({bare_error})"
                ) from bare_error
            return cls(shuffle, bare, None)


async def open_weighted_http_provider(
    config: WeightedHttpProvidersConfig, max_seq_len: int, http: HttpConfig
) -> WeightedDataProvider:
    providers: list[HttpDataProvider] = []
    try:
        for location in config.providers:
            providers.append(await open_http_provider(location, max_seq_len, http))
        return WeightedDataProvider(providers, config.weights, config.shuffle)
    except BaseException:
        for p in providers:
            await p.aclose()
        raise


async def fetch_weighted_config(url: str, http: HttpConfig) -> WeightedHttpProvidersConfig:
    def check(response: httpx.Response) -> Any:
        if not response.is_success:
            raise DataProviderError(f"GET {url}: {response.status_code}")
        try:
            return response.json()
        except (ValueError, json.JSONDecodeError) as e:
            raise DataProviderError(f"{url}: not JSON: {e}") from e

    async with new_http_client(http) as client:
        obj = await request_with_retries(
            client,
            "GET",
            url,
            what=f"GET {url}",
            policy=http.retry,
            timeout=http.request_timeout,
            check=check,
        )
    return WeightedHttpProvidersConfig.from_obj(obj, url)


async def data_provider_from_location(
    location: LLMTrainingDataLocation, options: ProviderOptions
) -> TokenizedDataProvider:
    """Open the provider for one data location (raises `DataProviderError` if it cannot)."""
    from psyche.coordinator.model import LLMTrainingDataLocation

    match location:
        case LLMTrainingDataLocation.Dummy():
            return DummyDataProvider(TokenSize.TwoBytes, DUMMY_SEQ_LEN, DUMMY_NUM_SEQUENCES)
        case LLMTrainingDataLocation.Server(address):
            if options.secret_key is None:
                raise DataProviderError("a Server data location needs the node's secret key")
            return await DataProviderTcpClient.connect(address, options.secret_key)
        case LLMTrainingDataLocation.Local(directory):
            return LocalDataProvider.new_from_directory(
                directory, options.local_token_size, options.max_seq_len, options.local_shuffle
            )
        case LLMTrainingDataLocation.Http(http_location):
            return await open_http_provider(http_location, options.max_seq_len, options.http)
        case LLMTrainingDataLocation.WeightedHttp(url):
            config = await fetch_weighted_config(url, options.http)
            return await open_weighted_http_provider(config, options.max_seq_len, options.http)
        case LLMTrainingDataLocation.Preprocessed(path):
            if not await trio.Path(path).exists():
                raise DataProviderError(
                    f"preprocessed dataset {path!r} is not a local path (downloading datasets "
                    "from the Hugging Face hub is not supported here)"
                )
            return PreprocessedDataProvider.new_from_directory(
                Path(path), options.max_seq_len, Shuffle.DontShuffle(), Split.Train, None
            )
    raise DataProviderError(f"not a data location: {location!r}")


async def aclose_provider(provider: object) -> None:
    close = getattr(provider, "aclose", None)
    if close is not None:
        await close()
    elif (sync_close := getattr(provider, "close", None)) is not None:
        sync_close()


class FallbackDataProvider:
    """Reads from the first working location of an ordered list, moving on when one fails."""

    def __init__(
        self,
        locations: Sequence[Any],
        open_location: Callable[[Any], Awaitable[TokenizedDataProvider]],
    ) -> None:
        if not locations:
            raise ValueError("no data locations")
        self.locations = list(locations)
        self._open_location = open_location
        self.current = 0
        self._provider: TokenizedDataProvider | None = None

    async def _open_from(self, first: int, failures: list[str]) -> TokenizedDataProvider:
        """Open the first location that works, starting at `first` and wrapping around once."""
        n = len(self.locations)
        for step in range(n - len(failures)):
            index = (first + step) % n
            try:
                provider = await self._open_location(self.locations[index])
            except (DataProviderError, OSError) as e:
                failures.append(f"#{index} {self.locations[index]!r}: {e}")
                log.warning("data location #%d unavailable (%s); trying the next one", index, e)
                continue
            self.current, self._provider = index, provider
            if index != 0:
                log.warning("reading training data from backup location #%d", index)
            return provider
        raise DataProviderError("no data location works: " + "; ".join(failures))

    async def ensure_open(self) -> TokenizedDataProvider:
        if self._provider is None:
            return await self._open_from(self.current, [])
        return self._provider

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        failures: list[str] = []
        provider = (
            await self._open_from(self.current, failures)
            if self._provider is None
            else self._provider
        )
        while True:
            try:
                return await provider.get_samples(data_ids)
            except DataProviderError as e:
                index = self.current
                failures.append(f"#{index} {self.locations[index]!r}: {e}")
                self._provider = None
                await aclose_provider(provider)
                if len(failures) >= len(self.locations):
                    raise DataProviderError(
                        f"{data_ids}: every data location failed: " + "; ".join(failures)
                    ) from e
                log.warning(
                    "data location #%d failed on %s (%s); moving to the next one",
                    index,
                    data_ids,
                    e,
                )
                provider = await self._open_from(index + 1, failures)

    async def aclose(self) -> None:
        if self._provider is not None:
            provider, self._provider = self._provider, None
            await aclose_provider(provider)


async def open_data_provider(
    locations: Sequence[LLMTrainingDataLocation], options: ProviderOptions
) -> FallbackDataProvider:
    """A provider over a run's data locations in order (the first one that opens is used)."""
    provider = FallbackDataProvider(
        locations, lambda location: data_provider_from_location(location, options)
    )
    await provider.ensure_open()
    return provider
