"""Every `psyche-solana-client` command against the local endpoint, and its error messages."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from solders.keypair import Keypair

from psyche.cli.solana_client.main import main
from psyche.solana.keypair import write_keypair_file
from psyche.solana.localnet.ledger import ManualClock
from psyche.solana.localnet.server import LocalnetThread
from psyche.solana.state import RunMetadata

from .cli_helpers import EVERYONE, RUN_CONFIG
from .cli_helpers import funded_wallet as _wallet
from .cli_helpers import ok as _ok
from .cli_helpers import run_cli as _run

pytestmark = pytest.mark.usefixtures("clean_env")


def test_admin_lifecycle(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wallet = tmp_path / "owner.json"
    owner = _wallet(net, wallet)
    config = tmp_path / "config.toml"
    config.write_text(RUN_CONFIG)

    out = _ok(capsys, net, "join-authorization-create", "--authorizer", EVERYONE, wallet=wallet)
    assert "Created authorization" in out
    assert "Activated authorization" in out
    assert "Authorization Active: true" in out
    code, out, _ = _run(
        capsys, net, "join-authorization-create", "--authorizer", EVERYONE, wallet=wallet
    )
    assert code == 0
    assert "Created authorization" not in out

    out = _ok(capsys, net, "create-run", "-r", "test", "-c", "test", wallet=wallet)
    assert "Created run test with transaction" in out
    assert "Locked for storage: 0.830244480 SOL" in out

    out = _ok(
        capsys,
        net,
        "update-config",
        "-r",
        "test",
        "--config-path",
        str(config),
        "--num-parameters",
        "1100000000",
        "--vocab-size",
        "32768",
        wallet=wallet,
    )
    assert "Updated config of test" in out
    assert "===== Logs =====" in out

    code, out, err = _run(capsys, net, "update-config", "-r", "test", wallet=wallet)
    assert code == 1
    assert "would not update anything" in err

    out = _ok(capsys, net, "set-paused", "-r", "test", "--resume", wallet=wallet)
    assert "Set pause state to false on run test" in out

    out = _ok(capsys, net, "show", "-r", "test")
    assert "Waiting for members" in out
    assert "1.1B parameters, vocab 32768" in out
    assert "emozilla/llama2-1.1b-gqa-init" in out
    out = _ok(capsys, net, "show", "-r", "test", "--json")
    dump = json.loads(out)
    account = dump["coordinator_account"]
    assert account["status"]["state"] == "Waiting for members"
    assert account["setup"]["client_version"] == "test"
    assert account["setup"]["config"]["total_steps"] == 25000
    assert account["setup"]["metadata"] == {
        "name": "",
        "description": "",
        "num_parameters": 1100000000,
        "vocab_size": 32768,
    }
    assert dump["coordinator_instance"]["main_authority"] == str(owner.pubkey())

    net.ledger.advance_clock(5)
    out = _ok(
        capsys, net, "tick", "-r", "test", "--count", "2", "--ms-interval", "1", wallet=wallet
    )
    assert out.count("Ticked run test with transaction") == 2
    assert "Pre-tick run state: Waiting for members" in out

    # The wallet is not a client of the run: the program says so, clearly.
    code, out, err = _run(
        capsys, net, "checkpoint", "-r", "test", "--repo", "org/model", wallet=wallet
    )
    assert code == 1
    assert "SignerNotAClient" in err

    someone = str(Keypair().pubkey())
    code, out, err = _run(capsys, net, "can-join", "-r", "test", "--address", someone)
    assert code == 0
    assert out.splitlines() == [
        f"authorization valid for run id test using pubkey {someone}",
        "Coordinator: run_state: Waiting for members",
        "Coordinator: is_paused: false",
        f"✓ Can join run test with pubkey {someone}",
    ]

    # A running run cannot be closed; paused it can.
    code, out, err = _run(capsys, net, "close-run", "-r", "test", wallet=wallet)
    assert code == 1
    assert "CloseCoordinatorNotHalted" in err
    code, out, err = _run(capsys, net, "set-paused", "-r", "test", wallet=wallet)
    assert code == 0, err
    assert "Set pause state to true" in out, err
    _ok(
        capsys,
        net,
        "update-config",
        "-r",
        "test",
        "--name",
        "renamed",
        "--client-version",
        "v2",
        wallet=wallet,
    )
    code, out, _ = _run(capsys, net, "show", "-r", "test", "--json")
    setup = json.loads(out)["coordinator_account"]["setup"]
    assert setup["metadata"]["name"] == "renamed"
    assert setup["client_version"] == "v2"
    assert json.loads(out)["coordinator_account"]["status"]["state"] == "Paused"

    balance_before = net.ledger.get_balance(owner.pubkey())
    out = _ok(capsys, net, "close-run", "-r", "test", wallet=wallet)
    assert "Recovered 0.83" in out
    assert net.ledger.get_balance(owner.pubkey()) > balance_before
    code, out, err = _run(capsys, net, "show", "-r", "test")
    assert code == 1
    assert "run 'test' not found" in err


def test_join_authorization_delegates(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    authority_wallet, grantee_wallet = tmp_path / "authority.json", tmp_path / "grantee.json"
    authority = _wallet(net, authority_wallet)
    grantee = _wallet(net, grantee_wallet)
    delegates = [str(Keypair().pubkey()) for _ in range(2)]

    _ok(
        capsys,
        net,
        "join-authorization-create",
        "--authorizer",
        str(grantee.pubkey()),
        wallet=authority_wallet,
    )
    out = _ok(
        capsys,
        net,
        "join-authorization-set-delegates",
        "--join-authority",
        str(authority.pubkey()),
        "--delegates-added",
        *delegates,
        wallet=grantee_wallet,
    )
    assert "Delegates added count: 2" in out
    out = _ok(
        capsys,
        net,
        "join-authorization-read",
        "--join-authority",
        str(authority.pubkey()),
        "--authorizer",
        str(grantee.pubkey()),
    )
    assert "Authorization Delegate Count: 2" in out
    assert delegates[1] in out

    _ok(capsys, net, "create-run", "-r", "permissioned", "-c", "test", wallet=authority_wallet)
    for who, expected in (
        (delegates[0], 0),
        (str(grantee.pubkey()), 0),
        (str(Keypair().pubkey()), 1),
    ):
        code, out, err = _run(
            capsys,
            net,
            "can-join",
            "-r",
            "permissioned",
            "--authorizer",
            str(grantee.pubkey()),
            "--address",
            who,
        )
        assert code == expected, (who, out, err)
        if expected:
            assert f"Authorization invalid for run id permissioned using pubkey {who}" in err
        else:
            assert "Coordinator: is_paused: true" in out  # never resumed: Uninitialized
    # Without --authorizer the permissionless authorization is looked for: there is none.
    code, _, err = _run(capsys, net, "can-join", "-r", "permissioned", "--user", delegates[0])
    assert code == 1
    assert "Authorization does not exist for authorizer: None" in err

    _ok(
        capsys,
        net,
        "join-authorization-delegate",
        "--join-authority",
        str(authority.pubkey()),
        "--delegates-clear",
        wallet=grantee_wallet,
    )
    out = _ok(
        capsys,
        net,
        "join-authorization-delete",
        "--authorizer",
        str(grantee.pubkey()),
        wallet=authority_wallet,
    )
    assert "Deactivated authorization" in out
    assert "Authorization Active: false" in out
    code, out, err = _run(
        capsys,
        net,
        "join-authorization-set-delegates",
        "--join-authority",
        str(Keypair().pubkey()),
        wallet=grantee_wallet,
    )
    assert code == 1
    assert "no join authorization" in err


def test_clear_errors(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    owner_wallet, other_wallet = tmp_path / "owner.json", tmp_path / "other.json"
    _wallet(net, owner_wallet)
    other = _wallet(net, other_wallet)
    assert (
        _run(capsys, net, "create-run", "-r", "errors", "-c", "test", wallet=owner_wallet)[0] == 0
    )

    code, _, err = _run(capsys, net, "set-paused", "-r", "missing", "--resume", wallet=owner_wallet)
    assert code == 1
    assert "run 'missing' not found" in err

    code, _, err = _run(capsys, net, "set-paused", "-r", "errors", "--resume", wallet=other_wallet)
    assert code == 1
    assert f"wallet {other.pubkey()} is not the main authority" in err

    bad = tmp_path / "bad.toml"
    bad.write_text(RUN_CONFIG.replace("total_steps = 25000\nwaiting", "total_steps = -1\nwaiting"))
    code, _, err = _run(
        capsys, net, "update-config", "-r", "errors", "--config-path", str(bad), wallet=owner_wallet
    )
    assert code == 1
    assert "invalid config" in err
    assert "total_steps" in err
    bad.write_text(RUN_CONFIG.replace("epoch_time = 60", "epoch_time = 10"))
    code, _, err = _run(
        capsys, net, "update-config", "-r", "errors", "--config-path", str(bad), wallet=owner_wallet
    )
    assert code == 1
    assert "warmup_time" in err
    # A run too small for a verifier (issue 27): refused with the field named.
    bad.write_text(RUN_CONFIG.replace("verification_percent = 0", "verification_percent = 50"))
    code, _, err = _run(
        capsys, net, "update-config", "-r", "errors", "--config-path", str(bad), wallet=owner_wallet
    )
    assert code == 1
    assert "config.verification_percent" in err
    assert "elects no verifier" in err
    code, _, err = _run(
        capsys,
        net,
        "update-config",
        "-r",
        "errors",
        "--config-path",
        str(tmp_path / "nope.toml"),
        wallet=owner_wallet,
    )
    assert code == 1
    assert "nope.toml" in err

    # Resuming a run without a config fails on chain (the program's own check).
    code, _, err = _run(capsys, net, "set-paused", "-r", "errors", "--resume", wallet=owner_wallet)
    assert code == 1
    assert "ConfigSanityCheckFailed" in err

    code, _, err = _run(
        capsys, net, "create-run", "-r", "x" * 33, "-c", "test", wallet=owner_wallet
    )
    assert code == 1
    assert "32 bytes or less" in err
    code, _, err = _run(
        capsys, net, "create-run", "-r", "errors", "-c", "test", wallet=owner_wallet
    )
    assert code == 1
    assert "already exists" in err
    code, _, err = _run(capsys, net, "create-run", "-r", "nowallet", "-c", "test")
    assert code == 1
    assert "No wallet private key!" in err
    long_name = "n" * 65
    code, _, err = _run(
        capsys, net, "update-config", "-r", "errors", "--name", long_name, wallet=owner_wallet
    )
    assert code == 1
    assert "FixedString<64>" in err
    assert RunMetadata.__name__  # the metadata type checks the same capacity

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    code = main(["show", "-r", "errors", "--rpc", f"http://127.0.0.1:{closed_port}"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"cannot reach the Solana RPC at http://127.0.0.1:{closed_port}" in err


def test_identity_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wallet = tmp_path / "id.json"
    keypair = Keypair()
    write_keypair_file(keypair, wallet)
    assert main(["show-identity", "-w", str(wallet), "--run-id", "test"]) == 0
    out = capsys.readouterr().out
    assert f"Wallet (signer) public key: {keypair.pubkey()}" in out
    derived = [line for line in out.splitlines() if line.startswith("P2P identity")]
    assert len(derived) == 1
    assert "derived from run 'test'" in derived[0]
    monkeypatch.setenv("RAW_WALLET_PRIVATE_KEY", json.dumps(list(bytes(keypair))))
    assert main(["show-identity", "--run-id", "test"]) == 0
    assert derived[0] in capsys.readouterr().out  # same wallet, same derived key

    key_path = tmp_path / "p2p.key"
    assert main(["create-static-p2p-identity", str(key_path)]) == 0
    created = capsys.readouterr().out
    assert key_path.stat().st_size == 32
    assert main(["show-static-p2p-identity", str(key_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == created.splitlines()[0]


def test_standalone_localnet_command(tmp_path: Path) -> None:
    wallet = tmp_path / "funded.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "psyche.cli.solana_client.main",
            "localnet",
            "--port",
            "0",
            "--fund",
            str(wallet),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = []
        assert process.stdout is not None
        while not any(line.startswith("websocket:") for line in lines):
            line = process.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        rpc = next(line.split()[1] for line in lines if line.startswith("JSON-RPC:"))
        funded = Keypair.from_bytes(bytes(json.loads(wallet.read_text())))
        response = httpx.post(
            rpc,
            json={
                "jsonrpc": "2.0",
                "id": 1,
                "method": "getBalance",
                "params": [str(funded.pubkey())],
            },
            timeout=10,
        )
        assert response.json()["result"]["value"] == 1000 * 10**9
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_treasurer_run_commands(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from .conftest import Endpoint

    wallet = tmp_path / "owner.json"
    owner = _wallet(net, wallet)
    endpoint = Endpoint(net, ManualClock())
    mint = endpoint.new_mint(owner, owner.pubkey(), 6)
    config = tmp_path / "config.toml"
    config.write_text(RUN_CONFIG)

    _ok(
        capsys,
        net,
        "create-run",
        "-r",
        "paid",
        "-c",
        "test",
        "--treasurer-collateral-mint",
        str(mint),
        wallet=wallet,
    )
    code, out, err = _run(
        capsys,
        net,
        "create-run",
        "-r",
        "paid2",
        "-c",
        "test",
        "--treasurer-index",
        "7",
        wallet=wallet,
    )
    assert code == 1
    assert "treasurer_collateral_mint is not" in err
    _ok(
        capsys,
        net,
        "set-future-epoch-rates",
        "-r",
        "paid",
        "--earning-rate-total-shared",
        "1.5",
        "--slashing-rate-per-client",
        "0.25",
        wallet=wallet,
    )
    _ok(capsys, net, "update-config", "-r", "paid", "--config-path", str(config), wallet=wallet)
    _ok(capsys, net, "set-paused", "-r", "paid", "--resume", wallet=wallet)
    out = _ok(capsys, net, "show", "-r", "paid", "--json")
    dump = json.loads(out)
    assert dump["coordinator_account"]["status"]["state"] == "Waiting for members"
    assert dump["coordinator_account"]["epoch"]["rates"]["future"] == {
        "earning": 1_500_000,
        "slashing": 250_000,
    }
    treasurer = dump["treasurer_run"]
    assert treasurer["collateral_mint"] == str(mint)
    assert treasurer["main_authority"] == str(owner.pubkey())
    # The run PDA, not the wallet, is the coordinator's main authority.
    assert dump["coordinator_instance"]["main_authority"] != str(owner.pubkey())
    code, out, err = _run(capsys, net, "show", "-r", "paid")
    assert code == 0
    assert "treasurer index" in out
