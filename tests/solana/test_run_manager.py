"""Upstream run-manager's commands in `psyche-solana-client` against the local endpoint:
`json-dump-run`/`json-dump-user` (JSON compared key for key with upstream's documents and field
by field with the accounts read back), the treasurer's top-up and claim (token balances and
participant accounts read back), `list-runs`, and `download-results`/`upload-data` against a
stand-in of the run-down service on loopback."""

from __future__ import annotations

import io
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.token.state import TokenAccount
from spl.token.constants import TOKEN_PROGRAM_ID
from spl.token.instructions import (
    MintToParams,
    create_associated_token_account,
    get_associated_token_address,
    mint_to,
)

from psyche.cli.solana_client.main import main
from psyche.coordinator import RunState, Witness, WitnessMetadata
from psyche.coordinator.committee_selection import CommitteeSelection
from psyche.core.node_identity import NodeIdentity
from psyche.solana import pda
from psyche.solana.commands.render import (
    clients_display,
    format_duration_secs,
    time_remaining_display,
)
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.localnet.ledger import ManualClock
from psyche.solana.localnet.server import LocalnetThread
from psyche.solana.program_ids import COORDINATOR_PROGRAM_ID
from psyche.solana.runs import RunInfo
from psyche.solana.state import (
    CoordinatorInstance,
    CoordinatorInstanceState,
    Participant,
    TreasurerRun,
    coordinator_account_from_bytes,
    decode_anchor_account,
)

from .cli_helpers import EVERYONE, RUN_CONFIG, funded_wallet, ok, run_cli
from .conftest import Endpoint
from .run_down_service import RunDownStandIn

pytestmark = pytest.mark.usefixtures("clean_env")

# Upstream's memnet rewards timing (`_config` there): one client, witness_nodes 0.
FAST_CONFIG = RUN_CONFIG.split("[model.LLM]")[1].join(
    [
        """
[config]
warmup_time = 10
cooldown_time = 88
epoch_time = 30
max_round_train_time = 15
round_witness_time = 10
min_clients = 1
init_min_clients = 1
verification_percent = 0
witness_nodes = 0
global_batch_size_start = 1
global_batch_size_end = 1
global_batch_size_warmup_tokens = 0
total_steps = 100
waiting_for_members_extra_time = 10

[model.LLM]""",
        "",
    ]
)

# Upstream's documents (`json_dump_run.rs`, `json_dump_user.rs`), key for key.
RUN_KEYS = {
    "coordinator_instance": {"address", "join_authority", "main_authority"},
    "coordinator_account": {
        "address",
        "run_id",
        "setup",
        "status",
        "epoch",
        "clients",
        "accounting",
        "nonce",
    },
    "treasurer_run": {
        "address",
        "index",
        "main_authority",
        "join_authority",
        "total_claimed_earned_points",
        "total_claimable_earned_points",
        "total_unclaimed_earned_points",
        "collateral_mint",
        "funded_collateral_amount",
        "total_missing_collateral_amount",
        "total_surplus_collateral_amount",
        "burn_collateral_amount_per_epoch",
        "estimated_funded_epochs_count",
    },
}
TREASURER_PARTICIPANT_KEYS = {
    "collateral_mint",
    "collateral_amount",
    "claimed_earned_points",
    "claimed_collateral_amount",
}


def _assert_sorted_keys(text: str) -> Any:
    """Parse the command's JSON and check that every object lists its keys sorted (upstream's
    serde_json maps are BTreeMaps) and that it is printed with two-space indents."""

    def check(value: Any) -> None:
        if isinstance(value, dict):
            assert list(value) == sorted(value), list(value)
            for item in value.values():
                check(item)
        elif isinstance(value, list):
            for item in value:
                check(item)

    document = json.loads(text)
    check(document)
    assert text == json.dumps(document, indent=2) + "\n"
    return document


