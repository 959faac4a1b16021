"""Websocket account subscriptions that survive their endpoint going away.

`subscribe_to_account` keeps one `accountSubscribe` (base64+zstd) open on one websocket URL and
forwards every notification's account data. When the connection fails or closes it reconnects,
sleeping `reconnect_delay(retries)` first (upstream: `min(30, 2 * retries)` seconds, `retries`
reset once a subscription succeeds). Several of these, one per RPC endpoint, feed one channel;
`NonceFilter` then keeps only account states newer than any seen before, which removes the
duplicates and drops stale states from a lagging endpoint.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from solders.pubkey import Pubkey
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

from psyche.solana.state import CoordinatorAccountError, coordinator_account_nonce

log = logging.getLogger(__name__)

MAX_RECONNECT_DELAY = 30.0


def upstream_reconnect_delay(retries: int) -> float:
    return float(min(MAX_RECONNECT_DELAY, 2 * retries))


class SubscriptionError(Exception):
    pass


async def subscribe_to_account(
    url: str,
    account: Pubkey,
    send: trio.MemorySendChannel[bytes],
    *,
    commitment: str = "confirmed",
    reconnect_delay: Callable[[int], float] = upstream_reconnect_delay,
    on_status: Callable[[str, bool], Awaitable[None] | None] | None = None,
    subscription_number: int = 1,
) -> None:
    """Forward the data of every notification for `account` from `url` to `send`, forever."""
    ids = itertools.count(1)
    retries = 0
    while True:
        await trio.sleep(reconnect_delay(retries))
        retries += 1
        try:
            async with open_websocket_url(url, connect_timeout=10, disconnect_timeout=2) as ws:
                request_id = next(ids)
                await ws.send_message(
                    json.dumps(
                        {
                            "jsonrpc": "2.0",
                            "id": request_id,
                            "method": "accountSubscribe",
                            "params": [
                                str(account),
                                {"encoding": "base64+zstd", "commitment": commitment},
                            ],
                        }
                    )
                )
                await _await_subscription(ws, request_id)
                log.info(
                    "solana subscription %d up: %s (account %s)", subscription_number, url, account
                )
                retries = 0
                await _notify(on_status, url, True)
                while True:
                    data = _account_data(await ws.get_message())
                    if data is not None:
                        await send.send(data)
        except (
            OSError,
            ConnectionClosed,
            HandshakeError,
            SubscriptionError,
            trio.TooSlowError,
        ) as e:
            log.warning(
                "solana subscription %d down: %s (%s: %s)",
                subscription_number,
                url,
                type(e).__name__,
                e,
            )
            await _notify(on_status, url, False)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # nobody listens any more


async def _notify(
    on_status: Callable[[str, bool], Awaitable[None] | None] | None, url: str, up: bool
) -> None:
    if on_status is None:
        return
    result = on_status(url, up)
    if result is not None:
        await result


async def _await_subscription(ws: Any, request_id: int) -> int:
    with trio.fail_after(10):
        while True:
            message = json.loads(await ws.get_message())
            if message.get("id") != request_id:
                continue
            if "error" in message:
                raise SubscriptionError(f"accountSubscribe failed: {message['error']}")
            return int(message["result"])


def _account_data(text: str | bytes) -> bytes | None:
    """The account data of an `accountNotification` (None for anything else)."""
    from solders.rpc.responses import AccountNotification, parse_websocket_message

    try:
        messages = parse_websocket_message(text if isinstance(text, str) else text.decode())
    except Exception:
        log.warning("ignoring an unparseable websocket message")
        return None
    for message in messages:
        if isinstance(message, AccountNotification):
            return bytes(message.result.value.data)
    return None


class NonceFilter:
    """Passes coordinator account data only when its nonce is higher than any seen so far."""

    def __init__(self, last_nonce: int = 0) -> None:
        self.last_nonce = last_nonce

    def accept(self, data: bytes) -> bool:
        try:
            nonce = coordinator_account_nonce(data)
        except CoordinatorAccountError as e:
            log.error("error deserializing coordinator account: %s", e)
            return False
        if nonce <= self.last_nonce:
            return False
        self.last_nonce = nonce
        return True
