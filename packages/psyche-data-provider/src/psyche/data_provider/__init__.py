"""Training data providers for Psyche: local token files, HTTP/GCS, weighted mixes, preprocessed
parquet and the TCP data server.

Every provider answers `await provider.get_samples(BatchId(start, end))` with one
`TokenizedData` (int32 numpy arrays) per id, in id order, the same on every machine. The local
provider and the TCP client also answer `await provider.get_batch(...)` with the same tokens as
one int32 `[n, seq_len]` array (`BatchDataProvider`), their fast path. Providers that hold
connections have `aclose()`.
"""

from psyche.data_provider.data_config import DataConfigError, DataServerInfo
from psyche.data_provider.dummy import DummyDataProvider
from psyche.data_provider.factory import (
    FallbackDataProvider,
    ProviderOptions,
    WeightedHttpProvidersConfig,
    data_provider_from_location,
    open_data_provider,
)
from psyche.data_provider.http import FileURLs, HttpConfig, HttpDataProvider
from psyche.data_provider.local import LocalDataProvider
from psyche.data_provider.preprocessed import PreprocessedDataProvider, Split
from psyche.data_provider.retry import RetryPolicy, get_samples_with_retries
from psyche.data_provider.tcp_client import DataProviderTcpClient
from psyche.data_provider.tcp_server import DataProviderTcpServer
from psyche.data_provider.types import (
    DATA_FILE_EXTENSIONS,
    PARQUET_EXTENSION,
    BatchDataProvider,
    DataProviderError,
    LengthKnownDataProvider,
    TokenizedData,
    TokenizedDataProvider,
    stack_input_ids,
)
from psyche.data_provider.weighted import WeightedDataProvider

__all__ = [
    "DATA_FILE_EXTENSIONS",
    "PARQUET_EXTENSION",
    "BatchDataProvider",
    "DataConfigError",
    "DataProviderError",
    "DataProviderTcpClient",
    "DataProviderTcpServer",
    "DataServerInfo",
    "DummyDataProvider",
    "FallbackDataProvider",
    "FileURLs",
    "HttpConfig",
    "HttpDataProvider",
    "LengthKnownDataProvider",
    "LocalDataProvider",
    "PreprocessedDataProvider",
    "ProviderOptions",
    "RetryPolicy",
    "Split",
    "TokenizedData",
    "TokenizedDataProvider",
    "WeightedDataProvider",
    "WeightedHttpProvidersConfig",
    "data_provider_from_location",
    "get_samples_with_retries",
    "open_data_provider",
    "stack_input_ids",
]
