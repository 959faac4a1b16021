"""What the Solana tests share: a CLI's printed output (`solana_client_output`), the verifying
run's settings the end-to-end tests start from (`VERIFYING`), how the RPC names a coordinator
program error (`error_text`), a run on a new local endpoint (`open_run`), and a verifying run
of scripted members on one (`verified_run`, with the program's verification record
`verification_state`)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import AsyncIterator

import trio
from solders.pubkey import Pubkey

from psyche.cli.solana_client.main import main as solana_client
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.verification import RoundDuties
from psyche.solana import pda
from psyche.solana.anchor import COORDINATOR_ERRORS, error_code
from psyche.solana.backend import Cluster, SolanaBackend
from psyche.solana.follower import follow_run
from psyche.solana.localnet.ledger import Ledger, ManualClock
from psyche.solana.state import decode_anchor_account
from psyche.solana.verification import RunVerification

from .scripted import (
    RUN_ID,
    Driver,
    ScriptedClient,
    config,
    create_run,
    make_backend,
    open_localnet,
)

VERIFYING = {
    "warmup_time": 10,
    "cooldown_time": 3,
    "epoch_time": 60,
    "max_round_train_time": 20,
    "round_witness_time": 2,
    "min_clients": 3,
    "init_min_clients": 4,
    "waiting_for_members_extra_time": 2,
    "verification_percent": 25,
    "witness_nodes": 0,
}
"""A run with `verification_percent = 25` (each round one tie-breaker, one verifier, two
trainers) as the end-to-end tests create it."""


def solana_client_output(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert solana_client(argv) == 0
    return out.getvalue()


async def verification_state(backend: SolanaBackend, account: Pubkey) -> RunVerification:
    data = await backend.get_data(pda.find_run_verification(account, backend.ids))
    return decode_anchor_account(data, RunVerification)


def error_text(name: str) -> str:
    """How the RPC error names the coordinator program's error `name`."""
    return f"custom program error: 0x{error_code(COORDINATOR_ERRORS, name):x}"


@dataclasses.dataclass
class VerifiedRun:
    """A run at `verification_percent = 25` on a local endpoint, four scripted members
    following it (1 tie-breaker, 1 verifier, 2 trainers a round)."""

    ledger: Ledger
    cluster: list[Cluster]
    owner: SolanaBackend
    account: Pubkey
    clients: list[ScriptedClient]
    config: CoordinatorConfig

    @property
    def by_signer(self) -> dict[bytes, ScriptedClient]:
        return {bytes(c.backend.get_payer()): c for c in self.clients}

    @contextlib.asynccontextmanager
    async def followed(self, nursery: trio.Nursery) -> AsyncIterator[Driver]:
        """The members following the run, and a driver of its clock (the owner observing)."""
        async with follow_run(self.owner, RUN_ID, self.account) as observer:
            for client in self.clients:
                await nursery.start(client.run, self.account)
            yield Driver(self.ledger, self.owner, observer)

    async def this_round(self, driver: Driver) -> tuple[int, RoundDuties]:
        """The driver's current step and the duties the program recorded for it."""
        assert driver.state is not None
        step = driver.state.progress.step
        return step, await self.duties(step)

    async def duties(self, step: int) -> RoundDuties:
        """The duties the program recorded for `step`."""
        stored = (await verification_state(self.owner, self.account)).round(step)
        assert stored is not None, "the round's witness recorded its duties"
        return stored.record().duties


async def open_run(
    nursery: trio.Nursery, run_config: CoordinatorConfig, clock: ManualClock | None = None
) -> tuple[Ledger, list[Cluster], SolanaBackend, Pubkey]:
    """A new local endpoint served in `nursery` (its ledger on `clock`, `open_localnet`) and a
    run of `run_config` created on it by a funded owner (`create_run`): the ledger, the
    endpoint's cluster, the owner and the run's coordinator account."""
    ledger, _, cluster = await open_localnet(nursery, clock)
    owner = make_backend(ledger, cluster)
    return ledger, cluster, owner, await create_run(owner, run_config)


async def verified_run(nursery: trio.Nursery, members: str = "abcd", **changes: int) -> VerifiedRun:
    """A run at `verification_percent = 25` (and `changes` to its config) with `members`."""
    batch = max(4, len(members))  # no more clients than batches
    run_config = config(
        verification_percent=25,
        init_min_clients=len(members),
        min_clients=3,
        global_batch_size_start=batch,
        global_batch_size_end=batch,
        **changes,
    )
    ledger, cluster, owner, account = await open_run(nursery, run_config)
    clients = [ScriptedClient(n, make_backend(ledger, cluster)) for n in members]
    return VerifiedRun(ledger, cluster, owner, account, clients, run_config)
