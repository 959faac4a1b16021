"""HttpDataProvider and FileURLs against a real HTTP server on loopback (Range, keep-alive, a
fake GCS listing API), including the failure paths."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.token_size import TokenSize
from psyche.data_provider import (
    DataProviderError,
    FileURLs,
    HttpConfig,
    HttpDataProvider,
    RetryPolicy,
)
from psyche.data_provider.static_http import RangeRequestHandler, parse_range, serve_directory

pytestmark = pytest.mark.anyio
FAST = HttpConfig(request_timeout=2.0, retry=RetryPolicy(max_retries=2, base_delay=0.01))


def le(a: int, b: int) -> int:
    return int.from_bytes(bytes([a, b]), "little")


@pytest.fixture
def two_files(http_root: Path) -> Path:
    # Upstream's test files: 000.ds = bytes 0..15, 001.ds = bytes 16..31.
    (http_root / "000.ds").write_bytes(bytes(range(16)))
    (http_root / "001.ds").write_bytes(bytes(range(16, 32)))
    return http_root


async def open_template(server, shuffle: Shuffle, config: HttpConfig = FAST) -> HttpDataProvider:
    template = server.url + "/{}.ds"
    return await HttpDataProvider.open(
        lambda c: FileURLs.from_template(c, template, 0, 3, 2, config),
        TokenSize.TwoBytes,
        3,
        shuffle,
        config,
    )


async def test_upstream_http_provider_samples(two_files, http_server) -> None:
    provider = await open_template(http_server, Shuffle.DontShuffle())
    try:
        # 16 bytes, 3 two-byte tokens: offsets range(0, 16 - 8, 6) = 0, 6 -> 2 per file.
        assert provider.num_sequences() == 4
        (first,) = await provider.get_samples(BatchId(0, 0))
        assert first.input_ids.tolist() == [le(0, 1), le(2, 3), le(4, 5)]
        (second,) = await provider.get_samples(BatchId(1, 1))
        assert second.input_ids.tolist() == [le(6, 7), le(8, 9), le(10, 11)]
        (third,) = await provider.get_samples(BatchId(2, 2))
        assert third.input_ids.tolist() == [le(16, 17), le(18, 19), le(20, 21)]
    finally:
        await provider.aclose()


async def test_upstream_http_provider_shuffled(two_files, http_server) -> None:
    seeded = [await open_template(http_server, Shuffle.Seeded(bytes([42] * 32))) for _ in range(2)]
    plain = await open_template(http_server, Shuffle.DontShuffle())
    try:
        a = await seeded[0].get_samples(BatchId(0, 3))
        assert a == await seeded[1].get_samples(BatchId(0, 3))
        unshuffled = await plain.get_samples(BatchId(0, 3))
        assert a[0] != unshuffled[0]
        assert a == [unshuffled[i] for i in (3, 1, 2, 0)]  # rand 0.9 order of 4 items, seed [42;32]
    finally:
        for p in (*seeded, plain):
            await p.aclose()


async def test_consecutive_batch_is_one_range_request_over_one_connection(
    http_root: Path, http_server, write_tokens
) -> None:
    write_tokens(http_root / "big.ds", np.arange(10_000) % 50_000)
    provider = await HttpDataProvider.open(
        lambda c: FileURLs.from_list(c, [http_server.url + "/big.ds"], FAST),
        TokenSize.TwoBytes,
        100,
        Shuffle.DontShuffle(),
        FAST,
    )
    try:
        before = len(http_server.requests)
        connections = http_server.connections_accepted
        samples = await provider.get_samples(BatchId(10, 29))
        assert len(http_server.requests) == before + 1
        assert [int(s.input_ids[0]) for s in samples] == list(range(1000, 3000, 100))
        for i in range(5):
            await provider.get_samples(BatchId(i, i))
        assert len(http_server.requests) == before + 6
        assert http_server.connections_accepted == connections  # the HEAD's connection, kept alive
    finally:
        await provider.aclose()


def test_template_urls() -> None:
    assert FileURLs.template_urls("http://h/{}.ds", 7, 3, 2) == [
        "http://h/007.ds",
        "http://h/008.ds",
    ]
    assert FileURLs.template_urls("http://h/{}.ds", 1234, 3, 1) == ["http://h/1234.ds"]
    assert FileURLs.template_urls("http://h/{}.ds", 5, 0, 1) == ["http://h/5.ds"]
    for bad, count in (("http://h/x.ds", 0), ("http://h/{}/{}.ds", 2)):
        with pytest.raises(
            DataProviderError, match=f"expected 1 set of {{}} for number substitution, got {count}"
        ):
            FileURLs.template_urls(bad, 0, 3, 1)


async def test_gcs_listing_is_paginated_filtered_and_sorted(
    http_root: Path, http_server, write_tokens
) -> None:
    bucket = http_root / "bucket"
    write_tokens(bucket / "data" / "001.ds", range(100, 140))
    write_tokens(bucket / "data" / "000.ds", range(0, 40))
    write_tokens(bucket / "data" / "000.ds.index", range(4))  # not data: last '.' part is "index"
    (bucket / "data" / "meta.json").write_text("{}")
    (bucket / "data" / "README").write_text("no extension")
    write_tokens(bucket / "other" / "002.ds", range(200, 240))
    config = HttpConfig(request_timeout=2.0, retry=FAST.retry, gcs_api_base=http_server.url)
    provider = await HttpDataProvider.open(
        lambda c: FileURLs.from_gcp_bucket(c, "bucket", "data", config),
        TokenSize.TwoBytes,
        10,
        Shuffle.DontShuffle(),
        config,
    )
    try:
        assert provider.urls == [
            f"{http_server.url}/bucket/data/000.ds",
            f"{http_server.url}/bucket/data/001.ds",
        ]
        listings = [r for r in http_server.requests if r.startswith("/storage/v1/b/bucket/o")]
        assert len(listings) == 3  # 5 objects under data/, 2 per page
        samples = await provider.get_samples(BatchId(0, provider.num_sequences() - 1))
        assert [int(s.input_ids[0]) for s in samples] == [0, 10, 20, 100, 110, 120]
        whole = await FileURLs.from_gcp_bucket(provider._client, "bucket", None, config)
        assert [u.rsplit("/", 2)[-2] for u, _ in whole.files] == ["data", "data", "other"]
    finally:
        await provider.aclose()


async def test_missing_file_fails_at_once(two_files, http_server) -> None:
    template = http_server.url + "/{}.ds"
    before = len(http_server.requests)
    with pytest.raises(DataProviderError, match=r"URL validation failed for .*/002\.ds: 404"):
        await HttpDataProvider.open(
            lambda c: FileURLs.from_template(c, template, 1, 3, 2, FAST),
            TokenSize.TwoBytes,
            3,
            Shuffle.DontShuffle(),
            FAST,
        )
    assert len(http_server.requests) - before == 2  # one HEAD each, no retries of a 404


async def test_wrong_token_size_is_reported(http_root: Path, http_server) -> None:
    (http_root / "odd.ds").write_bytes(bytes(4 * 50 + 2))
    with pytest.raises(DataProviderError, match="not a whole number of 4-byte tokens"):
        await HttpDataProvider.open(
            lambda c: FileURLs.from_list(c, [http_server.url + "/odd.ds"], FAST),
            TokenSize.FourBytes,
            5,
            Shuffle.DontShuffle(),
            FAST,
        )


class IgnoresRange(RangeRequestHandler):
    def serve(self, send_body: bool) -> None:
        if "Range" in self.headers:
            del self.headers["Range"]
        super().serve(send_body)


async def test_server_without_range_support_is_a_clear_error(two_files) -> None:
    with serve_directory(two_files, handler=IgnoresRange) as server:
        provider = await open_template(server, Shuffle.DontShuffle())
        try:
            with pytest.raises(DataProviderError, match="does the server support Range"):
                await provider.get_samples(BatchId(0, 0))
        finally:
            await provider.aclose()


class Flaky(RangeRequestHandler):
    failures_left = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        with Flaky.lock:
            fail = Flaky.failures_left > 0
            Flaky.failures_left -= fail
        if fail:
            self.send_empty(503)
        else:
            super().do_GET()


async def test_transient_errors_are_retried_then_reported(two_files) -> None:
    with serve_directory(two_files, handler=Flaky) as server:
        provider = await open_template(server, Shuffle.DontShuffle())
        try:
            Flaky.failures_left = 2  # max_retries=2: the third attempt succeeds
            (sample,) = await provider.get_samples(BatchId(0, 0))
            assert sample.input_ids.tolist() == [le(0, 1), le(2, 3), le(4, 5)]
            Flaky.failures_left = 3
            with pytest.raises(
                DataProviderError, match=r"failed after 3 attempts: server returned 503"
            ):
                await provider.get_samples(BatchId(1, 1))
        finally:
            Flaky.failures_left = 0
            await provider.aclose()


async def test_server_gone_mid_run_and_unreachable_server(two_files) -> None:
    with serve_directory(two_files) as server:
        provider = await open_template(server, Shuffle.DontShuffle())
        url = server.url
    try:
        with pytest.raises(
            DataProviderError,
            match=r"GET .*/000\.ds bytes=0-5 failed after 3 attempts: ConnectError",
        ):
            await provider.get_samples(BatchId(0, 0))
    finally:
        await provider.aclose()
    with pytest.raises(DataProviderError, match=r"HEAD .* failed after 3 attempts"):
        await HttpDataProvider.open(
            lambda c: FileURLs.from_list(c, [url + "/000.ds"], FAST),
            TokenSize.TwoBytes,
            3,
            Shuffle.DontShuffle(),
            FAST,
        )


async def test_out_of_range_batch(two_files, http_server) -> None:
    provider = await open_template(http_server, Shuffle.DontShuffle())
    try:
        with pytest.raises(
            DataProviderError, match=r"index 4 is out of bounds, we only have 4 samples\."
        ):
            await provider.get_samples(BatchId(2, 9))
    finally:
        await provider.aclose()


def test_parse_range() -> None:
    assert parse_range("bytes=0-5", 16) == (0, 5)
    assert parse_range("bytes=10-", 16) == (10, 15)
    assert parse_range("bytes=-4", 16) == (12, 15)
    assert parse_range("bytes=3-100", 16) == (3, 15)
    assert parse_range("bytes=16-20", 16) is None
    with pytest.raises(ValueError, match="unsupported Range header"):
        parse_range("bytes=1-2,5-6", 16)
