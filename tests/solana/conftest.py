"""Shared helpers for the Solana tests: a local endpoint in a thread, driven with solana-py."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from solana.exceptions import SolanaRpcException
from solana.rpc.api import Client
from solana.rpc.commitment import Confirmed
from solana.rpc.core import RPCException
from solana.rpc.types import TxOpts
from solders import system_program
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.transaction import Transaction
from spl.token.constants import TOKEN_PROGRAM_ID
from spl.token.instructions import InitializeMintParams, initialize_mint

from psyche.solana import pda
from psyche.solana.anchor import find_anchor_error
from psyche.solana.instructions import authorizer as authorizer_ix
from psyche.solana.localnet.ledger import Ledger, ManualClock
from psyche.solana.localnet.server import LocalnetThread
from psyche.solana.state import JOIN_RUN_AUTHORIZATION_SCOPE

START = 1_700_000_000


MINT_SIZE = 82  # an SPL token mint account's bytes


class TransactionRejected(Exception):
    def __init__(self, message: str, logs: list[str]) -> None:
        super().__init__(message)
        self.logs = logs

    @property
    def anchor_error(self) -> str | None:
        found = find_anchor_error(self.logs)
        return None if found is None else found.name


class Endpoint:
    """Upstream's memnet helpers (`process_instruction`, `get_account`, clock forwarding) over a
    real JSON-RPC connection to the local endpoint, through solana-py's client."""

    def __init__(self, net: LocalnetThread, clock: ManualClock) -> None:
        self.net = net
        self.clock = clock
        self.client = Client(net.rpc_url, commitment=Confirmed)

    @property
    def ledger(self) -> Ledger:
        return self.net.ledger

    def airdrop(self, key: Pubkey, lamports: int) -> None:
        signature = self.client.request_airdrop(key, lamports).value
        self.client.confirm_transaction(signature)

    def process(
        self,
        instructions: Sequence[Instruction],
        payer: Keypair,
        signers: Sequence[Keypair] = (),
        *,
        preflight: bool = True,
    ) -> Signature:
        """Send and confirm; without preflight a failure shows in the signature's status (and
        is raised here too), as upstream's memnet `process_instruction` reports it."""
        keypairs = [payer, *(s for s in signers if s.pubkey() != payer.pubkey())]
        blockhash = self.client.get_latest_blockhash().value.blockhash
        tx = Transaction(keypairs, Message(list(instructions), payer.pubkey()), blockhash)
        opts = TxOpts(skip_confirmation=False, skip_preflight=not preflight)
        try:
            signature = self.client.send_transaction(tx, opts=opts).value
            if not preflight:
                status = self.client.get_signature_statuses([signature]).value[0]
                if status is None or status.err is not None:
                    logs = self.client.get_transaction(signature).value
                    raise TransactionRejected(
                        f"transaction failed: {status}",
                        [] if logs is None else list(logs.transaction.meta.log_messages or []),
                    )
        except RPCException as e:
            data = e.args[0]
            logs = list(getattr(getattr(data, "data", None), "logs", None) or [])
            raise TransactionRejected(str(getattr(data, "message", data)), logs) from None
        return signature

    def process_err(
        self, instructions: Sequence[Instruction], payer: Keypair, signers: Sequence[Keypair] = ()
    ) -> TransactionRejected:
        with pytest.raises(TransactionRejected) as info:
            self.process(instructions, payer, signers)
        return info.value

    def authorize(
        self, payer: Keypair, grantor: Keypair, grantee: Pubkey, *, preflight: bool = True
    ) -> Pubkey:
        """`grantor`'s active join authorization of `grantee` (created and activated in one
        transaction that `payer` pays for); its address."""
        scope = JOIN_RUN_AUTHORIZATION_SCOPE
        self.process(
            [
                authorizer_ix.authorizer_authorization_create(
                    payer.pubkey(), grantor.pubkey(), grantee, scope
                ),
                authorizer_ix.authorizer_authorization_grantor_update(
                    grantor.pubkey(), grantee, scope, True
                ),
            ],
            payer,
            [grantor],
            preflight=preflight,
        )
        return pda.find_authorization(grantor.pubkey(), grantee, scope)

    def account(self, key: Pubkey) -> Any:
        return self.client.get_account_info(key).value

    def balance(self, key: Pubkey) -> int:
        return self.client.get_balance(key).value

    def new_exempt(self, payer: Keypair, space: int, owner: Pubkey) -> Pubkey:
        account = Keypair()
        rent = self.client.get_minimum_balance_for_rent_exemption(space).value
        self.process(
            [
                system_program.create_account(
                    system_program.CreateAccountParams(
                        from_pubkey=payer.pubkey(),
                        to_pubkey=account.pubkey(),
                        lamports=rent,
                        space=space,
                        owner=owner,
                    )
                )
            ],
            payer,
            [account],
        )
        return account.pubkey()

    def new_mint(self, payer: Keypair, authority: Pubkey, decimals: int) -> Pubkey:
        """A new SPL token mint (rent-exempt, paid by `payer`) that `authority` mints; its
        address."""
        mint = self.new_exempt(payer, MINT_SIZE, TOKEN_PROGRAM_ID)
        self.process(
            [initialize_mint(InitializeMintParams(decimals, TOKEN_PROGRAM_ID, mint, authority))],
            payer,
        )
        return mint

    def forward_clock(self, seconds: int) -> None:
        self.ledger.advance_clock(seconds)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command reads its flags' environment variables: none leak in from outside."""
    for name in (
        "RAW_WALLET_PRIVATE_KEY",
        "RPC",
        "WS_RPC",
        "RUN_ID",
        "WALLET_PRIVATE_KEY_PATH",
        "PSYCHE_COORDINATOR_PROGRAM_ID",
        "CLIENT_VERSION",
        "CONFIG_PATH",
        "PSYCHE_AUTHORIZER_PROGRAM_ID",
        "PSYCHE_TREASURER_PROGRAM_ID",
        "ADDRESS",
        "AUTHORIZER",
        "JOIN_AUTHORITY",
        "TREASURER_INDEX",
        "COLLATERAL_AMOUNT",
        "EARNING_RATE_TOTAL_SHARED",
        "SLASHING_RATE_PER_CLIENT",
        "DELEGATES_ADDED",
        "OUTPUT_DIR",
        "EXPIRES_IN_SECONDS",
        "RUN_DOWN_SERVICE_URL",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def net() -> Iterator[LocalnetThread]:
    with LocalnetThread(Ledger(clock=ManualClock(START))) as thread:
        yield thread


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    clock = ManualClock(START)
    with LocalnetThread(Ledger(clock=clock)) as net:
        yield Endpoint(net, clock)


__all__ = ["Endpoint", "SolanaRpcException", "TransactionRejected"]
