"""A small trio client for Solana's JSON-RPC API (the methods a Psyche client needs).

solana-py's `AsyncClient` sleeps with asyncio while confirming and its websocket client is
asyncio-only, so the trio backend speaks the protocol itself over httpx (which runs on trio);
responses are parsed with solders' response types, the same parser solana-py uses.

Failures are typed so the retry policy (`psyche.solana.retry`) can classify them:
`RpcTransportError` (could not talk to the node), `RpcResponseError` (a JSON-RPC error object,
e.g. a preflight failure with its simulation logs), `TransactionError` (a transaction that landed
and failed), `ConfirmationTimeout`, `AccountNotFound`.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

import httpx
import trio
from solders.hash import Hash
from solders.pubkey import Pubkey
from solders.signature import Signature

from psyche.solana.transaction_errors import describe_transaction_error

DEFAULT_TIMEOUT = 30.0


class RpcError(Exception):
    """Base of the client's errors."""


class RpcTransportError(RpcError):
    """The request did not get a JSON-RPC answer (connection refused, timeout, HTTP error)."""

    def __init__(self, url: str, message: str, *, kind: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.kind = kind  # "connect", "timeout", "status", "protocol"


class RpcResponseError(RpcError):
    """A JSON-RPC error object; `data` holds e.g. a preflight simulation (`err`, `logs`)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"RPC response error {code}: {message}")
        self.code = code
        self.message = message
        self.data = data

    @property
    def logs(self) -> list[str]:
        if isinstance(self.data, dict):
            return list(self.data.get("logs") or [])
        return []

    @property
    def simulation_err(self) -> Any:
        """The transaction error of a failed preflight simulation (None otherwise)."""
        if isinstance(self.data, dict):
            return self.data.get("err")
        return None


class TransactionError(RpcError):
    """A transaction that was processed and failed."""

    def __init__(self, signature: Signature, err: Any, logs: list[str] | None = None) -> None:
        super().__init__(f"transaction {signature} failed: {describe_transaction_error(err)}")
        self.signature = signature
        self.err = err
        self.logs = logs or []


class ConfirmationTimeout(RpcError):
    def __init__(self, signature: Signature, seconds: float) -> None:
        super().__init__(f"unable to confirm transaction {signature} within {seconds:.0f}s")
        self.signature = signature


class AccountNotFound(RpcError):
    def __init__(self, address: Pubkey) -> None:
        super().__init__(f"AccountNotFound: pubkey={address}")
        self.address = address


@dataclass(frozen=True)
class AccountInfo:
    lamports: int
    owner: Pubkey
    data: bytes
    executable: bool


_COMMITMENT_RANK = {"processed": 0, "confirmed": 1, "finalized": 2}


class SolanaRpcClient:
    """JSON-RPC over HTTP for one endpoint; use as an async context manager or `aclose()`."""

    def __init__(
        self,
        url: str,
        *,
        commitment: str = "confirmed",
        timeout: float = DEFAULT_TIMEOUT,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url.strip().strip('"')
        self.commitment = commitment
        self._http = http or httpx.AsyncClient(timeout=timeout)
        self._owns_http = http is None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> SolanaRpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    # ---- transport -----------------------------------------------------------------------

    async def call(self, method: str, params: list[Any] | None = None) -> Any:
        request = {
            "jsonrpc": "2.0",
            "id": next(self._ids),
            "method": method,
            "params": params or [],
        }
        try:
            response = await self._http.post(
                self.url, content=json.dumps(request), headers={"content-type": "application/json"}
            )
        except httpx.TimeoutException as e:
            raise RpcTransportError(
                self.url, f"timed out ({type(e).__name__})", kind="timeout"
            ) from e
        except httpx.ConnectError as e:
            raise RpcTransportError(self.url, f"cannot connect ({e})", kind="connect") from e
        except (httpx.TransportError, OSError) as e:
            raise RpcTransportError(self.url, f"transport error ({e!r})", kind="protocol") from e
        if response.status_code != 200:
            raise RpcTransportError(self.url, f"HTTP status {response.status_code}", kind="status")
        try:
            document = response.json()
        except ValueError as e:
            raise RpcTransportError(self.url, f"invalid JSON answer ({e})", kind="protocol") from e
        if not isinstance(document, dict):
            raise RpcTransportError(self.url, "unexpected JSON-RPC answer", kind="protocol")
        if "error" in document:
            error = document["error"] or {}
            raise RpcResponseError(
                int(error.get("code", 0)), str(error.get("message", "")), error.get("data")
            )
        return document.get("result")

    # ---- reads ---------------------------------------------------------------------------

    async def get_account_info(self, address: Pubkey) -> AccountInfo | None:
        from solders.rpc.responses import GetAccountInfoResp

        result = await self.call(
            "getAccountInfo",
            [str(address), {"encoding": "base64+zstd", "commitment": self.commitment}],
        )
        parsed = GetAccountInfoResp.from_json(
            json.dumps({"jsonrpc": "2.0", "id": 0, "result": result})
        )
        # A document without "error" parses as the response or raises, never as an RPC error.
        assert isinstance(parsed, GetAccountInfoResp)
        account = parsed.value
        if account is None:
            return None
        return AccountInfo(account.lamports, account.owner, bytes(account.data), account.executable)

    async def get_program_accounts(
        self, program: Pubkey, *, memcmp: tuple[int, bytes] | None = None
    ) -> list[tuple[Pubkey, AccountInfo]]:
        """Every account `program` owns (`getProgramAccounts`), optionally only those whose
        data holds `memcmp[1]` at offset `memcmp[0]` (e.g. an Anchor discriminator)."""
        config: dict[str, Any] = {"encoding": "base64", "commitment": self.commitment}
        if memcmp is not None:
            offset, expected = memcmp
            config["filters"] = [
                {
                    "memcmp": {
                        "offset": offset,
                        "bytes": base64.b64encode(expected).decode(),
                        "encoding": "base64",
                    }
                }
            ]
        result = await self.call("getProgramAccounts", [str(program), config])
        found = []
        for entry in result:
            account = entry["account"]
            data, encoding = account["data"]
            if encoding != "base64":
                raise RpcError(f"getProgramAccounts answered {encoding!r} data, asked base64")
            found.append(
                (
                    Pubkey.from_string(entry["pubkey"]),
                    AccountInfo(
                        int(account["lamports"]),
                        Pubkey.from_string(account["owner"]),
                        base64.b64decode(data),
                        bool(account["executable"]),
                    ),
                )
            )
        return found

    async def get_account_data(self, address: Pubkey) -> bytes:
        account = await self.get_account_info(address)
        if account is None:
            raise AccountNotFound(address)
        return account.data

    async def get_balance(self, address: Pubkey) -> int:
        result = await self.call("getBalance", [str(address), {"commitment": self.commitment}])
        return int(result["value"])

    async def get_minimum_balance_for_rent_exemption(self, space: int) -> int:
        return int(await self.call("getMinimumBalanceForRentExemption", [space]))

    async def get_latest_blockhash(self) -> tuple[Hash, int]:
        result = await self.call("getLatestBlockhash", [{"commitment": self.commitment}])
        value = result["value"]
        return Hash.from_string(value["blockhash"]), int(value["lastValidBlockHeight"])

    async def get_slot(self) -> int:
        return int(await self.call("getSlot", [{"commitment": self.commitment}]))

    async def get_signature_status(self, signature: Signature) -> dict[str, Any] | None:
        result = await self.call(
            "getSignatureStatuses", [[str(signature)], {"searchTransactionHistory": True}]
        )
        status: dict[str, Any] | None = result["value"][0]
        return status

    async def get_transaction_logs(self, signature: Signature) -> list[str]:
        result = await self.call(
            "getTransaction",
            [
                str(signature),
                {
                    "encoding": "json",
                    "commitment": "confirmed",
                    "maxSupportedTransactionVersion": 0,
                },
            ],
        )
        if result is None:
            raise RpcError(f"transaction {signature} not found")
        meta = result.get("meta")
        if meta is None:
            raise RpcError("Transaction has no meta information")
        return list(meta.get("logMessages") or [])

    async def request_airdrop(self, address: Pubkey, lamports: int) -> Signature:
        return Signature.from_string(await self.call("requestAirdrop", [str(address), lamports]))

    # ---- writes --------------------------------------------------------------------------

    async def send_transaction(self, raw: bytes, *, skip_preflight: bool = False) -> Signature:
        result = await self.call(
            "sendTransaction",
            [
                base64.b64encode(raw).decode(),
                {
                    "encoding": "base64",
                    "skipPreflight": skip_preflight,
                    "preflightCommitment": self.commitment,
                },
            ],
        )
        return Signature.from_string(result)

    async def confirm_transaction(
        self, signature: Signature, *, timeout: float = 30.0, poll_interval: float = 0.2
    ) -> None:
        """Wait until the transaction reaches this client's commitment; raise TransactionError
        if it failed, ConfirmationTimeout if it never shows up."""
        wanted = _COMMITMENT_RANK.get(self.commitment, 1)
        with trio.move_on_after(timeout):
            while True:
                status = await self.get_signature_status(signature)
                if status is not None:
                    if status.get("err") is not None:
                        logs: list[str] = []
                        with contextlib.suppress(RpcError):
                            logs = await self.get_transaction_logs(signature)
                        raise TransactionError(signature, status["err"], logs)
                    level = _COMMITMENT_RANK.get(status.get("confirmationStatus") or "", 0)
                    if level >= wanted:
                        return
                await trio.sleep(poll_interval)
        raise ConfirmationTimeout(signature, timeout)
