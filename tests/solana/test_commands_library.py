"""The `psyche-solana-client` commands as library functions (`psyche.solana.commands`), called
from Python with options built in code, no parser and no environment, against the local
endpoint: they act on the cluster, print what the command prints, and fail in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from psyche.coordinator import RunState
from psyche.core.cli import UserError
from psyche.solana.commands.args import ClusterOptions
from psyche.solana.commands.authorization import (
    EVERYONE,
    CanJoinOptions,
    JoinAuthorizationCreateOptions,
    run_can_join,
    run_join_authorization_create,
)
from psyche.solana.commands.predownload import fetch_coordinator
from psyche.solana.commands.run import (
    CreateRunOptions,
    SetPausedOptions,
    TickOptions,
    UpdateConfigOptions,
    run_create_run,
    run_set_paused,
    run_tick,
    run_update_config,
)
from psyche.solana.commands.view import ShowOptions, run_show
from psyche.solana.localnet.server import LocalnetThread

from .cli_helpers import RUN_CONFIG, funded_wallet

pytestmark = pytest.mark.usefixtures("clean_env")


def test_a_run_created_configured_and_resumed_through_the_library(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = ClusterOptions(rpc=net.rpc_url, ws_rpc=net.ws_url)
    wallet = tmp_path / "owner.json"
    owner = funded_wallet(net, wallet)
    config = tmp_path / "config.toml"
    config.write_text(RUN_CONFIG)
    signed = {"cluster": cluster, "wallet_private_key_path": wallet}

    authorize = JoinAuthorizationCreateOptions(**signed, authorizer=EVERYONE)
    assert run_join_authorization_create(authorize) == 0
    assert "Authorization Active: true" in capsys.readouterr().out
    assert run_create_run(CreateRunOptions(**signed, run_id="lib", client_version="test")) == 0
    assert "Created run lib with transaction" in capsys.readouterr().out
    update = UpdateConfigOptions(**signed, run_id="lib", config_path=config, vocab_size=32768)
    assert run_update_config(update) == 0
    assert run_set_paused(SetPausedOptions(**signed, run_id="lib", resume=True)) == 0
    assert "Set pause state to false on run lib" in capsys.readouterr().out

    assert run_show(ShowOptions(cluster=cluster, run_id="lib", json=True)) == 0
    account = json.loads(capsys.readouterr().out)["coordinator_account"]
    assert account["status"]["state"] == "Waiting for members"
    assert account["setup"]["config"]["total_steps"] == 25000
    coordinator = fetch_coordinator(cluster, "lib")  # predownload's half: a read, no wallet
    assert coordinator.run_id == "lib"
    assert coordinator.run_state is RunState.WaitingForMembers

    assert run_tick(TickOptions(**signed, run_id="lib", count=1, ms_interval=0)) == 0
    assert capsys.readouterr().out.count("Ticked run lib with transaction") == 1
    may_join = CanJoinOptions(cluster=cluster, run_id="lib", address=str(owner.pubkey()))
    assert run_can_join(may_join) == 0
    assert f"✓ Can join run lib with pubkey {owner.pubkey()}" in capsys.readouterr().out


def test_a_library_command_fails_in_one_line(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = ClusterOptions(rpc=net.rpc_url, ws_rpc=net.ws_url)
    with pytest.raises(UserError, match="run 'absent' not found"):
        run_show(ShowOptions(cluster=cluster, run_id="absent"))
    unreachable = ClusterOptions(rpc="http://127.0.0.1:1", ws_rpc="ws://127.0.0.1:1")
    with pytest.raises(
        UserError, match=re.escape("cannot reach the Solana RPC at http://127.0.0.1:1")
    ):
        run_show(ShowOptions(cluster=unreachable, run_id="lib"))
    no_wallet = CreateRunOptions(cluster=cluster, run_id="lib", client_version="test")
    with pytest.raises(UserError, match="No wallet private key"):
        run_create_run(no_wallet)
    assert capsys.readouterr().out == ""
