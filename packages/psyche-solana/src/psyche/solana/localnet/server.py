"""Loopback JSON-RPC (HTTP/1.1) and websocket servers over a `Ledger`.

`LocalnetServer.serve` runs both until cancelled and can be served again on the same ports (tests
use that to make the endpoint go away and come back). `LocalnetThread` runs a server in a
background thread for synchronous callers (the CLI tests, the standalone command).

Websocket subscriptions: `accountSubscribe` (base64 or base64+zstd), `signatureSubscribe` and
`slotSubscribe`, with their unsubscribe methods. Notifications are queued per connection; a
connection that stops reading is closed rather than allowed to grow memory without bound.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import trio
from solders.pubkey import Pubkey
from solders.signature import Signature
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from psyche.solana.localnet.ledger import Ledger, TransactionRecord
from psyche.solana.localnet.rpc_methods import (
    INVALID_REQUEST,
    PARSE_ERROR,
    RpcMethods,
    ui_account,
)

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20
MAX_QUEUED_NOTIFICATIONS = 4096
IDLE_CONNECTION_TIMEOUT = 300.0


def _rpc_error(request_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "error": {"code": code, "message": message}, "id": request_id}


def handle_json_rpc(methods: RpcMethods, body: bytes) -> Any:
    """A JSON-RPC request body (single or batch) in, the response document out."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return _rpc_error(None, PARSE_ERROR, "Parse error")
    if isinstance(document, list):
        if not document:
            return _rpc_error(None, INVALID_REQUEST, "Invalid request")
        return [r for r in (methods.handle_request(item) for item in document) if r is not None]
    return methods.handle_request(document)


# ---------------------------------------------------------------------------------------------
# Websocket subscriptions


@dataclass
class _Subscription:
    id: int
    kind: str  # "account", "signature" or "slot"
    key: Any = None
    encoding: str = "base64"


@dataclass(eq=False)
class _WsClient:
    send: trio.MemorySendChannel[str]
    subscriptions: dict[int, _Subscription] = field(default_factory=dict)


class _SubscriptionHub:
    """Routes ledger events to the websocket connections that asked for them."""

    def __init__(self, ledger: Ledger, methods: RpcMethods) -> None:
        self.ledger = ledger
        self.methods = methods
        self.clients: set[_WsClient] = set()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None

    def attach(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self.ledger.add_listener(self._on_ledger_event)

    def detach(self) -> None:
        self.ledger.remove_listener(self._on_ledger_event)

    def next_id(self) -> int:
        return next(self._ids)

    def _on_ledger_event(
        self, slot: int, keys: list[Pubkey], record: TransactionRecord | None
    ) -> None:
        # Called under the ledger's lock, maybe from another thread: capture what changed now,
        # deliver on the server's trio thread.
        messages: list[tuple[_WsClient, str]] = []
        changed = set(keys)
        with self._lock:
            subscriptions = [(c, list(c.subscriptions.values())) for c in self.clients]
        for client, subs in subscriptions:
            for sub in subs:
                if sub.kind == "account" and sub.key in changed:
                    account = self.ledger.get_account(sub.key)
                    value = (
                        ui_account(account, sub.encoding)
                        if account is not None
                        else _closed_account(sub.encoding)
                    )
                    messages.append(
                        (
                            client,
                            _notification(
                                "accountNotification",
                                sub.id,
                                {"context": {"slot": slot}, "value": value},
                            ),
                        )
                    )
                elif sub.kind == "signature" and record is not None and sub.key == record.signature:
                    messages.append(
                        (
                            client,
                            _notification(
                                "signatureNotification",
                                sub.id,
                                {"context": {"slot": record.slot}, "value": {"err": record.err}},
                            ),
                        )
                    )
                    with self._lock:
                        client.subscriptions.pop(sub.id, None)
                elif sub.kind == "slot":
                    messages.append(
                        (
                            client,
                            _notification(
                                "slotNotification",
                                sub.id,
                                {
                                    "parent": max(0, slot - 1),
                                    "root": max(0, slot - 1),
                                    "slot": slot,
                                },
                            ),
                        )
                    )
        if messages and self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._deliver, messages)

    @staticmethod
    def _deliver(messages: list[tuple[_WsClient, str]]) -> None:
        for client, text in messages:
            try:
                client.send.send_nowait(text)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                client.send.close()  # a client that does not read is dropped

    def subscribe(self, client: _WsClient, method: str, params: list[Any]) -> Any:
        if method == "accountSubscribe":
            key = Pubkey.from_string(params[0])
            config = params[1] if len(params) > 1 and isinstance(params[1], dict) else {}
            encoding = config.get("encoding", "base64")
            if encoding not in ("base64", "base64+zstd", "jsonParsed", "base58"):
                raise ValueError(f"unsupported encoding {encoding!r}")
            sub = _Subscription(self.next_id(), "account", key, _account_encoding(encoding))
        elif method == "signatureSubscribe":
            signature = Signature.from_string(params[0])
            sub = _Subscription(self.next_id(), "signature", signature)
            record = self.ledger.get_transaction(signature)
            if record is not None:
                client.send.send_nowait(
                    _notification(
                        "signatureNotification",
                        sub.id,
                        {"context": {"slot": record.slot}, "value": {"err": record.err}},
                    )
                )
                return sub.id
        elif method == "slotSubscribe":
            sub = _Subscription(self.next_id(), "slot")
        else:
            raise KeyError(method)
        with self._lock:
            client.subscriptions[sub.id] = sub
        return sub.id

    def unsubscribe(self, client: _WsClient, params: list[Any]) -> bool:
        with self._lock:
            return client.subscriptions.pop(int(params[0]), None) is not None


