"""A Hugging Face hub stand-in on loopback: just what `huggingface_hub` calls to upload a folder in
one commit (auth check, preupload, tree listing, the commit API with regular base64 files) and to
download it again (`snapshot_download`: revision info, tree, resolve with HEAD and GET).

Repos are kept in memory as a list of commits; a commit replaces the tree at once, so a reader
sees either the old tree or the new one. Tests can make the next commits fail (`fail_commits`)
or hold them until released (`hold_commits`), to check what the uploader does meanwhile, or make
the whole hub answer every request with one HTTP error (`fail_status`, a hub that is down). LFS and
Xet are off: preupload answers `regular` for every file (set `HF_HUB_DISABLE_XET=1`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

MAX_BODY = 512 * 1024 * 1024


@dataclass
class Commit:
    oid: str
    message: str
    files: dict[str, bytes]


@dataclass
class Repo:
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> Commit | None:
        return self.commits[-1] if self.commits else None

    def at(self, revision: str) -> Commit | None:
        if revision == "main":
            return self.head
        return next((c for c in self.commits if c.oid == revision), None)


class HubEndpoint:
    """Start with `serving()`; `url` is the `HF_ENDPOINT`."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.lock = threading.Lock()
        self.fail_commits = 0
        # every request answered with this HTTP status while set (None: the hub works)
        self.fail_status: int | None = None
        # a slow link: a commit's answer waits len(body) / bytes_per_sec seconds
        self.bytes_per_sec: float | None = None
        self.hold_commits: threading.Event | None = None
        self.commit_started = threading.Event()
        self.requests: list[str] = []
        self.url = ""

    def create_repo(self, repo_id: str, files: dict[str, bytes] | None = None) -> None:
        with self.lock:
            repo = self.repos.setdefault(repo_id, Repo())
            files = dict(files or {})
            files.setdefault(
                ".gitattributes", b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
            )
            repo.commits.append(Commit(_oid(len(repo.commits), files), "initial commit", files))

    def head_files(self, repo_id: str) -> dict[str, bytes]:
        with self.lock:
            head = self.repos[repo_id].head
            return dict(head.files) if head is not None else {}

    def commit_messages(self, repo_id: str) -> list[str]:
        with self.lock:
            return [c.message for c in self.repos[repo_id].commits]

    @contextmanager
    def serving(self) -> Iterator[HubEndpoint]:
        endpoint = self

        class Handler(_Handler):
            hub = endpoint

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            if self.hold_commits is not None:
                self.hold_commits.set()
            server.shutdown()
            server.server_close()
            thread.join(10)


