"""When to retry an RPC call, and the retry loop (upstream `psyche_solana_rpc::retry`).

`classify` sorts an error into `Retryable` (network trouble, timeouts, a full or lagging node),
`NonRetryable` (the request itself is wrong: bad params, a failed preflight, a signing error, a
missing account) or `Fatal` (the run is in a state where the call makes no sense: InvalidRunState,
InvalidWitness), following upstream's rules on anchor_client errors. `retry_with_backoff` retries
only retryable errors: exponential delays from 0.5 s by ×1.5, at most 3 retries, each delay at
most 10 s (upstream's `backon` settings, no jitter).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import trio

from psyche.solana.keypair import KeypairError
from psyche.solana.rpc import (
    AccountNotFound,
    ConfirmationTimeout,
    RpcResponseError,
    RpcTransportError,
    TransactionError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class RetryKind(enum.Enum):
    Retryable = "retryable"
    NonRetryable = "non-retryable"
    Fatal = "fatal"


# Transaction errors that say "try again later" rather than "this transaction is wrong".
_RETRYABLE_TRANSACTION_ERRORS = frozenset(
    {
        "BlockhashNotFound",
        "ClusterMaintenance",
        "WouldExceedMaxBlockCostLimit",
        "WouldExceedMaxAccountCostLimit",
        "WouldExceedAccountDataBlockLimit",
        "TooManyAccountLocks",
        "AddressLookupTableNotFound",
        "WouldExceedMaxVoteCostLimit",
        "WouldExceedAccountDataTotalLimit",
        "MaxLoadedAccountsDataSizeExceeded",
        "ResanitizationNeeded",
        "ProgramExecutionTemporarilyRestricted",
        "ProgramCacheHitMaxLimit",
        "AccountBorrowOutstanding",
        "UnsupportedVersion",
    }
)


def _transaction_error_name(err: object) -> str:
    if isinstance(err, dict) and err:
        return str(next(iter(err)))
    return str(err)


def classify(error: BaseException) -> RetryKind:
    if isinstance(error, RpcTransportError):
        # Connection refused/reset, timeouts and HTTP status errors: try again.
        return RetryKind.Retryable
    if isinstance(error, RpcResponseError):
        if -32602 <= error.code <= -32600:
            return RetryKind.NonRetryable
        if error.simulation_err is not None:
            return RetryKind.NonRetryable
        message = error.message
        if "InvalidRunState" in message or "InvalidWitness" in message:
            return RetryKind.Fatal
        if "Failed to tick" in message:
            return RetryKind.Retryable
        if "already been processed" in message:
            return RetryKind.NonRetryable
        return RetryKind.Retryable
    if isinstance(error, TransactionError):
        if _transaction_error_name(error.err) in _RETRYABLE_TRANSACTION_ERRORS:
            return RetryKind.Retryable
        return RetryKind.NonRetryable
    if isinstance(error, ConfirmationTimeout):
        return RetryKind.Retryable
    if isinstance(error, AccountNotFound | KeypairError | ValueError | TypeError):
        return RetryKind.NonRetryable
    return RetryKind.Retryable


@dataclass(frozen=True)
class RetryPolicy:
    initial_delay: float = 0.5
    factor: float = 1.5
    max_retries: int = 3
    max_delay: float = 10.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_delay
        for _ in range(self.max_retries):
            yield min(delay, self.max_delay)
            delay *= self.factor


class RetryFailed(Exception):
    """An operation gave up; `kind` says why and `cause` is the last error."""

    def __init__(self, kind: RetryKind, cause: BaseException, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.cause = cause


async def retry_with_backoff(
    name: str, operation: Callable[[], Awaitable[T]], policy: RetryPolicy
) -> T:
    """Run `operation`, retrying retryable errors; raises RetryFailed otherwise."""
    delays = policy.delays()
    while True:
        try:
            return await operation()
        except Exception as error:
            kind = classify(error)
            if kind is not RetryKind.Retryable:
                raise RetryFailed(kind, error, str(error)) from error
            delay = next(delays, None)
            if delay is None:
                raise RetryFailed(kind, error, str(error)) from error
            log.warning("[RETRY] %s retrying after %.2fs: %s", name, delay, error)
            await trio.sleep(delay)
