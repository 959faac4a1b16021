"""The JSON-RPC methods of the local endpoint: the subset of Solana's HTTP API Psyche's clients
(and solana-py / anchorpy) use, answering in the same JSON shapes as a validator.

`handle_request` takes one decoded JSON-RPC request object and returns the response object; it
never raises. Every processed transaction is final at once, so all commitment levels agree.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

import based58
from solders.message import Message, MessageV0
from solders.pubkey import Pubkey
from solders.signature import Signature

from psyche.solana.localnet.ledger import (
    MAX_TRANSACTION_SIZE,
    Ledger,
    TransactionFailed,
    TransactionRecord,
    encode_account_data,
    message_fee,
)
from psyche.solana.transaction_errors import describe_transaction_error

API_VERSION = "2.1.21"
SLOTS_PER_EPOCH = 432_000

# JSON-RPC error codes used by Solana validators.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SEND_TRANSACTION_PREFLIGHT_FAILURE = -32002
TRANSACTION_SIGNATURE_VERIFICATION_FAILURE = -32003


class RpcMethodError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


def _params_error(message: str) -> RpcMethodError:
    return RpcMethodError(INVALID_PARAMS, message)


def _pubkey(value: Any) -> Pubkey:
    try:
        return Pubkey.from_string(value)
    except Exception:
        raise _params_error(f"Invalid param: Invalid public key input {value!r}") from None


def _signature(value: Any) -> Signature:
    try:
        return Signature.from_string(value)
    except Exception:
        raise _params_error(f"Invalid param: Invalid signature {value!r}") from None


def _config(params: list[Any], index: int) -> dict[str, Any]:
    if len(params) > index and isinstance(params[index], dict):
        config: dict[str, Any] = params[index]
        return config
    return {}


def _arg(params: list[Any], index: int, name: str) -> Any:
    if len(params) <= index:
        raise _params_error(f"Invalid params: missing {name}")
    return params[index]


class RpcMethods:
    """Method handlers over one ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._methods: dict[str, Callable[[list[Any]], Any]] = {
            "getHealth": lambda p: "ok",
            "getVersion": lambda p: {"solana-core": API_VERSION, "feature-set": 0},
            "getGenesisHash": lambda p: str(self.ledger.genesis_hash),
            "getIdentity": lambda p: {"identity": str(Pubkey.default())},
            "getSlot": lambda p: self.ledger.slot,
            "getBlockHeight": lambda p: self.ledger.block_height,
            "getTransactionCount": lambda p: self.ledger.transaction_count,
            "getEpochInfo": self._get_epoch_info,
            "getLatestBlockhash": self._get_latest_blockhash,
            "isBlockhashValid": self._is_blockhash_valid,
            "getFeeForMessage": self._get_fee_for_message,
            "getMinimumBalanceForRentExemption": self._get_minimum_balance,
            "getBalance": self._get_balance,
            "getAccountInfo": self._get_account_info,
            "getMultipleAccounts": self._get_multiple_accounts,
            "getProgramAccounts": self._get_program_accounts,
            "requestAirdrop": self._request_airdrop,
            "sendTransaction": self._send_transaction,
            "simulateTransaction": self._simulate_transaction,
            "getSignatureStatuses": self._get_signature_statuses,
            "getTransaction": self._get_transaction,
        }

    def handle_request(self, request: Any) -> dict[str, Any] | None:
        """The response to one JSON-RPC request object (None for a notification)."""
        if not isinstance(request, dict) or request.get("jsonrpc") != "2.0":
            return _error_response(None, INVALID_REQUEST, "Invalid request")
        request_id = request.get("id")
        method = request.get("method")
        params = request.get("params", [])
        if not isinstance(method, str) or not isinstance(params, list):
            return _error_response(request_id, INVALID_REQUEST, "Invalid request")
        handler = self._methods.get(method)
        if handler is None:
            return _error_response(request_id, METHOD_NOT_FOUND, "Method not found")
        try:
            result = handler(params)
        except RpcMethodError as e:
            return _error_response(request_id, e.code, e.message, e.data)
        except Exception as e:  # a bug here must not take the endpoint down
            return _error_response(request_id, INTERNAL_ERROR, f"Internal error: {e}")
        return {"jsonrpc": "2.0", "result": result, "id": request_id}

    # ---- helpers -----------------------------------------------------------------------------

    def context(self) -> dict[str, Any]:
        return {"slot": self.ledger.slot, "apiVersion": API_VERSION}

    def ui_account(self, key: Pubkey, encoding: str, data_slice: Any = None) -> Any:
        account = self.ledger.get_account(key)
        if account is None:
            return None
        return ui_account(account, encoding, data_slice)

    # ---- methods -----------------------------------------------------------------------------

    def _get_epoch_info(self, params: list[Any]) -> Any:
        slot = self.ledger.slot
        return {
            "absoluteSlot": slot,
            "blockHeight": self.ledger.block_height,
            "epoch": slot // SLOTS_PER_EPOCH,
            "slotIndex": slot % SLOTS_PER_EPOCH,
            "slotsInEpoch": SLOTS_PER_EPOCH,
            "transactionCount": self.ledger.transaction_count,
        }

    def _get_latest_blockhash(self, params: list[Any]) -> Any:
        blockhash, last_valid = self.ledger.latest_blockhash()
        return {
            "context": self.context(),
            "value": {"blockhash": str(blockhash), "lastValidBlockHeight": last_valid},
        }

    def _is_blockhash_valid(self, params: list[Any]) -> Any:
        from solders.hash import Hash

        try:
            blockhash = Hash.from_string(_arg(params, 0, "blockhash"))
        except Exception:
            raise _params_error("Invalid param: invalid blockhash") from None
        return {"context": self.context(), "value": self.ledger.is_blockhash_valid(blockhash)}

    def _get_fee_for_message(self, params: list[Any]) -> Any:
        raw = _decode_base64(_arg(params, 0, "message"))
        try:
            message: Any = Message.from_bytes(raw)
        except Exception:
            try:
                message = MessageV0.from_bytes(raw[1:])
            except Exception:
                raise _params_error("Invalid param: invalid message") from None
        return {"context": self.context(), "value": message_fee(message)}

    def _get_minimum_balance(self, params: list[Any]) -> Any:
        size = _arg(params, 0, "data size")
        if not isinstance(size, int) or size < 0:
            raise _params_error("Invalid param: data size must be a non-negative integer")
        return self.ledger.minimum_balance_for_rent_exemption(size)

    def _get_balance(self, params: list[Any]) -> Any:
        key = _pubkey(_arg(params, 0, "pubkey"))
        return {"context": self.context(), "value": self.ledger.get_balance(key)}

    def _get_account_info(self, params: list[Any]) -> Any:
        key = _pubkey(_arg(params, 0, "pubkey"))
        config = _config(params, 1)
        encoding = _encoding(config.get("encoding", "base64"))
        return {
            "context": self.context(),
            "value": self.ui_account(key, encoding, config.get("dataSlice")),
        }

    def _get_multiple_accounts(self, params: list[Any]) -> Any:
        keys = _arg(params, 0, "pubkeys")
        if not isinstance(keys, list) or len(keys) > 100:
            raise _params_error("Invalid param: expected at most 100 public keys")
        config = _config(params, 1)
        encoding = _encoding(config.get("encoding", "base64"))
        return {
            "context": self.context(),
            "value": [self.ui_account(_pubkey(k), encoding, config.get("dataSlice")) for k in keys],
        }

    def _get_program_accounts(self, params: list[Any]) -> Any:
        owner = _pubkey(_arg(params, 0, "program id"))
        config = _config(params, 1)
        encoding = _encoding(config.get("encoding", "base64"))
        filters = config.get("filters") or []
        found = []
        for key, account in self.ledger.program_accounts(owner):
            data = bytes(account.data)
            if all(_filter_matches(f, data) for f in filters):
                found.append(
                    {
                        "pubkey": str(key),
                        "account": ui_account(account, encoding, config.get("dataSlice")),
                    }
                )
        if config.get("withContext"):
            return {"context": self.context(), "value": found}
        return found

    def _request_airdrop(self, params: list[Any]) -> Any:
        key = _pubkey(_arg(params, 0, "pubkey"))
        lamports = _arg(params, 1, "lamports")
        if not isinstance(lamports, int) or lamports <= 0:
            raise _params_error("Invalid param: lamports must be a positive integer")
        try:
            return str(self.ledger.airdrop(key, lamports))
        except TransactionFailed as e:
            raise RpcMethodError(INTERNAL_ERROR, f"airdrop failed: {e}") from None

    def _decode_transaction(self, params: list[Any]) -> bytes:
        encoded = _arg(params, 0, "transaction")
        config = _config(params, 1)
        encoding = config.get("encoding", "base58")
        if not isinstance(encoded, str):
            raise _params_error("Invalid param: transaction must be a string")
        if encoding == "base64":
            raw = _decode_base64(encoded)
        elif encoding == "base58":
            try:
                raw = based58.b58decode(encoded.encode())
            except Exception:
                raise _params_error("Invalid param: invalid base58 encoding") from None
        else:
            raise _params_error(f"Invalid param: unsupported encoding {encoding!r}")
        if len(raw) > MAX_TRANSACTION_SIZE:
            raise _params_error(
                f"base64 encoded solana_sdk::transaction::versioned::VersionedTransaction too "
                f"large: {len(raw)} bytes (max: encoded/raw 1644/{MAX_TRANSACTION_SIZE})"
            )
        return raw

    def _send_transaction(self, params: list[Any]) -> Any:
        raw = self._decode_transaction(params)
        config = _config(params, 1)
        try:
            if not config.get("skipPreflight", False):
                result = self.ledger.simulate_transaction(raw)
                if result.err is not None:
                    raise RpcMethodError(
                        SEND_TRANSACTION_PREFLIGHT_FAILURE,
                        f"Transaction simulation failed: {describe_transaction_error(result.err)}",
                        _simulation_value(result.err, result.logs, result.units, None),
                    )
            return str(self.ledger.process_transaction(raw))
        except TransactionFailed as e:
            if e.err == "SignatureFailure":
                raise RpcMethodError(
                    TRANSACTION_SIGNATURE_VERIFICATION_FAILURE,
                    "Transaction signature verification failure",
                ) from None
            if e.err == "SanitizeFailure":
                raise _params_error(
                    "Invalid param: failed to deserialize or sanitize the transaction"
                ) from None
            raise RpcMethodError(
                SEND_TRANSACTION_PREFLIGHT_FAILURE,
                f"Transaction simulation failed: {describe_transaction_error(e.err)}",
                _simulation_value(e.err, e.logs, e.units, None),
            ) from None

    def _simulate_transaction(self, params: list[Any]) -> Any:
        raw = self._decode_transaction(params)
        config = _config(params, 1)
        sig_verify = bool(config.get("sigVerify", False))
        accounts_config = config.get("accounts") or {}
        addresses = [_pubkey(a) for a in accounts_config.get("addresses", [])]
        encoding = _encoding(accounts_config.get("encoding", "base64"))
        try:
            result = self.ledger.simulate_transaction(
                raw, sig_verify=sig_verify, return_accounts=addresses
            )
        except TransactionFailed as e:
            return {"context": self.context(), "value": _simulation_value(e.err, e.logs, 0, None)}
        returned = None
        if addresses:
            returned = [
                None if result.accounts.get(a) is None else ui_account(result.accounts[a], encoding)
                for a in addresses
            ]
        return {
            "context": self.context(),
            "value": _simulation_value(result.err, result.logs, result.units, returned),
        }

    def _get_signature_statuses(self, params: list[Any]) -> Any:
        signatures = _arg(params, 0, "signatures")
        if not isinstance(signatures, list) or len(signatures) > 256:
            raise _params_error("Invalid param: expected at most 256 signatures")
        statuses: list[dict[str, Any] | None] = []
        for text in signatures:
            record = self.ledger.get_transaction(_signature(text))
            if record is None:
                statuses.append(None)
                continue
            statuses.append(
                {
                    "slot": record.slot,
                    "confirmations": None,
                    "err": record.err,
                    "status": {"Ok": None} if record.err is None else {"Err": record.err},
                    "confirmationStatus": "finalized",
                }
            )
        return {"context": self.context(), "value": statuses}

    def _get_transaction(self, params: list[Any]) -> Any:
        record = self.ledger.get_transaction(_signature(_arg(params, 0, "signature")))
        if record is None:
            return None
        option = params[1] if len(params) > 1 else None
        encoding = option if isinstance(option, str) else _config(params, 1).get("encoding", "json")
        return transaction_json(record, encoding)


