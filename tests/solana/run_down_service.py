"""A stand-in for Nous' run-down service on loopback, for `download-results` and `upload-data`.

It speaks the protocol upstream's run-manager speaks (see `psyche.solana.run_down`): a POST API
answering only requests whose `X-Solana-Signature` is the run authority's signature of
`nous-run-down-service:{run_id}:{expiresInSeconds}:{nonce}`, and "signed URLs" (one random
token per URL, one method each) that store PUT bodies and serve them back with GET, the way a
bucket's signed URLs do. Every request is recorded for the tests to check.
"""

from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from solders.pubkey import Pubkey
from solders.signature import Signature

MAX_BODY = 64 * 1024 * 1024


@dataclass
class ApiCall:
    kind: str  # "download" or "upload"
    run_id: str
    body: dict[str, Any]
    signature_valid: bool


@dataclass
class RunDownStandIn:
    authority: Pubkey
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)  # run id -> path -> bytes
    calls: list[ApiCall] = field(default_factory=list)
    # Extra entries the download API lists (e.g. a path that tries to escape).
    extra_download_entries: list[dict[str, str]] = field(default_factory=list)
    origin: str = field(init=False, default="")
    _tokens: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = field(init=False, default=None)
    _thread: threading.Thread | None = field(init=False, default=None)

    def signed_url(self, method: str, run_id: str, path: str) -> str:
        token = secrets.token_urlsafe(16)
        with self._lock:
            self._tokens[token] = (method, run_id, path)
        return f"{self.origin}/bucket/{token}"

    def start(self) -> RunDownStandIn:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    raise ValueError("body too large")
                return self.rfile.read(length)

            def _answer(self, status: int, payload: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_POST(self) -> None:
                parts = self.path.strip("/").split("/")
                if len(parts) != 3 or parts[0] != "v1" or parts[1] not in ("download", "upload"):
                    self._answer(404, b'{"error":"not found"}')
                    return
                kind, run_id = parts[1], parts[2]
                body = json.loads(self._body())
                message = (
                    f"nous-run-down-service:{run_id}:{body['expiresInSeconds']}:{body['nonce']}"
                )
                try:
                    signature = Signature.from_string(self.headers.get("X-Solana-Signature", ""))
                    valid = signature.verify(stand_in.authority, message.encode())
                except ValueError:
                    valid = False
                stand_in.calls.append(ApiCall(kind, run_id, body, valid))
                if not valid:
                    self._answer(401, b'{"error":"invalid signature"}')
                    return
                expires_at = "2030-01-01T00:00:00Z"
                if kind == "upload":
                    url = stand_in.signed_url("PUT", run_id, body["filename"])
                    answer: dict[str, Any] = {"url": url, "expiresAt": expires_at}
                else:
                    stored = sorted(stand_in.files.get(run_id, {}))
                    urls = [
                        {"path": p, "url": stand_in.signed_url("GET", run_id, p)} for p in stored
                    ]
                    answer = {"urls": urls + stand_in.extra_download_entries}
                    answer["expiresAt"] = expires_at
                self._answer(200, json.dumps(answer).encode())

            def _signed(self, method: str) -> tuple[str, str] | None:
                token = self.path.rsplit("/", 1)[-1]
                with stand_in._lock:
                    found = stand_in._tokens.get(token)
                if found is None or found[0] != method:
                    self._answer(403, b"<Error>SignatureDoesNotMatch</Error>", "application/xml")
                    return None
                return found[1], found[2]

            def do_PUT(self) -> None:
                target = self._signed("PUT")
                if target is None:
                    return
                if self.headers.get("Content-Type") != "application/octet-stream":
                    self._answer(400, b"wrong content type", "text/plain")
                    return
                data = self._body()
                with stand_in._lock:
                    stand_in.files.setdefault(target[0], {})[target[1]] = data
                self._answer(200, b"", "text/plain")

            def do_GET(self) -> None:
                target = self._signed("GET")
                if target is None:
                    return
                self._answer(200, stand_in.files[target[0]][target[1]], "application/octet-stream")

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self.origin = f"http://127.0.0.1:{server.server_address[1]}"
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    def stop(self) -> None:
        assert self._server is not None
        assert self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
