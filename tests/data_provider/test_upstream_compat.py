"""Upstream's own test resources give upstream's expected samples (skipped when
PSYCHE_UPSTREAM_DATA is unset; a failure when it is set and a file is missing)."""

from __future__ import annotations

import json

import pytest

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.identity import SecretKey
from psyche.core.token_size import TokenSize
from psyche.data_provider import (
    DataProviderTcpClient,
    DataProviderTcpServer,
    FileURLs,
    HttpConfig,
    HttpDataProvider,
    LocalDataProvider,
    PreprocessedDataProvider,
    Split,
)
from psyche.data_provider.static_http import serve_directory

from ..upstream_data import UpstreamData

pytestmark = pytest.mark.anyio
SEED = bytes(range(1, 33))


@pytest.fixture(scope="module")
def tokenizer(upstream_data: UpstreamData):
    import tokenizers  # a dependency of psyche-centralized: never a reason to skip

    return tokenizers.Tokenizer.from_file(
        str(upstream_data.path("data-provider", "llama2_tokenizer.json"))
    )


@pytest.mark.parametrize("name", ["dolma", "fineweb"])
async def test_pretraining_subsets_decode_to_upstreams_text(
    upstream_data: UpstreamData, tokenizer, name: str
) -> None:
    root = upstream_data.path("data-provider", name)
    with LocalDataProvider.new_from_directory(
        root / "data", TokenSize.TwoBytes, 2048, Shuffle.Seeded(SEED)
    ) as p:
        samples = await p.get_samples(BatchId(0, 1))
    assert len(samples) == 2
    for i, sample in enumerate(samples):
        assert len(sample.input_ids) == 2048  # seq_len tokens, no extra label token
        decoded = tokenizer.decode(
            sample.input_ids.astype("uint32").tolist(), skip_special_tokens=True
        )
        expected = upstream_data.path("data-provider", name, "decoded", f"{i}.txt")
        assert decoded == expected.read_text(encoding="utf-8")


async def test_fineweb_over_http_and_tcp_matches_local(upstream_data: UpstreamData) -> None:
    data = upstream_data.path("data-provider", "fineweb", "data")
    with LocalDataProvider.new_from_directory(
        data, TokenSize.TwoBytes, 2048, Shuffle.Seeded(SEED)
    ) as local:
        expected = await local.get_samples(BatchId(0, 1))
        key = SecretKey.generate()
        async with DataProviderTcpServer.start(local, host="127.0.0.1", allow_any=True) as server:
            client = await DataProviderTcpClient.connect(f"127.0.0.1:{server.local_addr[1]}", key)
            try:
                assert await client.get_samples(BatchId(0, 1)) == expected
            finally:
                await client.aclose()
    with serve_directory(data) as http_server:
        cfg = HttpConfig()
        url = f"{http_server.url}/00000_00000_shuffled.ds"
        http = await HttpDataProvider.open(
            lambda c: FileURLs.from_list(c, [url], cfg),
            TokenSize.TwoBytes,
            2048,
            Shuffle.Seeded(SEED),
            cfg,
        )
        try:
            # 12288 bytes: upstream's HTTP bound reserves one token, leaving 2 sequences as well.
            assert await http.get_samples(BatchId(0, 1)) == expected
        finally:
            await http.aclose()


async def test_hermes3_parquet_rows(upstream_data: UpstreamData) -> None:
    p = PreprocessedDataProvider.new_from_directory(
        upstream_data.path("data-provider", "hermes3", "data"),
        4096,
        Shuffle.Seeded(SEED),
        Split.Train,
        None,
    )
    samples = await p.get_samples(BatchId(0, 1))
    assert len(samples) == 2
    for i, sample in enumerate(samples):
        decoded = upstream_data.path("data-provider", "hermes3", "decoded", f"{i}.json")
        expected = json.loads(decoded.read_text())
        assert sample.input_ids.tolist() == expected["inputs"]
        assert sample.labels.tolist() == expected["labels"]
        assert sample.position_ids.tolist() == expected["position_ids"]
        assert sample.sequence_lengths.tolist() == expected["sequence_lengths"]
