"""The Solana backend's RPC side: reads and writes a run's on-chain state (upstream
`psyche_solana_rpc::backend`; following a run is `psyche.solana.follower`).

`SolanaBackend` talks to a primary RPC endpoint and optional backups. Every call goes through
`rpc_with_fallback`: up to 3 retries with backoff on one endpoint for retryable errors, then the
next endpoint; a non-retryable or fatal error stops at once. Transactions are legacy transactions
paid and signed by the wallet, with a fresh blockhash per attempt, sent with preflight and
confirmed at the backend's commitment.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.token.state import Mint, TokenAccount
from solders.transaction import Transaction

from psyche.coordinator.backend import OpportunisticData
from psyche.core.node_identity import NodeIdentity
from psyche.solana import pda
from psyche.solana.cluster import (
    DEVNET_RPC,
    DEVNET_WS_RPC,
    LOCALNET_RPC,
    LOCALNET_WS_RPC,
    Cluster,
)
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.program_ids import DEFAULT_PROGRAM_IDS, ProgramIds
from psyche.solana.retry import RetryFailed, RetryKind, RetryPolicy, retry_with_backoff
from psyche.solana.rpc import AccountInfo, AccountNotFound, SolanaRpcClient, TransactionError
from psyche.solana.state import (
    JOIN_RUN_AUTHORIZATION_SCOPE,
    Authorization,
    CoordinatorAccount,
    CoordinatorInstance,
    Participant,
    TreasurerRun,
    coordinator_account_from_bytes,
    decode_anchor_account,
)
from psyche.solana.subscription import upstream_reconnect_delay
from psyche.solana.verification import RunVerification

log = logging.getLogger(__name__)

T = TypeVar("T")

JOIN_RUN_TIMEOUT = 5.0
UPSTREAM_RETRY_POLICY = RetryPolicy()


class SolanaBackendError(Exception):
    """A backend call that failed for good; `kind` is why (None: every endpoint exhausted)."""

    def __init__(self, message: str, kind: RetryKind | None, cause: BaseException | None) -> None:
        super().__init__(message)
        self.kind = kind
        self.cause = cause


class SolanaBackend:
    def __init__(
        self,
        cluster: Cluster,
        payer: Keypair,
        backup_clusters: Sequence[Cluster] = (),
        *,
        ids: ProgramIds = DEFAULT_PROGRAM_IDS,
        commitment: str = "confirmed",
        retry_policy: RetryPolicy = UPSTREAM_RETRY_POLICY,
        confirm_timeout: float = 30.0,
        rpc_timeout: float = 30.0,
        reconnect_delay: Callable[[int], float] = upstream_reconnect_delay,
    ) -> None:
        self.cluster = cluster
        self.backup_clusters = [b for b in backup_clusters if b.rpc != cluster.rpc]
        self.payer = payer
        self.ids = ids
        self.commitment = commitment
        self.retry_policy = retry_policy
        self.confirm_timeout = confirm_timeout
        self.reconnect_delay = reconnect_delay
        self.clients = [
            SolanaRpcClient(c.rpc, commitment=commitment, timeout=rpc_timeout)
            for c in [cluster, *self.backup_clusters]
        ]

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def __aenter__(self) -> SolanaBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def get_payer(self) -> Pubkey:
        return self.payer.pubkey()

    def sign_message(self, message: bytes) -> Signature:
        """The wallet's ed25519 signature of `message` (off-chain proof of the wallet)."""
        return self.payer.sign_message(message)

    # ---- fallback ---------------------------------------------------------------------------

    async def rpc_with_fallback(
        self, name: str, operation: Callable[[SolanaRpcClient], Awaitable[T]]
    ) -> T:
        last_error: RetryFailed | None = None
        for index, client in enumerate(self.clients):
            try:
                return await retry_with_backoff(
                    name, functools.partial(operation, client), self.retry_policy
                )
            except RetryFailed as failed:
                if failed.kind is RetryKind.NonRetryable:
                    raise SolanaBackendError(
                        f"non-retryable RPC error: {failed}", failed.kind, failed.cause
                    ) from failed.cause
                if failed.kind is RetryKind.Fatal:
                    raise SolanaBackendError(
                        f"fatal RPC error: {failed}", failed.kind, failed.cause
                    ) from failed.cause
                log.warning(
                    "RPC %d (%s) exhausted retries for %s, trying next: %s",
                    index,
                    client.url,
                    name,
                    failed,
                )
                last_error = failed
        raise SolanaBackendError(
            f"all RPCs exhausted: {last_error}",
            None,
            None if last_error is None else last_error.cause,
        )

    # ---- reads ------------------------------------------------------------------------------

    async def get_account_info(self, address: Pubkey) -> AccountInfo | None:
        return await self.rpc_with_fallback(
            "get_account_info", lambda c: c.get_account_info(address)
        )

    async def get_program_accounts(
        self, program: Pubkey, *, memcmp: tuple[int, bytes] | None = None
    ) -> list[tuple[Pubkey, AccountInfo]]:
        return await self.rpc_with_fallback(
            "get_program_accounts", lambda c: c.get_program_accounts(program, memcmp=memcmp)
        )

    async def get_data(self, address: Pubkey) -> bytes:
        return await self.rpc_with_fallback("get_data", lambda c: c.get_account_data(address))

    async def get_balance(self, address: Pubkey) -> int:
        return await self.rpc_with_fallback("get_balance", lambda c: c.get_balance(address))

    async def get_minimum_balance_for_rent_exemption(self, space: int) -> int:
        return await self.rpc_with_fallback(
            "get_minimum_balance_for_rent_exemption",
            lambda c: c.get_minimum_balance_for_rent_exemption(space),
        )

    async def get_logs(self, signature: Signature) -> list[str]:
        return await self.rpc_with_fallback("get_logs", lambda c: c.get_transaction_logs(signature))

    async def get_coordinator_instance(self, address: Pubkey) -> CoordinatorInstance:
        return decode_anchor_account(await self.get_data(address), CoordinatorInstance)

    async def get_coordinator_account(self, address: Pubkey) -> CoordinatorAccount:
        return coordinator_account_from_bytes(await self.get_data(address))

    async def get_authorization(self, address: Pubkey) -> Authorization:
        return decode_anchor_account(await self.get_data(address), Authorization)

    async def get_treasurer_run(self, address: Pubkey) -> TreasurerRun:
        return decode_anchor_account(await self.get_data(address), TreasurerRun)

    async def get_treasurer_participant(self, address: Pubkey) -> Participant:
        return decode_anchor_account(await self.get_data(address), Participant)

    async def get_token_account(self, address: Pubkey) -> TokenAccount:
        return TokenAccount.from_bytes(await self.get_data(address))

    async def get_token_mint(self, address: Pubkey) -> Mint:
        return Mint.from_bytes(await self.get_data(address))

    async def resolve_treasurer_index(
        self, run_id: str, treasurer_index: int | None = None
    ) -> int | None:
        """The run's treasurer index if its treasurer `Run` account exists, else None."""
        index = pda.compute_deterministic_treasurer_index(run_id, treasurer_index)
        balance = await self.get_balance(pda.find_run(index, self.ids))
        return index if balance > 0 else None

    def find_join_authorization(self, join_authority: Any, authorizer: Any | None) -> Pubkey:
        return pda.find_join_authorization(join_authority, authorizer, self.ids)

    # ---- writes -----------------------------------------------------------------------------

    async def send_and_retry(
        self,
        name: str,
        instructions: Sequence[Instruction],
        signers: Sequence[Keypair] = (),
        *,
        sent: list[Signature] | None = None,
    ) -> Signature:
        """Send and confirm. `sent` collects the signature of every attempt; passing the same
        list to a later call makes it check those attempts first (one may have landed)."""
        log.info("sending transaction: %s", name)
        all_signers = [self.payer, *(s for s in signers if s.pubkey() != self.payer.pubkey())]
        message = Message(list(instructions), self.payer.pubkey())
        required = message.account_keys[: message.header.num_required_signatures]
        missing = set(required) - {s.pubkey() for s in all_signers}
        if missing:
            raise SolanaBackendError(
                f"{name}: cannot sign, missing the keypair of {sorted(map(str, missing))}",
                RetryKind.NonRetryable,
                None,
            )

        sent = [] if sent is None else sent

        async def attempt(client: SolanaRpcClient) -> Signature:
            # An earlier attempt may have landed although its answer was lost (the endpoint
            # went away mid-request): sending again would run the instructions twice.
            for earlier in sent:
                status = await client.get_signature_status(earlier)
                if status is not None:
                    if status.get("err") is not None:
                        raise TransactionError(earlier, status["err"])
                    return earlier
            blockhash, _ = await client.get_latest_blockhash()
            tx = Transaction(all_signers, message, blockhash)
            signature = tx.signatures[0]
            sent.append(signature)
            await client.send_transaction(bytes(tx))
            await client.confirm_transaction(signature, timeout=self.confirm_timeout)
            return signature

        signature = await self.rpc_with_fallback(name, attempt)
        log.info("transaction success: %s, %s", name, signature)
        return signature

    async def create_if_missing(
        self, name: str, address: Pubkey, instruction: Instruction
    ) -> Signature | None:
        """Send `instruction` (which creates the account at `address`) unless that account
        already holds lamports, as upstream checks before creating; its signature, or None when
        the account was there."""
        if await self.get_balance(address) != 0:
            return None
        return await self.send_and_retry(name, [instruction])

    async def join_run(
        self,
        coordinator_instance: Pubkey,
        coordinator_account: Pubkey,
        client_id: NodeIdentity,
        authorizer: Any | None = None,
    ) -> Signature:
        """Join the run (5 s timeout, as upstream: better to give up and try again)."""
        instance = await self.get_coordinator_instance(coordinator_instance)
        authorization = self.find_join_authorization(instance.join_authority, authorizer)
        await self.check_join_authorization(instance, authorization, client_id, authorizer)
        verification = self.verification_account(
            coordinator_account, await self.get_coordinator_account(coordinator_account)
        )
        instruction = coordinator_ix.with_verification(
            coordinator_ix.coordinator_join_run(
                coordinator_instance, coordinator_account, authorization, client_id, self.ids
            ),
            verification,
        )
        with trio.move_on_after(JOIN_RUN_TIMEOUT) as scope:
            return await self.send_and_retry("Join run", [instruction])
        assert scope.cancelled_caught
        raise SolanaBackendError(f"join_run timeout after {JOIN_RUN_TIMEOUT:.0f}s", None, None)

    async def check_join_authorization(
        self,
        instance: CoordinatorInstance,
        authorization: Pubkey,
        client_id: NodeIdentity,
        authorizer: Any | None,
    ) -> None:
        """Fail early, and clearly, when the run's join authorization does not cover us (the
        program would reject the join with a bare constraint error)."""
        join_authority = Pubkey.from_bytes(instance.join_authority)
        try:
            state = await self.get_authorization(authorization)
        except SolanaBackendError as e:
            if isinstance(e.cause, AccountNotFound):
                whom = "everyone" if authorizer is None else f"authorizer {authorizer}"
                raise SolanaBackendError(
                    f"cannot join: the run's join authority {join_authority} has not authorized "
                    f"{whom} (no authorization at {authorization}); a permissioned run needs "
                    "--authorizer",
                    RetryKind.NonRetryable,
                    e.cause,
                ) from None
            raise
        if not state.is_valid_for(join_authority, client_id.signer, JOIN_RUN_AUTHORIZATION_SCOPE):
            raise SolanaBackendError(
                f"cannot join: the authorization at {authorization} does not cover "
                f"{Pubkey.from_bytes(client_id.signer)} (inactive, or neither its grantee nor a "
                "delegate)",
                RetryKind.NonRetryable,
                None,
            )

    def verification_account(
        self, coordinator_account: Pubkey, account: CoordinatorAccount
    ) -> Pubkey | None:
        """The run's verification account, which its member instructions need, in a run with
        `verification_percent > 0` (`psyche.solana.verification`); None in a run without."""
        if account.state.coordinator.config.verification_percent == 0:
            return None
        return pda.find_run_verification(coordinator_account, self.ids)

    async def get_run_verification(self, coordinator_account: Pubkey) -> RunVerification | None:
        """The run's verification account (`psyche.solana.verification`), or None where it has
        none (a run that never verified, or whose first client has not created it yet)."""
        info = await self.get_account_info(pda.find_run_verification(coordinator_account, self.ids))
        if info is None or info.owner != self.ids.coordinator_key:
            return None
        return decode_anchor_account(info.data, RunVerification)

    async def ensure_verification_account(
        self, coordinator_instance: Pubkey, coordinator_account: Pubkey
    ) -> Pubkey | None:
        """Create the run's verification account when the run verifies and nobody has yet (the
        wallet pays its rent); its address, or None in a run without verification."""
        address = self.verification_account(
            coordinator_account, await self.get_coordinator_account(coordinator_account)
        )
        if address is None or await self.get_account_info(address) is not None:
            return address
        try:
            await self.send_and_retry(
                "Init verification",
                [
                    coordinator_ix.coordinator_init_verification(
                        self.get_payer(), coordinator_instance, coordinator_account, self.ids
                    )
                ],
            )
        except SolanaBackendError:
            if await self.get_account_info(address) is None:
                raise  # else another member created it first
        return address

    def tick_instruction(
        self,
        coordinator_instance: Pubkey,
        coordinator_account: Pubkey,
        verification: Pubkey | None = None,
    ) -> Instruction:
        return coordinator_ix.with_verification(
            coordinator_ix.coordinator_tick(
                coordinator_instance, coordinator_account, self.get_payer(), self.ids
            ),
            verification,
        )

    def witness_instruction(
        self,
        coordinator_instance: Pubkey,
        coordinator_account: Pubkey,
        data: OpportunisticData,
        verification: Pubkey | None = None,
    ) -> tuple[str, Instruction]:
        match data:
            case OpportunisticData.WitnessStep((witness, metadata)):
                name, instruction = (
                    "Witness",
                    coordinator_ix.coordinator_witness(
                        coordinator_instance,
                        coordinator_account,
                        self.get_payer(),
                        witness,
                        metadata,
                        self.ids,
                    ),
                )
            case OpportunisticData.WarmupStep(witness):
                name, instruction = (
                    "Warmup witness",
                    coordinator_ix.coordinator_warmup_witness(
                        coordinator_instance,
                        coordinator_account,
                        self.get_payer(),
                        witness,
                        self.ids,
                    ),
                )
            case _:
                raise TypeError(f"not opportunistic data: {data!r}")
        return name, coordinator_ix.with_verification(instruction, verification)


__all__ = [
    "DEVNET_RPC",
    "DEVNET_WS_RPC",
    "LOCALNET_RPC",
    "LOCALNET_WS_RPC",
    "Cluster",
    "SolanaBackend",
    "SolanaBackendError",
]
