"""Fixtures for the data provider tests: trio for async tests, token files, a Range-capable HTTP
server on loopback, a data server in a test's nursery (`serve_until`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest
import trio

from psyche.data_provider import DataProviderTcpServer
from psyche.data_provider.static_http import RangeRequestHandler, StaticFileServer, serve_directory


async def serve_until(nursery: trio.Nursery, provider: Any, stop: trio.CancelScope) -> int:
    """A data server for `provider` on loopback (any key may fetch), run in `nursery` until
    `stop` is cancelled; its port, once it listens."""

    async def host(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with stop:
            async with DataProviderTcpServer.start(
                provider, host="127.0.0.1", allow_any=True
            ) as server:
                task_status.started(server.local_addr[1])
                await trio.sleep_forever()

    port: int = await nursery.start(host)
    return port


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


@pytest.fixture
def write_tokens() -> Callable[..., Path]:
    """`write_tokens(path, tokens, nbytes=2)`: a raw little-endian token file."""

    def write(path: Path, tokens: np.ndarray | list[int], nbytes: int = 2) -> Path:
        dtype = "<u2" if nbytes == 2 else "<u4"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(np.asarray(tokens, dtype=np.int64).astype(dtype).tobytes())
        return path

    return write


class GcsHandler(RangeRequestHandler):
    """Files under the root, plus a fake GCS JSON listing API at /storage/v1/b/<bucket>/o that
    lists `<root>/<bucket>/**` two objects per page."""

    PAGE = 2

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        segments = parts.path.strip("/").split("/")
        if segments[:3] != ["storage", "v1", "b"] or len(segments) != 5 or segments[4] != "o":
            return super().do_GET()
        bucket = segments[3]
        query = parse_qs(parts.query)
        prefix = query.get("prefix", [""])[0]
        start = int(query.get("pageToken", ["0"])[0])
        self.server.count_request(self.path)
        base = self.server.root / bucket
        names = sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())
        names = [n for n in names if n.startswith(prefix)]
        page = names[start : start + self.PAGE]
        body = {
            "kind": "storage#objects",
            "items": [
                {
                    "name": n,
                    "size": str((base / n).stat().st_size),
                    "mediaLink": f"{self.server.url}/{bucket}/{n}",
                }
                for n in page
            ],
        }
        if start + self.PAGE < len(names):
            body["nextPageToken"] = str(start + self.PAGE)
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture
def http_root(tmp_path: Path) -> Path:
    root = tmp_path / "www"
    root.mkdir()
    return root


@pytest.fixture
def http_server(http_root: Path) -> Iterator[StaticFileServer]:
    with serve_directory(http_root, handler=GcsHandler) as server:
        yield server
