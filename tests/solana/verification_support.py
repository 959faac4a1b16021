"""What the Solana verification tests share (so that no test module imports another): the
scripted run's reports (`send_report`, `refused`), the slashing rate every verifying run is
given (`SLASHING_RATE`, `set_rates`), a landed transaction's instruction names
(`instruction_names`), an instruction sent without one signer (`unsigned`), a treasurer run
with its verification account (`TreasurerRun`), and the end-to-end tests' four members, one of
them hostile (`HOSTILE_SCRIPT`, `start_members`)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio
from solders.instruction import AccountMeta, Instruction
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature

from psyche.cli.solana_client.main import main as solana_client
from psyche.coordinator.verification import VerificationReport
from psyche.solana import admin, pda
from psyche.solana.backend import Cluster, SolanaBackend, SolanaBackendError
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.instructions import spec_for_data
from psyche.solana.instructions import treasurer as treasurer_ix
from psyche.solana.localnet.server import LocalnetThread
from psyche.solana.state import COORDINATOR_ACCOUNT_SPACE, decode_anchor_account
from psyche.solana.verification import RunVerification

from ..processes import REPO, Proc, Processes, free_port
from .conftest import Endpoint
from .processes import Endpoint as EndpointProcess
from .processes import create_run, member_train_argv, start_endpoint
from .scripted import RUN_ID as SCRIPTED_RUN_ID
from .scripted import config as scripted_config
from .scripted import tiny_model
from .support import solana_client_output

SLASHING_RATE = 10
"""Slashed from a punished member (`create_run`'s and `set_rates`'s future epoch rates)."""


async def send_report(
    backend: SolanaBackend,
    account: Pubkey,
    report: VerificationReport,
    draw_signer: tuple[bytes, bytes] | None = None,
) -> None:
    """`report` from `backend`'s wallet, about the scripted run (`scripted.RUN_ID`), with the `Ed25519SigVerify` instruction of its draw
    (`draw_signer`: key and message) when it has one."""
    instructions = coordinator_ix.verification_report_instructions(
        pda.find_coordinator_instance(SCRIPTED_RUN_ID, backend.ids),
        account,
        backend.get_payer(),
        report,
        draw_signer,
        backend.ids,
    )
    await backend.send_and_retry("Verification report", instructions)


async def refused(
    backend: SolanaBackend,
    account: Pubkey,
    report: VerificationReport,
    draw_signer: tuple[bytes, bytes] | None = None,
) -> str:
    """The program's refusal of `report` (as `send_report` sends it), as text."""
    with pytest.raises(SolanaBackendError) as info:
        await send_report(backend, account, report, draw_signer)
    return str(info.value)


HOSTILE_SCRIPT = REPO / "tests" / "solana" / "hostile_solana_client.py"


async def set_rates(cluster: Cluster, owner_wallet: Keypair, run_id: str) -> None:
    """The run's future epoch rates, set by its owner: 1000 earned a round, `SLASHING_RATE`
    slashed a punished member."""
    async with SolanaBackend(cluster, owner_wallet) as owner:
        account = (await admin.load_run(owner, run_id)).account_address
        rates = coordinator_ix.coordinator_set_future_epoch_rates(
            run_id, account, owner.get_payer(), 1000, SLASHING_RATE, owner.ids
        )
        await owner.send_and_retry("Set future epoch rates", [rates])


def instruction_names(net: LocalnetThread, signature: str) -> list[str]:
    """The coordinator and treasurer instructions of a landed transaction, by name."""
    record = net.ledger.get_transaction(Signature.from_string(signature))
    assert record is not None
    assert record.err is None
    message = record.transaction.message
    ids = net.ledger.program_ids
    programs = {ids.coordinator_key: "coordinator", ids.treasurer_key: "treasurer"}
    names = []
    for ix in message.instructions:
        program = programs.get(message.account_keys[ix.program_id_index])
        spec = None if program is None else spec_for_data(program, bytes(ix.data))
        if spec is not None:
            names.append(spec.name)
    return names


def unsigned(instruction: Instruction, key: Pubkey) -> Instruction:
    """`instruction` with `key` named but not a signer (what a sender without its key sends)."""
    metas = [
        AccountMeta(m.pubkey, False, m.is_writable) if m.pubkey == key else m
        for m in instruction.accounts
    ]
    return Instruction(instruction.program_id, instruction.data, metas)


