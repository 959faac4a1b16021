"""From run-config data locations to providers, backup locations, and the retry loop."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import trio

from psyche.coordinator.model import (
    Gcp,
    HttpLLMTrainingDataLocation,
    HttpTrainingDataLocation,
    LLMTrainingDataLocation,
    NumberedFiles,
)
from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.identity import SecretKey
from psyche.core.token_size import TokenSize
from psyche.data_provider import (
    DataProviderError,
    DataProviderTcpClient,
    DataProviderTcpServer,
    DummyDataProvider,
    FallbackDataProvider,
    HttpConfig,
    HttpDataProvider,
    LocalDataProvider,
    PreprocessedDataProvider,
    ProviderOptions,
    RetryPolicy,
    TokenizedData,
    WeightedDataProvider,
    data_provider_from_location,
    get_samples_with_retries,
    open_data_provider,
)
from psyche.data_provider.factory import aclose_provider

from .conftest import serve_until

pytestmark = pytest.mark.anyio
FAST_HTTP = HttpConfig(request_timeout=2.0, retry=RetryPolicy(1, 0.01))
SEQ = 8


def http_location(location: HttpTrainingDataLocation) -> LLMTrainingDataLocation:
    return LLMTrainingDataLocation.Http(
        HttpLLMTrainingDataLocation(location, TokenSize.TwoBytes, Shuffle.DontShuffle())
    )


@pytest.fixture
def dataset(http_root: Path, write_tokens) -> Path:
    # 0.ds and 1.ds: 5 sequences' worth each (4 usable: upstream's exclusive bound).
    for i in range(2):
        write_tokens(http_root / "bucket" / "set" / f"{i}.ds", np.arange(5 * SEQ) + 1000 * i)
    return http_root / "bucket" / "set"


async def test_every_location_kind(tmp_path: Path, dataset: Path, http_server) -> None:
    key = SecretKey.generate()
    options = ProviderOptions(max_seq_len=SEQ, secret_key=key, http=FAST_HTTP)
    gcs_options = ProviderOptions(
        max_seq_len=SEQ, http=HttpConfig(retry=FAST_HTTP.retry, gcs_api_base=http_server.url)
    )
    base = http_server.url + "/bucket/set"
    local = LocalDataProvider.new_from_directory(
        dataset, TokenSize.TwoBytes, SEQ, Shuffle.DontShuffle()
    )
    in_local_order = await local.get_samples(BatchId(0, 7))  # directory-listing order of files
    # HTTP locations order files by name (numbered) or URL (GCS).
    expected = [
        TokenizedData.from_input_ids(np.arange(SEQ) + 1000 * f + SEQ * s)
        for f in range(2)
        for s in range(4)
    ]
    assert sorted(in_local_order, key=lambda t: int(t.input_ids[0])) == expected
    single = http_location(HttpTrainingDataLocation.SingleUrl(base + "/0.ds"))
    numbered = http_location(
        HttpTrainingDataLocation.NumberedFiles(NumberedFiles(base + "/{}.ds", 0, 0, 2))
    )
    gcp = http_location(HttpTrainingDataLocation.Gcp(Gcp("bucket", "set")))
    mix = {
        "shuffle": "DontShuffle",
        "providers": [
            {
                "location": {"SingleUrl": f"{base}/1.ds"},
                "token_size_in_bytes": "TwoBytes",
                "shuffle": "DontShuffle",
            }
        ],
    }
    (http_server.root / "mix.json").write_text(json.dumps(mix))
    parquet_dir = tmp_path / "pre"
    parquet_dir.mkdir()
    pq.write_table(
        pa.table({"inputs": pa.array([[7] * SEQ], type=pa.list_(pa.int32()))}),
        parquet_dir / "train.parquet",
    )

    async with DataProviderTcpServer.start(
        local, host="127.0.0.1", allowed=[key.public_key]
    ) as server:
        cases = [
            (LLMTrainingDataLocation.Dummy(), options, DummyDataProvider),
            (LLMTrainingDataLocation.Local(str(dataset)), options, LocalDataProvider),
            (single, options, HttpDataProvider),
            (numbered, options, HttpDataProvider),
            (gcp, gcs_options, HttpDataProvider),
            (
                LLMTrainingDataLocation.WeightedHttp(http_server.url + "/mix.json"),
                options,
                WeightedDataProvider,
            ),
            (
                LLMTrainingDataLocation.Server(f"127.0.0.1:{server.local_addr[1]}"),
                options,
                DataProviderTcpClient,
            ),
            (
                LLMTrainingDataLocation.Preprocessed(str(parquet_dir)),
                options,
                PreprocessedDataProvider,
            ),
        ]
        for location, opts, kind in cases:
            provider = await data_provider_from_location(location, opts)
            try:
                assert isinstance(provider, kind), location
                match location:
                    case LLMTrainingDataLocation.Dummy():
                        (sample,) = await provider.get_samples(BatchId(5, 5))
                        assert sample.input_ids.tolist() == [0] * 2048  # upstream: always 2048
                    case LLMTrainingDataLocation.WeightedHttp(_):
                        assert await provider.get_samples(BatchId(0, 3)) == expected[4:8]
                    case LLMTrainingDataLocation.Preprocessed(_):
                        assert (await provider.get_samples(BatchId(0, 0)))[
                            0
                        ].input_ids.tolist() == [7] * SEQ
                    case _ if location is single:
                        assert await provider.get_samples(BatchId(0, 3)) == expected[:4]
                    case LLMTrainingDataLocation.Local(_) | LLMTrainingDataLocation.Server(_):
                        assert await provider.get_samples(BatchId(0, 7)) == in_local_order
                    case _:
                        assert await provider.get_samples(BatchId(0, 7)) == expected
            finally:
                await aclose_provider(provider)
    with pytest.raises(DataProviderError, match="needs the node's secret key"):
        await data_provider_from_location(
            LLMTrainingDataLocation.Server("127.0.0.1:1"), ProviderOptions(max_seq_len=SEQ)
        )
    with pytest.raises(DataProviderError, match="not a local path"):
        await data_provider_from_location(
            LLMTrainingDataLocation.Preprocessed("org/dataset"), options
        )
    local.close()


async def test_backup_location_used_when_the_first_is_missing(
    dataset: Path, http_server, caplog
) -> None:
    caplog.set_level(logging.WARNING)
    locations = [
        http_location(
            HttpTrainingDataLocation.SingleUrl(http_server.url + "/bucket/set/missing.ds")
        ),
        LLMTrainingDataLocation.Local(str(dataset)),
    ]
    provider = await open_data_provider(locations, ProviderOptions(max_seq_len=SEQ, http=FAST_HTTP))
    try:
        assert provider.current == 1
        assert len(await provider.get_samples(BatchId(0, 7))) == 8
        assert "missing.ds: 404" in caplog.text
    finally:
        await provider.aclose()


async def test_fallback_mid_run_gives_the_same_tokens(
    http_root: Path, http_server, write_tokens, caplog
) -> None:
    caplog.set_level(logging.WARNING)
    key = SecretKey.generate()
    # One file: a data server lists files in directory order, an HTTP mirror in name order.
    write_tokens(http_root / "mirror" / "0.ds", np.arange(9 * SEQ))
    local = LocalDataProvider.new_from_directory(
        http_root / "mirror", TokenSize.TwoBytes, SEQ, Shuffle.DontShuffle()
    )
    options = ProviderOptions(max_seq_len=SEQ, secret_key=key, http=FAST_HTTP)
    async with trio.open_nursery() as nursery:
        stop = trio.CancelScope()
        port = await serve_until(nursery, local, stop)
        numbered = NumberedFiles(http_server.url + "/mirror/{}.ds", 0, 0, 1)
        locations = [
            LLMTrainingDataLocation.Server(f"127.0.0.1:{port}"),
            http_location(HttpTrainingDataLocation.NumberedFiles(numbered)),
        ]
        provider = await open_data_provider(locations, options)
        before = await provider.get_samples(BatchId(0, 7))
        assert provider.current == 0
        stop.cancel()
    after = await provider.get_samples(BatchId(0, 7))
    assert provider.current == 1
    assert after == before
    assert "moving to the next one" in caplog.text
    await provider.aclose()
    local.close()


async def test_every_location_failing_names_each_failure(http_server) -> None:
    locations = [
        http_location(HttpTrainingDataLocation.SingleUrl(http_server.url + "/a.ds")),
        LLMTrainingDataLocation.Local("/nonexistent/psyche-data"),
    ]
    with pytest.raises(
        DataProviderError, match=r"no data location works: #0 .*a\.ds: 404.*#1 .*Failed to open"
    ):
        await open_data_provider(locations, ProviderOptions(max_seq_len=SEQ, http=FAST_HTTP))


class FailsTwice:
    def __init__(self) -> None:
        self.calls = 0

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        self.calls += 1
        if self.calls <= 2:
            raise DataProviderError(f"transient #{self.calls}")
        return [TokenizedData.from_input_ids([1])]


async def test_retry_loop_like_upstreams_client() -> None:
    flaky = FailsTwice()
    assert len(await get_samples_with_retries(flaky, BatchId(0, 0), RetryPolicy(2, 0.001))) == 1
    with pytest.raises(DataProviderError, match=r"after 1 retries: transient #2"):
        await get_samples_with_retries(FailsTwice(), BatchId(0, 0), RetryPolicy(1, 0.001))
    assert RetryPolicy().max_retries == 7
    assert RetryPolicy().delay(1) == 0
    assert RetryPolicy().delay(3) == 4.0


async def test_dummy_accepts_id_equal_to_count() -> None:
    dummy = DummyDataProvider(TokenSize.TwoBytes, 4, 10)
    assert len(await dummy.get_samples(BatchId(9, 10))) == 2
    with pytest.raises(DataProviderError, match=r"id 11 > self.num_sequences 10"):
        await dummy.get_samples(BatchId(9, 11))


async def test_fallback_wraps_and_tries_each_location_once() -> None:
    opened: list[str] = []

    class Broken:
        async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
            raise DataProviderError("down")

    async def open_location(name: str) -> Broken:
        opened.append(name)
        return Broken()

    provider = FallbackDataProvider(["a", "b", "c"], open_location)
    with pytest.raises(
        DataProviderError,
        match="every data location failed: #0 'a': down; #1 'b': down; #2 'c': down",
    ):
        await provider.get_samples(BatchId(0, 0))
    assert opened == ["a", "b", "c"]