def _state(endpoint: Endpoint, run_id: str) -> tuple[Pubkey, Pubkey, CoordinatorInstanceState]:
    instance_address = pda.find_coordinator_instance(run_id)
    instance = decode_anchor_account(
        bytes(endpoint.account(instance_address).data), CoordinatorInstance
    )
    account = Pubkey.from_bytes(instance.coordinator_account)
    state = coordinator_account_from_bytes(bytes(endpoint.account(account).data)).state
    return instance_address, account, state


def _token_amount(endpoint: Endpoint, address: Pubkey) -> int:
    return TokenAccount.from_bytes(bytes(endpoint.account(address).data)).amount


def _run_one_epoch(endpoint: Endpoint, run_id: str, client: Keypair, ticker: Keypair) -> None:
    """`client` joins the run and takes part in every round of one epoch (it is the only
    witness), as upstream's memnet rewards scenario drives it; the clock is the ledger's."""
    instance_address, account, _ = _state(endpoint, run_id)
    instance = decode_anchor_account(
        bytes(endpoint.account(instance_address).data), CoordinatorInstance
    )
    authorization = pda.find_join_authorization(instance.join_authority)
    identity = NodeIdentity(bytes(client.pubkey()), bytes(32))
    endpoint.process(
        [coordinator_ix.coordinator_join_run(instance_address, account, authorization, identity)],
        client,
    )

    def tick() -> None:
        endpoint.process(
            [coordinator_ix.coordinator_tick(instance_address, account, ticker.pubkey())], ticker
        )

    endpoint.forward_clock(10)
    tick()
    endpoint.forward_clock(10)
    tick()
    for _ in range(4):
        coordinator = _state(endpoint, run_id)[2].coordinator
        proof = CommitteeSelection.from_coordinator(coordinator, 0).get_witness(0)
        endpoint.process(
            [
                coordinator_ix.coordinator_witness(
                    instance_address, account, client.pubkey(), Witness(proof), WitnessMetadata()
                )
            ],
            client,
        )
        endpoint.forward_clock(10)
        tick()
    endpoint.forward_clock(88)
    tick()
    assert _state(endpoint, run_id)[2].coordinator.progress.epoch == 1