def _oid(index: int, files: dict[str, bytes]) -> str:
    h = hashlib.sha1(str(index).encode())
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: HubEndpoint
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # -- helpers

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(
            status,
            json.dumps(obj).encode(),
            {"Content-Type": "application/json", **(headers or {})},
        )

    def _error(self, status: int, code: str, message: str) -> None:
        self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise ValueError("body too large")
        return self.rfile.read(length)

    def _route(self) -> tuple[str, list[str], dict[str, list[str]]]:
        parts = urlsplit(self.path)
        self.hub.requests.append(f"{self.command} {parts.path}")
        return (
            parts.path,
            [unquote(p) for p in parts.path.strip("/").split("/")],
            parse_qs(parts.query),
        )

    def _down(self) -> bool:
        """Answers with the hub's `fail_status` when it is set (and says whether it did)."""
        status = self.hub.fail_status
        if status is None:
            return False
        self._error(status, "Unavailable", f"the hub answers {status} (injected)")
        return True

    def _repo(self, repo_id: str) -> Repo | None:
        with self.hub.lock:
            return self.hub.repos.get(repo_id)

    # -- methods

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        _, parts, _ = self._route()
        if self._down():
            return None
        if parts[:2] == ["api", "models"] and len(parts) >= 5:
            repo_id = f"{parts[2]}/{parts[3]}"
            repo = self._repo(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            what = parts[4]
            if what == "auth-check":
                return self._json(200, {})
            revision = parts[5] if len(parts) > 5 else "main"
            commit = repo.at(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            if what == "revision":
                siblings = [{"rfilename": name} for name in sorted(commit.files)]
                return self._json(200, {"id": repo_id, "sha": commit.oid, "siblings": siblings})
            if what == "tree":
                prefix = "/".join(parts[6:])
                entries = [
                    {"type": "file", "oid": _blob_id(data), "size": len(data), "path": name}
                    for name, data in sorted(commit.files.items())
                    if name.startswith(prefix)
                ]
                return self._json(200, entries)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id = f"{parts[0]}/{parts[1]}"
            repo = self._repo(repo_id)
            commit = None if repo is None else repo.at(parts[3])
            name = "/".join(parts[4:])
            if commit is None or name not in commit.files:
                return self._error(404, "EntryNotFound", f"{name} not found")
            data = commit.files[name]
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            headers = {"X-Repo-Commit": commit.oid, "ETag": etag, "Accept-Ranges": "bytes"}
            start = _range_start(self.headers.get("Range"))
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                return self._send(206, data[start:], headers)
            return self._send(200, data, headers)
        return self._error(404, "NotFound", f"no route {self.path}")

    def do_POST(self) -> None:
        _, parts, _ = self._route()
        body = self._body()
        if self._down():
            return None
        if parts[:2] != ["api", "models"] or len(parts) < 6:
            return self._error(404, "NotFound", f"no route {self.path}")
        repo_id = f"{parts[2]}/{parts[3]}"
        repo = self._repo(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        if parts[4] == "preupload":
            files = json.loads(body)["files"]
            answer = [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                for f in files
            ]
            return self._json(200, {"files": answer})
        if parts[4] == "commit":
            return self._commit(repo_id, repo, body)
        return self._error(404, "NotFound", f"no route {self.path}")

    def _commit(self, repo_id: str, repo: Repo, body: bytes) -> None:
        hub = self.hub
        hub.commit_started.set()
        if hub.bytes_per_sec:
            time.sleep(len(body) / hub.bytes_per_sec)
        if hub.hold_commits is not None:
            hub.hold_commits.wait(60)
        with hub.lock:
            if hub.fail_commits > 0:
                hub.fail_commits -= 1
                fail = True
            else:
                fail = False
        if fail:
            return self._error(500, "InternalError", "commit failed (injected)")
        message = ""
        adds: dict[str, bytes] = {}
        deletes: list[tuple[str, bool]] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "header":
                message = value.get("summary", "")
            elif item["key"] == "file":
                adds[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] in ("deletedFile", "deletedFolder"):
                deletes.append((value["path"], item["key"] == "deletedFolder"))
            else:
                return self._error(400, "BadRequest", f"unsupported operation {item['key']}")
        with hub.lock:
            head = repo.head
            files = dict(head.files) if head is not None else {}
            for path, folder in deletes:
                for name in list(files):
                    if name == path or (folder and name.startswith(path.rstrip("/") + "/")):
                        del files[name]
            files.update(adds)
            commit = Commit(_oid(len(repo.commits), files), message, files)
            repo.commits.append(commit)
        return self._json(
            200,
            {
                "success": True,
                "commitOid": commit.oid,
                "commitUrl": f"{hub.url}/{repo_id}/commit/{commit.oid}",
            },
        )


def _range_start(header: str | None) -> int:
    if not header or not header.startswith("bytes="):
        return 0
    first = header[6:].split("-", 1)[0]
    return int(first) if first.isdigit() else 0


def point_huggingface_hub_at(monkeypatch: Any, url: str, home: Any) -> None:
    """Make `huggingface_hub` (already imported, so its constants too) use `url` as the hub,
    `home` as HF_HOME, and no Xet; child processes get the same through the environment."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def main() -> None:
    """`python tests/client/hub_endpoint.py REPO [BYTES_PER_SEC]`: serve an empty REPO in this
    process (benchmarks keep the hub's work out of the client's process); prints the URL, stops
    when stdin closes."""
    endpoint = HubEndpoint()
    endpoint.create_repo(sys.argv[1])
    if len(sys.argv) > 2:
        endpoint.bytes_per_sec = float(sys.argv[2])
    with endpoint.serving():
        print(endpoint.url, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
