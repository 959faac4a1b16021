"""Pre-tokenized files on web servers and GCS buckets, read with byte-range requests
(upstream `HttpDataProvider` and `FileURLs`).

Sequences are cut from each file at `range(0, size - (seq_bytes + token_bytes), seq_bytes)`:
upstream reserves one extra token per file (meant as the label of the last token) but never
fetches it, and every sample is exactly `seq_len` tokens. A batch whose sequences are consecutive
in one file is fetched with a single range request, any other batch with one request per
sequence, concurrently.

One `httpx.AsyncClient` per provider keeps connections alive between batches. Requests that fail
transiently (connection errors, timeouts, 5xx, 429, a short body) are retried with a linear
backoff; other failures (404 and the like) are reported at once, so a fallback location can take
over quickly.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import numpy as np
import trio

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.token_size import TokenSize
from psyche.data_provider.retry import RetryPolicy
from psyche.data_provider.types import (
    DATA_FILE_EXTENSIONS,
    DataProviderError,
    TokenizedData,
    batch_bounds,
    decode_tokens,
    sequence_pointers,
    sequence_runs,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

HTTP_REQUEST_TIMEOUT = 5.0  # seconds, upstream's timeout for range requests
GCS_API_BASE = "https://storage.googleapis.com"


@dataclass(frozen=True)
class HttpConfig:
    """Knobs of the HTTP provider. The defaults follow upstream where it has a value."""

    request_timeout: float = HTTP_REQUEST_TIMEOUT
    # Upstream HEADs files three at a time and fetches every sequence of a batch at once; a cap
    # keeps a large non-contiguous batch from opening hundreds of connections.
    max_concurrent_heads: int = 3
    max_concurrent_requests: int = 32
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(max_retries=3, base_delay=0.5))
    gcs_api_base: str = GCS_API_BASE


class _Retryable(Exception):
    pass


def _check_url(url: str) -> str:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as e:
        raise DataProviderError(f"invalid url {url!r}: {e}") from e
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise DataProviderError(f"invalid url {url!r}: expected an http(s) URL with a host")
    return url


def new_http_client(config: HttpConfig) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=max(config.max_concurrent_requests, config.max_concurrent_heads),
        max_keepalive_connections=max(config.max_concurrent_requests, config.max_concurrent_heads),
    )
    # reqwest (upstream) follows redirects; httpx does not unless asked.
    return httpx.AsyncClient(limits=limits, follow_redirects=True)


async def request_with_retries(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    what: str,
    policy: RetryPolicy,
    timeout: float | None,
    check: Callable[[httpx.Response], T],
    headers: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
) -> T:
    """Send a request until `check` accepts the response or the retries run out.

    `check` raises `_Retryable` for a transient problem and `DataProviderError` for a final one.
    """
    last: str = ""
    attempts = policy.max_retries + 1
    for attempt in range(1, attempts + 1):
        if attempt > 1:
            delay = policy.delay(attempt - 1)
            log.warning(
                "%s: attempt %d/%d failed (%s); retrying in %.1fs",
                what,
                attempt - 1,
                attempts,
                last,
                delay,
            )
            await trio.sleep(delay)
        try:
            response = await client.request(
                method, url, headers=headers, params=params, timeout=timeout
            )
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
            continue
        try:
            if response.status_code == 429 or response.status_code >= 500:
                raise _Retryable(f"server returned {response.status_code}")
            return check(response)
        except _Retryable as e:
            last = str(e)
    raise DataProviderError(f"{what} failed after {attempts} attempts: {last}")


def _content_length(url: str) -> Callable[[httpx.Response], int]:
    def check(response: httpx.Response) -> int:
        if not response.is_success:
            raise DataProviderError(f"URL validation failed for {url}: {response.status_code}")
        header = response.headers.get("content-length", "")
        if not header.isdigit():
            raise DataProviderError(f"Missing or invalid Content-Length header for {url}")
        return int(header)

    return check


async def _gather_limited(jobs: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Run jobs concurrently, at most `limit` at once; results in job order, and the error of the
    first failing job (in job order) is raised, as upstream's join-then-iterate does."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)
    limiter = trio.CapacityLimiter(max(1, limit))

    async def run(i: int) -> None:
        async with limiter:
            try:
                results[i] = await jobs[i]()
            except (DataProviderError, httpx.HTTPError) as e:
                errors[i] = e

    async with trio.open_nursery() as nursery:
        for i in range(len(jobs)):
            nursery.start_soon(run, i)
    for e in errors:
        if e is not None:
            raise e
    return results


@dataclass(frozen=True)
class FileURLs:
    """The files of a dataset, in order, with their sizes in bytes."""

    files: tuple[tuple[str, int], ...]

    @classmethod
    async def from_list(
        cls, client: httpx.AsyncClient, urls: Sequence[str], config: HttpConfig
    ) -> FileURLs:
        checked = [_check_url(u) for u in urls]
        jobs = [
            (
                lambda u=u: request_with_retries(
                    client,
                    "HEAD",
                    u,
                    what=f"HEAD {u}",
                    policy=config.retry,
                    timeout=config.request_timeout,
                    check=_content_length(u),
                )
            )
            for u in checked
        ]
        sizes = await _gather_limited(jobs, config.max_concurrent_heads)
        return cls(tuple(zip(checked, sizes)))

    @staticmethod
    def template_urls(
        url_template: str, start_index: int, n_left_pad_zeros: int, num_files: int
    ) -> list[str]:
        found = url_template.count("{}")
        if found != 1:
            raise DataProviderError(
                f"invalid url {url_template}. expected 1 set of {{}} for number substitution, "
                f"got {found}"
            )
        return [
            url_template.replace("{}", str(start_index + i).rjust(n_left_pad_zeros, "0"))
            for i in range(num_files)
        ]

    @classmethod
    async def from_template(
        cls,
        client: httpx.AsyncClient,
        url_template: str,
        start_index: int,
        n_left_pad_zeros: int,
        num_files: int,
        config: HttpConfig,
    ) -> FileURLs:
        urls = cls.template_urls(url_template, start_index, n_left_pad_zeros, num_files)
        return await cls.from_list(client, urls, config)

    @classmethod
    async def from_gcp_bucket(
        cls,
        client: httpx.AsyncClient,
        bucket_name: str,
        directory: str | None,
        config: HttpConfig,
    ) -> FileURLs:
        """Data files of a public bucket through the anonymous GCS JSON API (all pages), sorted by
        URL; sizes come from the listing."""
        url = f"{config.gcs_api_base.rstrip('/')}/storage/v1/b/{bucket_name}/o"
        found: list[tuple[str, int]] = []
        page_token: str | None = None
        while True:
            params = {}
            if directory:
                params["prefix"] = directory
            if page_token is not None:
                params["pageToken"] = page_token
            page = await request_with_retries(
                client,
                "GET",
                url,
                what=f"listing gs://{bucket_name}/{directory or ''}",
                policy=config.retry,
                timeout=config.request_timeout,
                check=_json_listing(bucket_name),
                params=params,
            )
            found.extend(_data_objects(bucket_name, page))
            page_token = page.get("nextPageToken")
            if not page_token:
                break
        found.sort(key=lambda item: item[0])
        return cls(tuple(found))


def _json_listing(bucket: str) -> Callable[[httpx.Response], dict[str, Any]]:
    def check(response: httpx.Response) -> dict[str, Any]:
        if not response.is_success:
            raise DataProviderError(
                f"listing GCS bucket {bucket} failed: {response.status_code} {response.text[:200]}"
            )
        try:
            page = response.json()
        except ValueError as e:
            raise DataProviderError(f"listing GCS bucket {bucket}: not JSON: {e}") from e
        if not isinstance(page, dict):
            raise DataProviderError(f"listing GCS bucket {bucket}: expected a JSON object")
        return page

    return check


def _data_objects(bucket: str, page: dict[str, Any]) -> list[tuple[str, int]]:
    out = []
    items = page.get("items", [])
    if not isinstance(items, list):
        raise DataProviderError(f"listing GCS bucket {bucket}: `items` is not a list")
    for obj in items:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise DataProviderError(f"listing GCS bucket {bucket}: malformed object {obj!r}")
        # Upstream compares the last '.'-separated part of the name (so `x.ds.index` is skipped).
        if obj["name"].rsplit(".", 1)[-1] not in DATA_FILE_EXTENSIONS:
            continue
        link, size = obj.get("mediaLink"), str(obj.get("size", ""))
        if not isinstance(link, str) or not size.isdigit():
            raise DataProviderError(
                f"listing GCS bucket {bucket}: object {obj['name']!r} lacks mediaLink or size"
            )
        out.append((_check_url(link), int(size)))
    return out


def _range_body(url: str, start: int, length: int) -> Callable[[httpx.Response], bytes]:
    def check(response: httpx.Response) -> bytes:
        if not response.is_success:
            raise DataProviderError(
                f"Server returned unexpected status code {response.status_code} for bytes "
                f"{start}-{start + length - 1} of {url}"
            )
        body = response.content
        if len(body) != length:
            # A server that ignores Range sends the whole file: never retry that.
            problem = (
                f"Received unexpected number of bytes from {url}: got {len(body)}, "
                f"expected {length}"
            )
            if response.status_code == 200 and len(body) > length:
                raise DataProviderError(problem + " (does the server support Range requests?)")
            raise _Retryable(problem)
        return body

    return check


class HttpDataProvider:
    """Sequences of `seq_len` tokens fetched with range requests; see the module docstring."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        file_urls: FileURLs,
        token_size: TokenSize,
        seq_len: int,
        shuffle: Shuffle,
        config: HttpConfig | None = None,
    ) -> None:
        if seq_len <= 0:
            raise DataProviderError(f"seq_len must be positive, got {seq_len}")
        self._client = client
        self._config = config or HttpConfig()
        self.urls = [url for url, _ in file_urls.files]
        self.seq_len = seq_len
        self.token_size = token_size
        token_bytes = token_size.num_bytes
        seq_bytes = seq_len * token_bytes
        offsets: list[np.ndarray] = []
        for url, size in file_urls.files:
            if size % token_bytes:
                raise DataProviderError(
                    f"{url} is {size} bytes, not a whole number of {token_bytes}-byte tokens "
                    "(wrong token_size_in_bytes, or a truncated file)"
                )
            reserved = seq_bytes + token_bytes
            if size <= reserved:
                log.warning(
                    "%s (%d bytes) is too short for one sequence of %d tokens", url, size, seq_len
                )
                offsets.append(np.empty(0, dtype=np.int64))
                continue
            offsets.append(np.arange(0, size - reserved, seq_bytes, dtype=np.int64))
        file_index, byte_offset = sequence_pointers(offsets, shuffle)
        self._file_index = file_index
        self._byte_offset = byte_offset
        self._run = sequence_runs(file_index, byte_offset, seq_bytes)
        log.info(
            "Created HTTP data provider for %d files with %d sequences",
            len(self.urls),
            len(file_index),
        )

    @classmethod
    async def open(
        cls,
        file_urls: Callable[[httpx.AsyncClient], Awaitable[FileURLs]],
        token_size: TokenSize,
        seq_len: int,
        shuffle: Shuffle,
        config: HttpConfig | None = None,
    ) -> HttpDataProvider:
        """Make a client, list the files with it (`file_urls(client)`), and build the provider."""
        config = config or HttpConfig()
        client = new_http_client(config)
        try:
            urls = await file_urls(client)
            return cls(client, urls, token_size, seq_len, shuffle, config)
        except BaseException:
            await client.aclose()
            raise

    def num_sequences(self) -> int:
        return len(self._file_index)

    async def _fetch(self, url: str, start: int, length: int) -> np.ndarray:
        body = await request_with_retries(
            self._client,
            "GET",
            url,
            what=f"GET {url} bytes={start}-{start + length - 1}",
            policy=self._config.retry,
            timeout=self._config.request_timeout,
            check=_range_body(url, start, length),
            headers={"Range": f"bytes={start}-{start + length - 1}"},
        )
        return decode_tokens(body, self.token_size)

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        start, end = batch_bounds(data_ids)
        n = self.num_sequences()
        if end >= n:
            raise DataProviderError(
                f"index {max(start, n)} is out of bounds, we only have {n} samples."
            )
        seq_bytes = self.seq_len * self.token_size.num_bytes
        count = end - start + 1
        if count > 1 and self._run[start] == self._run[end]:
            url = self.urls[int(self._file_index[start])]
            tokens = await self._fetch(url, int(self._byte_offset[start]), seq_bytes * count)
            return TokenizedData.from_rows(tokens.reshape(count, self.seq_len))
        files = self._file_index[start : end + 1].tolist()
        offsets = self._byte_offset[start : end + 1].tolist()
        jobs = [
            (lambda f=f, o=o: self._fetch(self.urls[f], o, seq_bytes))
            for f, o in zip(files, offsets)
        ]
        rows = await _gather_limited(jobs, self._config.max_concurrent_requests)
        return TokenizedData.from_rows(np.stack(rows))

    async def aclose(self) -> None:
        await self._client.aclose()