def _account_encoding(encoding: str) -> str:
    return "base64+zstd" if encoding == "base64+zstd" else "base64"


def _closed_account(encoding: str) -> dict[str, Any]:
    from psyche.solana.localnet.ledger import encode_account_data

    return {
        "data": encode_account_data(b"", encoding),
        "executable": False,
        "lamports": 0,
        "owner": str(Pubkey.default()),
        "rentEpoch": 0,
        "space": 0,
    }


def _notification(method: str, subscription: int, result: Any) -> str:
    return json.dumps(
        {
            "jsonrpc": "2.0",
            "method": method,
            "params": {"result": result, "subscription": subscription},
        }
    )


_SUBSCRIBE = {"accountSubscribe", "signatureSubscribe", "slotSubscribe"}
_UNSUBSCRIBE = {"accountUnsubscribe", "signatureUnsubscribe", "slotUnsubscribe"}


# ---------------------------------------------------------------------------------------------
# The server


class LocalnetServer:
    """HTTP JSON-RPC on `rpc_port` and websocket subscriptions on `ws_port` (0 = any free)."""

    def __init__(
        self, ledger: Ledger, host: str = "127.0.0.1", rpc_port: int = 0, ws_port: int = 0
    ) -> None:
        self.ledger = ledger
        self.host = host
        self.rpc_port = rpc_port
        self.ws_port = ws_port
        self.methods = RpcMethods(ledger)
        self._hub = _SubscriptionHub(ledger, self.methods)

    @property
    def rpc_url(self) -> str:
        return f"http://{self.host}:{self.rpc_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.ws_port}"

    @property
    def websocket_clients(self) -> int:
        """How many websocket connections are open now."""
        with self._hub._lock:
            return len(self._hub.clients)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. The ports chosen on the first run are kept for later runs."""
        self._hub.attach()
        try:
            async with trio.open_nursery() as nursery:
                listeners = await trio.open_tcp_listeners(self.rpc_port, host=self.host)
                self.rpc_port = listeners[0].socket.getsockname()[1]
                ws_server = await nursery.start(
                    lambda task_status: serve_websocket(
                        self._ws_handler,
                        self.host,
                        self.ws_port,
                        ssl_context=None,
                        handler_nursery=nursery,
                        task_status=task_status,
                    )
                )
                self.ws_port = ws_server.port
                nursery.start_soon(trio.serve_listeners, self._http_handler, listeners)
                task_status.started(self)
        finally:
            self._hub.detach()
            with self._hub._lock:
                for client in self._hub.clients:
                    client.send.close()
                self._hub.clients.clear()

    # ---- HTTP ------------------------------------------------------------------------------

    async def _http_handler(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        try:
            while True:
                request, body = await self._read_request(stream, conn)
                if request is None:
                    return
                status, payload, content_type = self._respond(request, body)
                headers = [
                    ("content-type", content_type),
                    ("content-length", str(len(payload))),
                ]
                await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
                await stream.send_all(conn.send(h11.Data(data=payload)))
                await stream.send_all(conn.send(h11.EndOfMessage()))
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        except (h11.RemoteProtocolError, _TooLarge) as e:
            status = 413 if isinstance(e, _TooLarge) else 400
            try:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    payload = str(e).encode()
                    await stream.send_all(
                        conn.send(
                            h11.Response(
                                status_code=status,
                                headers=[
                                    ("content-length", str(len(payload))),
                                    ("connection", "close"),
                                ],
                            )
                        )
                    )
                    await stream.send_all(conn.send(h11.Data(data=payload)))
                    await stream.send_all(conn.send(h11.EndOfMessage()))
            except Exception:
                pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _read_request(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                with trio.move_on_after(IDLE_CONNECTION_TIMEOUT) as scope:
                    data = await stream.receive_some(65536)
                if scope.cancelled_caught:
                    return None, b""
                conn.receive_data(data)
                if not data and conn.their_state is h11.IDLE:
                    return None, b""
                continue
            if isinstance(event, h11.Request):
                request = event
                # Refused before a byte of the body is read (chunked bodies are counted below).
                for name, value in event.headers:
                    if name == b"content-length" and int(value) > MAX_REQUEST_BYTES:
                        raise _TooLarge(f"request body over {MAX_REQUEST_BYTES} bytes")
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_REQUEST_BYTES:
                    raise _TooLarge(f"request body over {MAX_REQUEST_BYTES} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    def _respond(self, request: h11.Request, body: bytes) -> tuple[int, bytes, str]:
        method = request.method.decode()
        target = request.target.decode().split("?", 1)[0]
        if method == "GET" and target == "/health":
            return 200, b"ok", "text/plain"
        if method != "POST":
            return (
                405,
                b"Used HTTP Method is not allowed. POST or OPTIONS is required",
                "text/plain",
            )
        response = handle_json_rpc(self.methods, body)
        return 200, json.dumps(response).encode(), "application/json"

    # ---- websocket -------------------------------------------------------------------------

    async def _ws_handler(self, request: WebSocketRequest) -> None:
        try:
            await self._ws_session(request)
        except Exception:  # trio-websocket would drop it silently
            log.exception("websocket connection failed")

    async def _ws_session(self, request: WebSocketRequest) -> None:
        ws = await request.accept()
        send, receive = trio.open_memory_channel[str](MAX_QUEUED_NOTIFICATIONS)
        client = _WsClient(send)
        with self._hub._lock:
            self._hub.clients.add(client)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._ws_writer, ws, receive, nursery.cancel_scope)
                await self._ws_reader(ws, client)
                nursery.cancel_scope.cancel()
        finally:
            with self._hub._lock:
                self._hub.clients.discard(client)
            await ws.aclose()

    async def _ws_writer(
        self,
        ws: WebSocketConnection,
        receive: trio.MemoryReceiveChannel[str],
        scope: trio.CancelScope,
    ) -> None:
        try:
            async for text in receive:
                await ws.send_message(text)
        except ConnectionClosed:
            pass
        scope.cancel()

    async def _ws_reader(self, ws: WebSocketConnection, client: _WsClient) -> None:
        while True:
            try:
                text = await ws.get_message()
            except ConnectionClosed:
                return
            response = self._ws_request(client, text)
            try:
                client.send.send_nowait(json.dumps(response))
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                return

    def _ws_request(self, client: _WsClient, text: str | bytes) -> Any:
        try:
            request = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            return _rpc_error(None, PARSE_ERROR, "Parse error")
        if not isinstance(request, dict):
            return _rpc_error(None, INVALID_REQUEST, "Invalid request")
        request_id = request.get("id")
        method = request.get("method")
        params = request.get("params", [])
        if not isinstance(params, list):
            return _rpc_error(request_id, INVALID_REQUEST, "Invalid request")
        try:
            if method in _SUBSCRIBE:
                result: Any = self._hub.subscribe(client, method, params)
            elif method in _UNSUBSCRIBE:
                result = self._hub.unsubscribe(client, params)
            else:
                return self.methods.handle_request(request)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            return _rpc_error(request_id, -32602, f"Invalid params: {e}")
        return {"jsonrpc": "2.0", "result": result, "id": request_id}


class _TooLarge(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Running a server


class _Served:
    """The addresses of the server a handle runs."""

    server: LocalnetServer

    @property
    def rpc_url(self) -> str:
        return self.server.rpc_url

    @property
    def ws_url(self) -> str:
        return self.server.ws_url


RESTART_BIND_SECONDS = 10.0
"""How long `LocalnetHandle.start` tries a port that is in use before it gives up."""


def _address_in_use(error: BaseException) -> bool:
    """Whether `error` (or every exception of a group) is EADDRINUSE."""
    if isinstance(error, BaseExceptionGroup):
        return all(_address_in_use(e) for e in error.exceptions)
    return isinstance(error, OSError) and error.errno == errno.EADDRINUSE


class LocalnetHandle(_Served):
    """A server running in a nursery, which can be stopped and started again (same ports)."""

    def __init__(self, server: LocalnetServer, nursery: trio.Nursery) -> None:
        self.server = server
        self._nursery = nursery
        self._scope: trio.CancelScope | None = None
        self._stopped: trio.Event | None = None

    async def start(self) -> None:
        """Serve (again, on the same ports after `stop`). A port that another socket holds
        for a moment (an outgoing connection of another process that was given it as its
        local port while the server was stopped) is tried again for up to
        `RESTART_BIND_SECONDS`; then the `OSError` is raised."""
        deadline = trio.current_time() + RESTART_BIND_SECONDS
        while True:
            try:
                await self._start_once()
                return
            except BaseException as e:
                self._scope = None
                if not _address_in_use(e) or trio.current_time() >= deadline:
                    raise
            await trio.sleep(0.1)

    async def _start_once(self) -> None:
        if self._scope is not None:
            return
        self._scope = trio.CancelScope()
        self._stopped = trio.Event()
        scope, stopped = self._scope, self._stopped

        async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with scope:
                    await self.server.serve(task_status=task_status)
            finally:
                stopped.set()

        await self._nursery.start(run)

    async def stop(self) -> None:
        """Close the listening sockets and every open connection."""
        if self._scope is None or self._stopped is None:
            return
        self._scope.cancel()
        await self._stopped.wait()
        self._scope = None


async def start_localnet(
    nursery: trio.Nursery,
    ledger: Ledger,
    host: str = "127.0.0.1",
    rpc_port: int = 0,
    ws_port: int = 0,
) -> LocalnetHandle:
    handle = LocalnetHandle(LocalnetServer(ledger, host, rpc_port, ws_port), nursery)
    await handle.start()
    return handle


class LocalnetThread(_Served):
    """A localnet served from a background thread (context manager)."""

    def __init__(
        self,
        ledger: Ledger,
        host: str = "127.0.0.1",
        rpc_port: int = 0,
        ws_port: int = 0,
    ) -> None:
        self.server = LocalnetServer(ledger, host, rpc_port, ws_port)
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def ledger(self) -> Ledger:
        return self.server.ledger

    def __enter__(self) -> LocalnetThread:
        self._thread = threading.Thread(target=self._run, name="psyche-localnet", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"localnet failed to start: {self._error}") from self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._token is not None and self._scope is not None:
            scope = self._scope
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(scope.cancel)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._scope = scope
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.server.serve)
                    self._ready.set()

        try:
            trio.run(main)
        except BaseException as e:  # report start-up failures to the caller
            self._error = e
        finally:
            self._ready.set()


def run_forever(server: LocalnetServer, on_ready: Callable[[LocalnetServer], None]) -> None:
    """Serve in the current thread until interrupted (Ctrl-C)."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            on_ready(server)

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main)
