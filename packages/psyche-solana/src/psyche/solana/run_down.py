"""A client of Nous' "run-down" service, which keeps a run's result files and hands out signed
storage URLs for them (upstream run-manager `run_down_service.rs`, behind `download-results`
and `upload-data`).

The protocol, as upstream speaks it: a POST to `{base}/download/{run_id}` (body
`{"expiresInSeconds", "nonce"}`) or `{base}/upload/{run_id}` (body `{"filename",
"expiresInSeconds", "nonce"}`), authenticated by the header `X-Solana-Signature`: the wallet's
base58 ed25519 signature of `nous-run-down-service:{run_id}:{expires_in_seconds}:{nonce}`. The
answers are `{"urls": [{"path", "url"}], "expiresAt"}` and `{"url", "expiresAt"}`; the files
then move with plain GETs and PUTs (`application/octet-stream`) on those signed URLs.

Bounds: the service's JSON answers are read up to 16 MiB, and a download is written under the
output directory only (a path from the service that escapes it is refused), through a
temporary file renamed into place once complete.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import trio
from solders.signature import Signature

from psyche.solana.admin import AdminError

RUN_DOWN_SERVICE_BASE_URL = "https://run-down.nousresearch.com/v1"
MAX_ANSWER_BYTES = 16 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024
# Connecting and each read or write wait at most this long (a stalled transfer fails).
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=30.0)


class RunDownError(AdminError):
    """The service or a storage URL refused or failed a request."""


def signed_message(run_id: str, expires_in_seconds: int, nonce: int) -> bytes:
    return f"nous-run-down-service:{run_id}:{expires_in_seconds}:{nonce}".encode()


def generate_signature(
    sign: Callable[[bytes], Signature], run_id: str, expires_in_seconds: int, nonce: int
) -> str:
    """The `X-Solana-Signature` header for one request (base58)."""
    return str(sign(signed_message(run_id, expires_in_seconds, nonce)))


def random_nonce() -> int:
    """A random u64, as upstream's `rand::random()`."""
    return secrets.randbits(64)


@dataclass(frozen=True)
class DownloadUrl:
    path: str
    url: str


@dataclass(frozen=True)
class DownloadUrls:
    urls: list[DownloadUrl]
    expires_at: str


@dataclass(frozen=True)
class UploadUrl:
    url: str
    expires_at: str


def new_http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=HTTP_TIMEOUT, follow_redirects=True)


async def _signed_post(
    http: httpx.AsyncClient, url: str, signature: str, body: dict[str, Any]
) -> Any:
    try:
        async with http.stream(
            "POST", url, json=body, headers={"X-Solana-Signature": signature}
        ) as response:
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > MAX_ANSWER_BYTES:
                    raise RunDownError(
                        f"the run-down service's answer from {url} exceeds {MAX_ANSWER_BYTES} bytes"
                    )
    except httpx.HTTPError as e:
        raise RunDownError(f"Failed to send request to run-down service at {url}: {e}") from None
    if not response.is_success:
        text = data.decode("utf-8", "replace")[:2000]
        raise RunDownError(f"API request failed with status {response.status_code}: {text}")
    try:
        return json.loads(bytes(data))
    except ValueError as e:
        raise RunDownError(f"Failed to parse response JSON from {url}: {e}") from None


def _field(obj: Any, name: str, what: str) -> str:
    value = obj.get(name) if isinstance(obj, dict) else None
    if not isinstance(value, str):
        raise RunDownError(f"Failed to parse {what} response: no string field {name!r}")
    return value


async def get_download_urls(
    http: httpx.AsyncClient,
    base_url: str,
    run_id: str,
    signature: str,
    expires_in_seconds: int,
    nonce: int,
) -> DownloadUrls:
    """Signed URLs of every file the service keeps for the run."""
    answer = await _signed_post(
        http,
        f"{base_url.rstrip('/')}/download/{run_id}",
        signature,
        {"expiresInSeconds": expires_in_seconds, "nonce": str(nonce)},
    )
    entries = answer.get("urls") if isinstance(answer, dict) else None
    if not isinstance(entries, list):
        raise RunDownError("Failed to parse download URLs response: no list field 'urls'")
    urls = [
        DownloadUrl(_field(e, "path", "download URLs"), _field(e, "url", "download URLs"))
        for e in entries
    ]
    return DownloadUrls(urls, _field(answer, "expiresAt", "download URLs"))


async def get_upload_url(
    http: httpx.AsyncClient,
    base_url: str,
    run_id: str,
    signature: str,
    filename: str,
    expires_in_seconds: int,
    nonce: int,
) -> UploadUrl:
    """A signed URL to PUT the file `filename` (relative to the uploaded directory) to."""
    answer = await _signed_post(
        http,
        f"{base_url.rstrip('/')}/upload/{run_id}",
        signature,
        {"filename": filename, "expiresInSeconds": expires_in_seconds, "nonce": str(nonce)},
    )
    return UploadUrl(_field(answer, "url", "upload URL"), _field(answer, "expiresAt", "upload URL"))


def output_path(output_dir: Path, relative: str) -> Path:
    """Where the service's file `relative` goes: under `output_dir`, keeping its directories;
    a path that is absolute or climbs out with `..` is refused (upstream joins it blindly)."""
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts or "\\" in relative:
        raise RunDownError(f"refusing to write {relative!r} outside the output directory")
    return output_dir.joinpath(*parts)


async def download_to(http: httpx.AsyncClient, url: str, path: Path) -> int:
    """GET `url` into `path` (its directories created); returns the bytes written. The file
    appears only once complete."""
    await trio.Path(path.parent).mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    written = 0
    try:
        async with http.stream("GET", url) as response:
            if not response.is_success:
                raise RunDownError(
                    f"Failed to download file from {url}: status {response.status_code}"
                )
            async with await trio.open_file(partial, "wb") as out:
                async for chunk in response.aiter_bytes(CHUNK_BYTES):
                    await out.write(chunk)
                    written += len(chunk)
        os.replace(partial, path)
    except httpx.HTTPError as e:
        raise RunDownError(f"Failed to download file from {url}: {e}") from None
    finally:
        if partial.exists():
            partial.unlink()
    return written


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    async with await trio.open_file(path, "rb") as source:
        while chunk := await source.read(CHUNK_BYTES):
            yield chunk


async def upload_from(http: httpx.AsyncClient, url: str, path: Path, size: int) -> None:
    """PUT the file to `url`, streamed (never whole in memory), with its length declared."""
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
    try:
        response = await http.put(url, content=_file_chunks(path), headers=headers)
    except httpx.HTTPError as e:
        raise RunDownError(f"Failed to upload file to signed URL: {e}") from None
    if not response.is_success:
        raise RunDownError(
            f"Upload failed with status {response.status_code}: {response.text[:2000]}"
        )


def files_to_upload(path: Path) -> tuple[Path, list[Path]]:
    """The directory names are relative to, and the files: `path` itself, or every file
    under the directory `path` (recursively, in a stable order)."""
    if path.is_file():
        return path.parent, [path]
    if path.is_dir():
        # Regular files only, as upstream's walk (which does not follow symbolic links).
        return path, sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    raise RunDownError(f"Path does not exist or is not a file or directory: {str(path)!r}")