def test_treasurer_rewards_and_json_dumps(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    owner_wallet, user_wallet = tmp_path / "owner.json", tmp_path / "user.json"
    owner = funded_wallet(net, owner_wallet)
    user = funded_wallet(net, user_wallet)
    endpoint = Endpoint(net, ManualClock())
    mint = endpoint.new_mint(owner, owner.pubkey(), 6)
    owner_collateral = get_associated_token_address(owner.pubkey(), mint)
    endpoint.process(
        [
            create_associated_token_account(owner.pubkey(), owner.pubkey(), mint),
            mint_to(MintToParams(TOKEN_PROGRAM_ID, mint, owner_collateral, owner.pubkey(), 10**8)),
        ],
        owner,
    )
    config = tmp_path / "config.toml"
    config.write_text(FAST_CONFIG)

    ok(capsys, net, "join-authorization-create", "--authorizer", EVERYONE, wallet=owner_wallet)
    run = ["-r", "paid"]
    ok(
        capsys,
        net,
        "create-run",
        *run,
        "-c",
        "test",
        "--treasurer-collateral-mint",
        str(mint),
        wallet=owner_wallet,
    )
    index = pda.compute_deterministic_treasurer_index("paid")
    treasurer_address = pda.find_run(index)
    vault = get_associated_token_address(treasurer_address, mint)

    # Top up: the wallet's collateral moves into the run's vault.
    out = ok(
        capsys,
        net,
        "treasurer-top-up-rewards",
        *run,
        "--collateral-amount",
        "1",
        wallet=owner_wallet,
    )
    lines = out.splitlines()
    assert lines[:5] == [
        f"Found treasurer at index: 0x{index:08x}",
        f"Treasurer collateral mint: {mint}",
        "Treasurer collateral amount: 0",
        f"User: {owner.pubkey()}",
        "User collateral amount: 100",
    ]
    assert lines[5].startswith("Transfered 1 collateral to treasurer in transaction: ")
    assert len(lines) == 6
    assert _token_amount(endpoint, vault) == 1_000_000
    assert _token_amount(endpoint, owner_collateral) == 99_000_000
    code, _, err = run_cli(
        capsys,
        net,
        "treasurer-top-up-rewards",
        *run,
        "--collateral-amount",
        "1000",
        wallet=owner_wallet,
    )
    assert code == 1
    assert "holds 99000000 base units" in err
    assert "cannot top up 1000000000" in err
    code, _, err = run_cli(
        capsys,
        net,
        "treasurer-top-up-rewards",
        *run,
        "--collateral-amount",
        "1",
        wallet=user_wallet,
    )
    assert code == 1
    assert f"wallet {user.pubkey()} has no token account" in err
    with pytest.raises(SystemExit) as usage:
        run_cli(capsys, net, "treasurer-top-up-rewards", *run, "--collateral-amount", "-1")
    assert usage.value.code == 2
    assert "expected a finite amount >= 0, found '-1'" in capsys.readouterr().err
    assert _token_amount(endpoint, vault) == 1_000_000

    ok(
        capsys,
        net,
        "set-future-epoch-rates",
        *run,
        "--earning-rate-total-shared",
        "1.5",
        wallet=owner_wallet,
    )
    ok(capsys, net, "update-config", *run, "--config-path", str(config), wallet=owner_wallet)
    ok(capsys, net, "set-paused", *run, "--resume", wallet=owner_wallet)

    # A first claim creates the user's token account and participant account; nothing earned.
    out = ok(capsys, net, "treasurer-claim-rewards", *run, wallet=user_wallet)
    assert "Created associated token account for user during transaction: " in out
    assert "Created the participant claim during transaction: " in out
    assert "Total earned points: 0\n" in out
    assert "Claim collateral amount: 0\n" in out
    assert "Claimed 0 collateral in transaction: " in out
    participant_address = pda.find_participant(treasurer_address, user.pubkey())
    user_collateral = get_associated_token_address(user.pubkey(), mint)
    assert _token_amount(endpoint, user_collateral) == 0

    _run_one_epoch(endpoint, "paid", user, owner)
    state = _state(endpoint, "paid")[2]
    (client,) = state.clients_state.clients
    assert client.earned == 1_500_000  # the epoch's 1.5 tokens, for the only client

    # json-dump-user before the claim, against the account read back.
    out = ok(capsys, net, "json-dump-user", *run, "--address", str(user.pubkey()))
    dumped = _assert_sorted_keys(out)
    epoch = state.coordinator.epoch_state
    alive = next((c for c in epoch.clients if c.id.signer == bytes(user.pubkey())), None)
    exited = next((c for c in epoch.exited_clients if c.id.signer == bytes(user.pubkey())), None)

    def epoch_entry(found: Any) -> Any:
        return (
            None
            if found is None
            else {"exited_height": found.exited_height, "state": str(found.state)}
        )

    assert dumped == {
        "address": str(user.pubkey()),
        "lamports": endpoint.balance(user.pubkey()),
        "coordinator_account": {
            "client": {"active": client.active, "earned": 1_500_000, "slashed": client.slashed},
            "epoch_alive": epoch_entry(alive),
            "epoch_exited": epoch_entry(exited),
        },
        "treasurer_participant": {
            "collateral_mint": str(mint),
            "collateral_amount": 0.0,
            "claimed_earned_points": 0,
            "claimed_collateral_amount": 0.0,
        },
    }
    # upstream's --wallet and --user aliases of --address
    assert ok(capsys, net, "json-dump-user", *run, "--user", str(user.pubkey())) == out
    assert ok(capsys, net, "json-dump-user", *run, "--wallet", str(user.pubkey())) == out

    # The claim takes what the vault holds (1 of the 1.5 earned).
    out = ok(capsys, net, "treasurer-claim-rewards", *run, wallet=user_wallet)
    lines = out.splitlines()
    assert lines[:4] == [
        f"Found treasurer at index: 0x{index:08x}",
        f"Treasurer collateral mint: {mint}",
        "Treasurer collateral amount: 1",
        f"User: {user.pubkey()}",
    ]
    assert lines[4:10] == [
        "User collateral amount: 0",
        "Total earned points: 1500000",
        "Already claimed earned points: 0",
        "Claimable earned points: 1500000",
        "Claimable collateral amount: 1.5",
        "Claim collateral amount: 1",
    ]
    assert lines[10].startswith("Claimed 1 collateral in transaction: ")
    assert len(lines) == 11
    assert _token_amount(endpoint, user_collateral) == 1_000_000
    assert _token_amount(endpoint, vault) == 0
    participant = decode_anchor_account(
        bytes(endpoint.account(participant_address).data), Participant
    )
    assert (participant.claimed_earned_points, participant.claimed_collateral_amount) == (
        1_000_000,
        1_000_000,
    )

    # Topped up again, the rest can be claimed; a third claim finds nothing left.
    ok(
        capsys,
        net,
        "treasurer-top-up-rewards",
        *run,
        "--collateral-amount",
        "2",
        wallet=owner_wallet,
    )
    out = ok(capsys, net, "treasurer-claim-rewards", *run, wallet=user_wallet)
    assert "Already claimed earned points: 1000000\n" in out
    assert "Claim collateral amount: 0.5\n" in out
    assert "Claimed 0.5 collateral" in out
    assert "Created" not in out  # its accounts exist now
    out = ok(capsys, net, "treasurer-claim-rewards", *run, wallet=user_wallet)
    assert "Claimable earned points: 0\n" in out
    assert "Claimed 0 collateral" in out
    assert _token_amount(endpoint, user_collateral) == 1_500_000
    assert _token_amount(endpoint, vault) == 1_500_000
    treasurer = decode_anchor_account(bytes(endpoint.account(treasurer_address).data), TreasurerRun)
    assert treasurer.total_claimed_earned_points == 1_500_000

    # json-dump-run, the same document as `show --json`, against the accounts read back.
    out = ok(capsys, net, "json-dump-run", *run)
    assert ok(capsys, net, "show", *run, "--json") == out
    dumped = _assert_sorted_keys(out)
    assert set(dumped) == set(RUN_KEYS)
    for key, keys in RUN_KEYS.items():
        assert set(dumped[key]) == keys, key
    instance_address, account_address, state = _state(endpoint, "paid")
    rates = state.clients_state.current_epoch_rates
    assert rates.earning_rate_total_shared == 1_500_000
    assert dumped["treasurer_run"] == {
        "address": str(treasurer_address),
        "index": index,
        "main_authority": str(owner.pubkey()),
        "join_authority": str(owner.pubkey()),
        "total_claimed_earned_points": 1_500_000,
        "total_claimable_earned_points": 1_500_000,
        "total_unclaimed_earned_points": 0,
        "collateral_mint": str(mint),
        "funded_collateral_amount": 1.5,
        "total_missing_collateral_amount": 0.0,
        "total_surplus_collateral_amount": 1.5,
        "burn_collateral_amount_per_epoch": 1.5,
        "estimated_funded_epochs_count": 1.0,
    }
    account = dumped["coordinator_account"]
    assert account["address"] == str(account_address)
    assert dumped["coordinator_instance"]["address"] == str(instance_address)
    assert account["clients"] == {
        str(user.pubkey()): {"active": client.active, "earned": 1_500_000, "slashed": 0}
    }
    assert account["accounting"] == {
        "max_active": client.active,
        "sum_earned": 1_500_000,
        "sum_slashed": 0,
    }
    assert account["status"] == {
        "next_active": state.clients_state.next_active,
        "state": str(state.coordinator.run_state),
        "epoch": 1,
        "step": state.coordinator.progress.step,
    }
    assert account["nonce"] > 0
    assert account["run_id"] == "paid"
    assert set(account["setup"]) == {"client_version", "config", "metadata", "model"}
    assert account["setup"]["config"]["cooldown_time"] == 88
    # serde_json's shapes: None is null (upstream writes every field), not left out. (The
    # Hub checkpoint became P2P when the epoch ended: the clients hold the model now.)
    assert account["setup"]["model"]["LLM"]["checkpoint"] == {
        "P2P": {"repo_id": "emozilla/llama2-1.1b-gqa-init", "revision": None}
    }
    assert account["setup"]["model"]["LLM"]["optimizer"]["Distro"]["weight_decay"] is None

    # Someone who never took part: no client, no participant account, no collateral.
    stranger = Keypair().pubkey()
    dumped = _assert_sorted_keys(
        ok(capsys, net, "json-dump-user", *run, "--address", str(stranger))
    )
    assert dumped == {
        "address": str(stranger),
        "lamports": 0,
        "coordinator_account": {"client": None, "epoch_alive": None, "epoch_exited": None},
        "treasurer_participant": {
            "collateral_mint": str(mint),
            "collateral_amount": 0.0,
            "claimed_earned_points": None,
            "claimed_collateral_amount": None,
        },
    }
    assert set(dumped["treasurer_participant"]) == TREASURER_PARTICIPANT_KEYS


def test_json_dumps_without_treasurer(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wallet = tmp_path / "owner.json"
    owner = funded_wallet(net, wallet)
    ok(capsys, net, "create-run", "-r", "plain", "-c", "test", wallet=wallet)
    dumped = _assert_sorted_keys(ok(capsys, net, "json-dump-run", "-r", "plain"))
    assert dumped["treasurer_run"] is None
    assert dumped["coordinator_instance"]["main_authority"] == str(owner.pubkey())
    assert dumped["coordinator_account"]["accounting"] == {
        "max_active": None,
        "sum_earned": 0,
        "sum_slashed": 0,
    }
    assert dumped["coordinator_account"]["status"]["state"] == "Uninitialized"
    dumped = _assert_sorted_keys(
        ok(capsys, net, "json-dump-user", "-r", "plain", "--address", str(owner.pubkey()))
    )
    assert dumped["treasurer_participant"] is None
    assert dumped["lamports"] == net.ledger.get_balance(owner.pubkey())
    code, _, err = run_cli(capsys, net, "treasurer-claim-rewards", "-r", "plain", wallet=wallet)
    assert code == 1
    assert "Failed to resolve treasurer: run 'plain' has no treasurer run" in err
    with pytest.raises(SystemExit) as usage:
        run_cli(capsys, net, "json-dump-user", "-r", "plain")
    assert usage.value.code == 2
    assert "the following arguments are required: --address" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# list-runs


def test_list_runs(
    net: LocalnetThread,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    paths = {name: tmp_path / f"{name}.json" for name in ("owner", "other", "third", "user", "g")}
    keys = {name: funded_wallet(net, path) for name, path in paths.items()}
    endpoint = Endpoint(net, ManualClock())
    config = tmp_path / "config.toml"
    config.write_text(FAST_CONFIG)
    env_file = tmp_path / "run-manager.env"
    env_file.write_text(
        f'# list-runs reads RPC and the wallet from here\nRPC="{net.rpc_url}"\n'
        f"WALLET_PRIVATE_KEY_PATH = {paths['user']}\n"
    )

    def list_runs(*args: str) -> str:
        code = main(["list-runs", "--env-file", str(env_file), *args])
        out = capsys.readouterr()
        assert code == 0, out.err
        return out.out

    assert list_runs() == f"No runs found on coordinator program {COORDINATOR_PROGRAM_ID}\n"

    def create(owner: str, run_id: str, *, resume: bool = True, pause: bool = False) -> None:
        wallet = paths[owner]
        ok(capsys, net, "create-run", "-r", run_id, "-c", "test", wallet=wallet)
        ok(capsys, net, "update-config", "-r", run_id, "--config-path", str(config), wallet=wallet)
        if resume:
            ok(capsys, net, "set-paused", "-r", run_id, "--resume", wallet=wallet)
        if pause:
            ok(capsys, net, "set-paused", "-r", run_id, wallet=wallet)

    # owner: permissionless runs, one waiting, one training, one paused, one never resumed.
    ok(capsys, net, "join-authorization-create", "--authorizer", EVERYONE, wallet=paths["owner"])
    create("owner", "open")
    create("owner", "busy")
    create("owner", "stopped", pause=True)
    create("owner", "idle", resume=False)
    trainer = Keypair()
    endpoint.airdrop(trainer.pubkey(), 10**9)
    instance_address, account, _ = _state(endpoint, "busy")
    endpoint.process(
        [
            coordinator_ix.coordinator_join_run(
                instance_address,
                account,
                pda.find_join_authorization(keys["owner"].pubkey()),
                NodeIdentity(bytes(trainer.pubkey()), bytes(32)),
            )
        ],
        trainer,
    )
    endpoint.forward_clock(10)
    endpoint.process(
        [coordinator_ix.coordinator_tick(instance_address, account, trainer.pubkey())], trainer
    )
    assert _state(endpoint, "busy")[2].coordinator.run_state is RunState.Warmup
    # can-join (upstream's rule): a key already in the epoch under way cannot join again.
    code, out, err = run_cli(
        capsys, net, "can-join", "-r", "busy", "--wallet", str(trainer.pubkey())
    )
    assert code == 1
    assert out.splitlines() == [
        f"authorization valid for run id busy using pubkey {trainer.pubkey()}",
        "Coordinator: run_state: Warmup",
        "Coordinator: is_paused: false",
    ]
    assert f"A client with our pubkey {trainer.pubkey()} is in the current epoch" in err
    # other: authorizes the user itself; third: authorizes g, whose delegate the user is.
    endpoint.authorize(keys["other"], keys["other"], keys["user"].pubkey())
    create("other", "mine")
    endpoint.authorize(keys["third"], keys["third"], keys["g"].pubkey())
    create("third", "delegated")
    ok(
        capsys,
        net,
        "join-authorization-delegate",
        "--join-authority",
        str(keys["third"].pubkey()),
        "--delegates-added",
        str(keys["user"].pubkey()),
        wallet=paths["g"],
    )

    out = list_runs()
    # upstream's `RunInfo::format_table`: the ledger's clock is far behind the wall clock, so
    # the training run's epoch has overrun.
    assert out.splitlines() == [
        "Found 3 joinable run(s):",
        "  run-id   state                 clients       epoch time   time left",
        "  mine     Waiting for members   0/1 waiting   30s          -",
        "  open     Waiting for members   0/1 waiting   30s          -",
        "  busy     Warmup                1 training    30s          overrun",
    ]

    # With the delegate authorizer (AUTHORIZER, here from the env file) the delegated run too.
    with env_file.open("a") as f:
        f.write(f"AUTHORIZER={keys['g'].pubkey()}\n")
    out = list_runs()
    assert out.splitlines()[0] == "Found 4 joinable run(s):"
    assert [line.split()[0] for line in out.splitlines()[2:]] == [
        "delegated",
        "mine",
        "open",
        "busy",
    ]
    # --authorizer keeps the runs of one join authority.
    out = list_runs("--authorizer", str(keys["owner"].pubkey()))
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["open", "busy"]
    assert list_runs("--authorizer", str(Keypair().pubkey())) == "No available runs to join\n"

    # Without an env file: the flag and the process environment, as the other commands.
    monkeypatch.setenv("RAW_WALLET_PRIVATE_KEY", json.dumps(list(bytes(keys["user"]))))
    code = main(["list-runs", "--rpc", net.rpc_url])
    out = capsys.readouterr()
    assert code == 0
    assert out.out.startswith("Found 3 joinable run(s):")
    monkeypatch.delenv("RAW_WALLET_PRIVATE_KEY")
    code = main(["list-runs", "--rpc", net.rpc_url])
    assert code == 1
    assert "No wallet private key!" in capsys.readouterr().err
    code = main(["list-runs", "--env-file", str(tmp_path / "missing.env")])
    assert code == 1
    assert "Failed to read env file" in capsys.readouterr().err


def test_runs_table_columns() -> None:
    def run(state: RunState, clients: int, start: int) -> RunInfo:
        return RunInfo(
            "r", Pubkey.default(), None, Pubkey.default(), state, clients, 2, 3725, start
        )  # type: ignore[arg-type]

    assert [format_duration_secs(s) for s in (0, 59, 60, 3600, 3725, 7201)] == [
        "0s",
        "59s",
        "1m",
        "1h",
        "1h 2m 5s",
        "2h 1s",
    ]
    now = 1_000_000
    assert time_remaining_display(run(RunState.RoundTrain, 2, now - 3600), now) == "2m 5s"
    assert time_remaining_display(run(RunState.RoundTrain, 2, now - 3725), now) == "overrun"
    assert time_remaining_display(run(RunState.Cooldown, 2, 0), now) == "-"
    assert time_remaining_display(run(RunState.Paused, 2, now), now) == "-"
    assert clients_display(run(RunState.RoundWitness, 1, now)) == "1/2 waiting"
    assert clients_display(run(RunState.RoundWitness, 3, now)) == "3 training"
    assert clients_display(run(RunState.Finished, 3, now)) == "-"


# ---------------------------------------------------------------------------------------------
# download-results / upload-data


@pytest.fixture
def run_down(tmp_path: Path) -> Any:
    owner = Keypair()
    service = RunDownStandIn(owner.pubkey()).start()
    try:
        yield service, owner
    finally:
        service.stop()


def test_upload_and_download(
    run_down: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service, owner = run_down
    monkeypatch.setenv("RAW_WALLET_PRIVATE_KEY", json.dumps(list(bytes(owner))))
    url = ["--run-down-service-url", service.base_url]
    data = tmp_path / "data"
    (data / "shards").mkdir(parents=True)
    small = b"hello run-down\n"
    large = os.urandom(3 * 1024 * 1024 + 17)  # several upload chunks
    (data / "README.txt").write_bytes(small)
    (data / "shards" / "00000.bin").write_bytes(large)

    def command(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, err = command("upload-data", "-r", "test", "-p", str(data), *url)
    assert code == 0, err
    assert out == (
        "Found 2 file(s) to upload\n"
        "\n[1/2] Uploading: README.txt\n"
        f"  Uploading {len(small)} bytes...\n"
        "  ✓ Upload successful\n"
        "\n[2/2] Uploading: shards/00000.bin\n"
        f"  Uploading {len(large)} bytes...\n"
        "  ✓ Upload successful\n"
        "\n✓ Successfully uploaded 2 file(s)\n"
    )
    assert service.files["test"] == {"README.txt": small, "shards/00000.bin": large}
    assert [c.kind for c in service.calls] == ["upload", "upload"]
    assert all(c.signature_valid and c.body["expiresInSeconds"] == 3600 for c in service.calls)
    assert [c.body["filename"] for c in service.calls] == ["README.txt", "shards/00000.bin"]
    nonces = [c.body["nonce"] for c in service.calls]
    assert len(set(nonces)) == 2
    assert all(isinstance(n, str) and int(n) >= 0 for n in nonces)

    # A single file is named by its file name; --expires-in-seconds reaches the service.
    code, out, err = command(
        "upload-data",
        "-r",
        "test",
        "--path",
        str(data / "shards" / "00000.bin"),
        "--expires-in-seconds",
        "60",
        *url,
    )
    assert code == 0, err
    assert "[1/1] Uploading: 00000.bin" in out
    assert service.calls[-1].body == {
        "filename": "00000.bin",
        "expiresInSeconds": 60,
        "nonce": service.calls[-1].body["nonce"],
    }

    out_dir = tmp_path / "results"
    calls = len(service.calls)
    code, out, err = command("download-results", "-r", "test", "-o", str(out_dir), *url)
    assert code == 0, err
    paths = ["00000.bin", "README.txt", "shards/00000.bin"]
    assert out.splitlines() == [
        "Found 3 files to download",
        *[
            line
            for i, p in enumerate(paths, start=1)
            for line in (f"Downloading file {i}/3: {p}", f'  Saved to: "{out_dir / p}"')
        ],
        f'Successfully downloaded 3 files to "{out_dir}"',
    ]
    assert (out_dir / "README.txt").read_bytes() == small
    assert (out_dir / "shards" / "00000.bin").read_bytes() == large
    assert (out_dir / "00000.bin").read_bytes() == large
    assert sorted(p.name for p in out_dir.rglob("*")) == [
        "00000.bin",
        "00000.bin",
        "README.txt",
        "shards",
    ]
    assert service.calls[calls].kind == "download"
    assert service.calls[calls].signature_valid

    # A non-empty output directory: asked first; "n" (or no answer) cancels before any request.
    (out_dir / "README.txt").write_bytes(b"local edit")
    calls = len(service.calls)
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    code, out, _ = command("download-results", "-r", "test", "-o", str(out_dir), *url)
    assert code == 0
    assert out.endswith("Continue? [y/N]: Download cancelled.\n")
    assert f'Warning: Output directory "{out_dir}" already exists and contains files.' in out
    assert len(service.calls) == calls
    assert (out_dir / "README.txt").read_bytes() == b"local edit"
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    code, out, _ = command("download-results", "-r", "test", "-o", str(out_dir), *url)
    assert code == 0
    assert "Successfully downloaded 3 files" in out
    assert (out_dir / "README.txt").read_bytes() == small
    (out_dir / "README.txt").write_bytes(b"local edit")
    code, out, _ = command(
        "download-results", "-r", "test", "-o", str(out_dir), "--overwrite", *url
    )
    assert code == 0
    assert "Continue?" not in out
    assert (out_dir / "README.txt").read_bytes() == small

    # The service cannot make the command write outside the output directory.
    escape = tmp_path / "escape.txt"
    service.extra_download_entries.append(
        {"path": "../escape.txt", "url": service.signed_url("GET", "test", "README.txt")}
    )
    code, out, err = command("download-results", "-r", "test", "-o", str(tmp_path / "fresh"), *url)
    assert code == 1
    assert "refusing to write '../escape.txt' outside the output directory" in err
    assert not escape.exists()

    # Another wallet's signature is refused by the service: one clear line.
    monkeypatch.setenv("RAW_WALLET_PRIVATE_KEY", json.dumps(list(bytes(Keypair()))))
    code, _, err = command("upload-data", "-r", "test", "-p", str(data), *url)
    assert code == 1
    assert "API request failed with status 401" in err
    assert not service.calls[-1].signature_valid
    code, _, err = command("upload-data", "-r", "test", "-p", str(tmp_path / "nothing"), *url)
    assert code == 1
    assert "Path does not exist or is not a file or directory" in err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # nothing listens there
    code, _, err = command(
        "download-results",
        "-r",
        "test",
        "-o",
        str(tmp_path / "x"),
        "--run-down-service-url",
        closed,
    )
    assert code == 1
    assert "Failed to send request to run-down service" in err