# ---------------------------------------------------------------------------------------------
# JSON shapes


def _error_response(request_id: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "error": error, "id": request_id}


def _decode_base64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise _params_error("Invalid param: expected a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _params_error("Invalid param: invalid base64 encoding") from None


def _encoding(value: Any) -> str:
    if value in ("base64", "base64+zstd"):
        return str(value)
    if value in ("jsonParsed", "json", None):
        return "base64"  # nothing here has a parsed form; validators fall back to base64 too
    raise _params_error(f"Invalid param: unsupported encoding {value!r}")


def ui_account(account: Any, encoding: str, data_slice: Any = None) -> dict[str, Any]:
    data = bytes(account.data)
    if isinstance(data_slice, dict):
        offset = int(data_slice.get("offset", 0))
        length = int(data_slice.get("length", len(data)))
        data = data[offset : offset + length]
    return {
        "data": encode_account_data(data, encoding),
        "executable": bool(account.executable),
        "lamports": int(account.lamports),
        "owner": str(account.owner),
        "rentEpoch": int(account.rent_epoch),
        "space": len(account.data),
    }


def _filter_matches(flt: Any, data: bytes) -> bool:
    if not isinstance(flt, dict):
        raise _params_error("Invalid param: bad filter")
    if "dataSize" in flt:
        return bool(len(data) == flt["dataSize"])
    if "memcmp" in flt:
        memcmp = flt["memcmp"]
        offset = int(memcmp.get("offset", 0))
        encoded = memcmp.get("bytes", "")
        if memcmp.get("encoding") == "base64":
            expected = _decode_base64(encoded)
        else:
            expected = based58.b58decode(encoded.encode())
        return data[offset : offset + len(expected)] == expected
    raise _params_error("Invalid param: unsupported filter")


def _simulation_value(err: Any, logs: list[str], units: int, accounts: Any) -> dict[str, Any]:
    return {
        "err": err,
        "logs": logs,
        "accounts": accounts,
        "unitsConsumed": units,
        "returnData": None,
        "innerInstructions": None,
        "replacementBlockhash": None,
    }


def transaction_json(record: TransactionRecord, encoding: str) -> dict[str, Any]:
    tx = record.transaction
    message = tx.message
    if encoding == "base64":
        transaction: Any = [base64.b64encode(bytes(tx)).decode(), "base64"]
    else:
        keys = list(message.account_keys)
        transaction = {
            "signatures": [str(s) for s in tx.signatures],
            "message": {
                "accountKeys": [str(k) for k in keys],
                "header": {
                    "numRequiredSignatures": message.header.num_required_signatures,
                    "numReadonlySignedAccounts": message.header.num_readonly_signed_accounts,
                    "numReadonlyUnsignedAccounts": message.header.num_readonly_unsigned_accounts,
                },
                "recentBlockhash": str(message.recent_blockhash),
                "instructions": [
                    {
                        "programIdIndex": ix.program_id_index,
                        "accounts": list(ix.accounts),
                        "data": based58.b58encode(bytes(ix.data)).decode(),
                        "stackHeight": None,
                    }
                    for ix in message.instructions
                ],
            },
        }
    return {
        "slot": record.slot,
        "blockTime": record.block_time,
        "transaction": transaction,
        "meta": {
            "err": record.err,
            "status": {"Ok": None} if record.err is None else {"Err": record.err},
            "fee": record.fee,
            "preBalances": record.pre_balances,
            "postBalances": record.post_balances,
            "innerInstructions": [],
            "logMessages": record.logs,
            "preTokenBalances": [],
            "postTokenBalances": [],
            "rewards": [],
            "loadedAddresses": {"writable": [], "readonly": []},
            "computeUnitsConsumed": record.units,
        },
        "version": "legacy" if isinstance(message, Message) else 0,
    }