@dataclasses.dataclass
class TreasurerRun:
    """A treasurer run on `endpoint` at 25 % verification, not started, with its verification
    account; `main` is its main authority, `payer` pays."""

    endpoint: Endpoint
    payer: Keypair
    main: Keypair
    run_id: str
    index: int
    account: Pubkey

    @property
    def ids(self) -> Any:
        return self.endpoint.ledger.program_ids

    @property
    def address(self) -> Pubkey:
        return pda.find_run_verification(self.account, self.ids)

    @classmethod
    def create(cls, endpoint: Endpoint) -> TreasurerRun:
        payer, main = Keypair(), Keypair()
        endpoint.airdrop(payer.pubkey(), 10_000_000_000)  # the verification account: 6.3 SOL
        ids = endpoint.ledger.program_ids
        index, run_id = 7, "treasurer verifiers_train"
        mint = endpoint.new_mint(payer, Pubkey.new_unique(), 6)
        account = endpoint.new_exempt(payer, COORDINATOR_ACCOUNT_SPACE, ids.coordinator_key)
        instance = pda.find_coordinator_instance(run_id, ids)
        create = treasurer_ix.treasurer_run_create(
            payer.pubkey(), run_id, "latest", index, mint, account, main.pubkey(),
            Pubkey.new_unique(),
        )  # fmt: skip
        endpoint.process([create], payer)
        config = scripted_config(verification_percent=25, min_clients=4, init_min_clients=4)
        params = treasurer_ix.RunUpdateParams(config=config, model=tiny_model())
        update = treasurer_ix.treasurer_run_update(run_id, index, account, main.pubkey(), params)
        endpoint.process([update], payer, [main])
        init = coordinator_ix.coordinator_init_verification(payer.pubkey(), instance, account, ids)
        endpoint.process([init], payer)
        return cls(endpoint, payer, main, run_id, index, account)

    def verification(self) -> RunVerification:
        data = bytes(self.endpoint.account(self.address).data)
        return decode_anchor_account(data, RunVerification)

    def stored(self) -> bool:
        return self.verification().verifiers_train

    def set_on(self, authority: Pubkey) -> Instruction:
        return treasurer_ix.treasurer_run_set_verifiers_train(
            self.run_id, self.index, self.account, authority, True, self.ids
        )


def open_verifying_run(
    processes: Processes, directory: Path, run_id: str, config: Mapping[str, Any]
) -> EndpointProcess:
    """A local endpoint (its own process) with wallets for the owner and the four members, and
    on it the run `run_id` with `config`, its rates set (`set_rates`: `create-run` sets them only
    through a treasurer) and resumed: what both
    verifier end-to-end tests start from."""
    names = ("owner", "a", "b", "c", "hostile")
    endpoint = start_endpoint(processes, directory, names)
    cluster = create_run(endpoint, directory, run_id, dict(config))
    trio.run(set_rates, Cluster(endpoint.rpc, endpoint.ws), endpoint.wallets["owner"], run_id)
    assert solana_client(["set-paused", "--run-id", run_id, "--resume", *cluster]) == 0
    return endpoint


def shown_run(endpoint: EndpointProcess, run_id: str) -> dict[str, Any]:
    """`psyche-solana-client show --json` of `run_id` on `endpoint`, parsed."""
    argv = ["show", "--run-id", run_id, "--json", "--rpc", endpoint.rpc, "--ws-rpc", endpoint.ws]
    return dict(json.loads(solana_client_output(argv)))


def start_members(
    processes: Processes,
    endpoint: EndpointProcess,
    run_id: str,
    attack: str,
    hostile_env: Mapping[str, str],
) -> tuple[list[Proc], Proc]:
    """The four members of an end-to-end verifying run as real `psyche-solana-client train`
    processes, each on a known port that every other knows: "a", "b" and "c" honest, "hostile"
    through `HOSTILE_SCRIPT` with `attack` (its results from step 0) and `hostile_env` (how it
    lies in its other roles). The honest ones and the hostile one."""
    members = ("a", "b", "c", "hostile")
    ports = {name: free_port() for name in members}

    def train(name: str) -> list[str]:
        return member_train_argv(endpoint, run_id, name, ports)

    env = {"OMP_NUM_THREADS": "1", "CLIENT_VERSION": "test"}
    honest = [
        processes.start(
            f"client-{n}", [sys.executable, "-m", "psyche.cli.solana_client.main", *train(n)],
            env=env,
        )
        for n in "abc"
    ]  # fmt: skip
    hostile = processes.start(
        "hostile",
        [sys.executable, str(HOSTILE_SCRIPT), attack, "0", "--", *train("hostile")],
        env={**env, **hostile_env},
    )
    return honest, hostile
