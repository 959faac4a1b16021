"""`config.verifiers_train` on the Solana coordinator (issue 27): the coordinator account is
upstream's bytes and has no room for it, so the run keeps it in its verification account
(`RunVerification.verifiers_train`, appended). The owner sets it with `update-config`
(`set_verifiers_train`, only while the run is halted), the program runs every instruction of
the run with it (the duties it records are those of a run whose verifiers train), every
following client sets it on the states it reads (a client already following reads the change
on the first state after the halt, not on a timer), and `json-dump-run` shows it. Four scripted
members on the local endpoint over JSON-RPC and websockets; in a treasurer run, the treasurer
program's own checks on `run_set_verifiers_train`."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio
from solders.account import Account
from solders.keypair import Keypair

from psyche.cli.solana_client.main import main as solana_client
from psyche.coordinator import RunState
from psyche.coordinator.data_selection import verification_duties_for_state
from psyche.coordinator.run_config import dumps_toml, run_config_to_obj
from psyche.core.batch_id import BatchId
from psyche.core.node_identity import NodeIdentity
from psyche.solana import admin, pda
from psyche.solana.backend import SolanaBackendError
from psyche.solana.follower import follow_run
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.localnet.ledger import ManualClock
from psyche.solana.localnet.server import LocalnetThread
from psyche.solana.state import (
    decode_anchor_account,
    encode_anchor_account,
)
from psyche.solana.verification import (
    RUN_VERIFICATION_SPACE,
    RunVerification,
    VerificationEntry,
)

from .cli_helpers import RUN_CONFIG, funded_wallet, ok, run_cli
from .conftest import Endpoint
from .scripted import RUN_ID, WAIT, Driver, make_backend, tiny_model
from .support import error_text, verified_run
from .verification_support import TreasurerRun, instruction_names, unsigned


def test_the_owner_turns_verifiers_train_on_and_the_program_and_clients_run_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            run = await verified_run(nursery)
            owner, account = run.owner, run.account
            address = pda.find_run_verification(account, owner.ids)

            async def stored() -> RunVerification:
                return decode_anchor_account(await owner.get_data(address), RunVerification)

            # The owner's config file, through the admin path `update-config` takes (the run
            # halted, as for every config change).
            on = dataclasses.replace(run.config, verifiers_train=True)
            path = tmp_path / "run.toml"
            path.write_text(dumps_toml(run_config_to_obj(on, tiny_model())))
            await admin.set_paused(owner, RUN_ID, True)
            await admin.update_config(owner, RUN_ID, config_path=path)
            assert (await stored()).verifiers_train is True
            # the coordinator account keeps upstream's bytes: its config reads it as off
            coordinator = (await owner.get_coordinator_account(account)).state.coordinator
            assert coordinator.config.verifiers_train is False
            # what `psyche-solana-client json-dump-run` shows (the command, in a thread)
            capsys.readouterr()
            argv = ["json-dump-run", "--rpc", run.cluster[0].rpc, "--ws-rpc", run.cluster[0].ws_rpc]
            code = await trio.to_thread.run_sync(solana_client, [*argv, "--run-id", RUN_ID])
            out = capsys.readouterr().out
            assert code == 0, out
            assert json.loads(out)["verification"]["verifiers_train"] is True
            await admin.set_paused(owner, RUN_ID, False)

            # Only the owner sets it, and only while the run is halted.
            set_on = coordinator_ix.coordinator_set_verifiers_train
            stranger = make_backend(run.ledger, run.cluster)
            with pytest.raises(SolanaBackendError):
                await stranger.send_and_retry(
                    "Set", [set_on(RUN_ID, account, stranger.get_payer(), False, owner.ids)]
                )
            with pytest.raises(SolanaBackendError) as running:
                await owner.send_and_retry(
                    "Set", [set_on(RUN_ID, account, owner.get_payer(), False, owner.ids)]
                )
            assert error_text("UpdateConfigNotHalted") in str(running.value)
            assert (await stored()).verifiers_train is True

            checked: list[int] = []

            async def check(driver: Driver) -> None:
                state = driver.state
                assert state is not None
                # every follower runs with it: the observer and each member
                assert state.config.verifiers_train is True
                for client in run.clients:
                    assert client.runner is not None
                    assert client.runner.latest.state.coordinator.config.verifiers_train
                # the program recorded the duties of a run whose verifiers train (every
                # client holds a batch, the verifier's own and the tie-breaker's unchecked),
                # not those of one whose verifiers train nothing
                duties = await run.duties(state.progress.step)
                expected = verification_duties_for_state(state)
                assert duties.verifiers == expected.verifiers
                assert duties.tie_breakers == expected.tie_breakers
                if not duties.verifiers:
                    return  # the epoch's last round, with no batch left to deal
                off = state.copy()
                off.config.verifiers_train = False
                assert duties.verifiers != verification_duties_for_state(off).verifiers
                committee = {d.verifier for d in duties.tie_breakers}
                committee |= {d.verifier for d in duties.verifiers}
                assert not {d.trainer for d in duties.verifiers} & committee
                checked.append(state.progress.step)

            async with run.followed(nursery) as driver:
                await driver.run_epoch(4, between_rounds=check)
                assert len(checked) >= 2, checked
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_follower_reads_the_change_before_the_first_state_after_the_halt(
    tmp_path: Path,
) -> None:
    """A client already following the run when the owner changes the option (paused, then
    resumed): the first state it hands out after the halt carries the new value, read from the
    verification account on that state, not on a timer (before, a 5 s poll: a warmup shorter
    than that could start a round with the old value). No poll runs here, so only the read
    the state itself triggers can bring it."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            run = await verified_run(nursery)
            owner = run.owner
            async with follow_run(owner, RUN_ID, run.account) as follower:
                assert follower.latest.state.coordinator.config.verifiers_train is False
                for value in (True, False, True):
                    changed = dataclasses.replace(run.config, verifiers_train=value)
                    path = tmp_path / f"{value}.toml"
                    path.write_text(dumps_toml(run_config_to_obj(changed, tiny_model())))
                    await admin.set_paused(owner, RUN_ID, True)
                    await admin.update_config(owner, RUN_ID, config_path=path)
                    await admin.set_paused(owner, RUN_ID, False)
                    with trio.fail_after(WAIT):
                        state = await follower.wait_for_new_state()
                        while not state.halted():  # up to the pause
                            state = await follower.wait_for_new_state()
                        while state.halted():  # the first state after it
                            state = await follower.wait_for_new_state()
                    assert state.run_state is RunState.WaitingForMembers
                    assert state.config.verifiers_train is value
                    assert follower.verifiers_train is value
                nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.usefixtures("clean_env")
def test_a_treasurer_run_sets_it_through_its_treasurer(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In a treasurer run the run PDA, not the wallet, is the coordinator's authority:
    `update-config` sets the option through the treasurer's `run_set_verifiers_train`, which
    checks the treasurer run's main authority as `run_update` does."""
    wallet = tmp_path / "owner.json"
    owner = funded_wallet(net, wallet)
    mint = Endpoint(net, ManualClock()).new_mint(owner, owner.pubkey(), 6)
    verifying = RUN_CONFIG.replace("verification_percent = 0", "verification_percent = 25")
    verifying = verifying.replace("min_clients = 1", "min_clients = 4")
    on, off = tmp_path / "on.toml", tmp_path / "off.toml"
    on.write_text(verifying.replace("[config]\n", "[config]\nverifiers_train = true\n", 1))
    off.write_text(verifying)
    ok(capsys, net, "create-run", "-r", "paid", "-c", "test",
       "--treasurer-collateral-mint", str(mint), wallet=wallet)  # fmt: skip
    for path, expected in ((on, True), (off, False), (on, True)):
        ok(capsys, net, "update-config", "-r", "paid", "--config-path", str(path), wallet=wallet)
        dump = json.loads(ok(capsys, net, "json-dump-run", "-r", "paid"))
        assert dump["verification"]["verifiers_train"] is expected
    # another wallet is not the treasurer run's main authority: refused, nothing changes
    stranger = tmp_path / "stranger.json"
    funded_wallet(net, stranger)
    code, _, err = run_cli(
        capsys, net, "update-config", "-r", "paid", "--config-path", str(off), wallet=stranger
    )
    assert code == 1, err
    dump = json.loads(ok(capsys, net, "json-dump-run", "-r", "paid"))
    assert dump["verification"]["verifiers_train"] is True


@pytest.mark.parametrize("treasurer", [False, True], ids=["own", "treasurer"])
@pytest.mark.usefixtures("clean_env")
def test_turning_verification_off_with_verifiers_train_on_changes_the_config_in_one_transaction(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str], treasurer: bool
) -> None:
    """A run whose verifiers train, given a config with `verification_percent = 0`: the option
    has no effect there, so nothing is sent for it (before, `set_verifiers_train(false)` went
    after the `update` that had set the percent to 0, the program refused it (`VerificationOff`),
    the command failed with the config half-changed, and every later `update-config` failed the
    same way). When the option does change, the verification account's creation and
    `set_verifiers_train` ride in the `update`'s own transaction, after it."""
    wallet = tmp_path / "owner.json"
    owner = funded_wallet(net, wallet)
    verifying = RUN_CONFIG.replace("verification_percent = 0", "verification_percent = 25")
    verifying = verifying.replace("min_clients = 1", "min_clients = 4")
    on, plain = tmp_path / "on.toml", tmp_path / "plain.toml"
    on.write_text(verifying.replace("[config]\n", "[config]\nverifiers_train = true\n", 1))
    plain.write_text(RUN_CONFIG)
    extra = []
    if treasurer:
        mint = Endpoint(net, ManualClock()).new_mint(owner, owner.pubkey(), 6)
        extra = ["--treasurer-collateral-mint", str(mint)]
    ok(capsys, net, "create-run", "-r", "own", "-c", "test", *extra, wallet=wallet)
    out = ok(capsys, net, "update-config", "-r", "own", "--config-path", str(on), wallet=wallet)
    signature = re.search(r"with transaction (\w+)", out)
    assert signature is not None, out
    update, init, set_on = (
        ("run_update", "init_verification", "run_set_verifiers_train")
        if treasurer
        else ("update", "init_verification", "set_verifiers_train")
    )
    names = instruction_names(net, signature[1])
    assert names[-2:] == [init, set_on], names
    assert update in names[:-2], names

    def dump() -> dict[str, Any]:
        return json.loads(ok(capsys, net, "json-dump-run", "-r", "own"))

    assert dump()["verification"]["verifiers_train"] is True
    for _ in range(2):  # and again: nothing left half-changed
        ok(capsys, net, "update-config", "-r", "own", "--config-path", str(plain), wallet=wallet)
        assert dump()["coordinator_account"]["setup"]["config"]["verification_percent"] == 0


def test_the_treasurers_run_set_verifiers_train_refuses_everyone_but_the_main_authority(
    endpoint: Endpoint,
) -> None:
    """The program's own checks, not the admin path's: a stranger that sends the treasurer's
    `run_set_verifiers_train` itself, signing as the authority, is not the treasurer run's main
    authority (`ConstraintRaw`); naming the main authority without its signature is refused
    (`AccountNotSigner`); and the coordinator's `set_verifiers_train` sent directly with the
    run's PDA (the coordinator's main authority, which only the treasurer signs for) is refused
    too. Nothing changes until the main authority signs."""
    run = TreasurerRun.create(endpoint)
    payer, main, stranger, ids = run.payer, run.main, Keypair(), run.ids
    run_id, account, stored, set_on = run.run_id, run.account, run.stored, run.set_on
    endpoint.airdrop(stranger.pubkey(), 5_000_000_000)

    # a stranger signing as the authority: not the run's main authority
    refused = endpoint.process_err([set_on(stranger.pubkey())], stranger, [stranger])
    assert refused.anchor_error == "ConstraintRaw", refused.logs
    # the main authority named, its signature missing (the stranger pays and signs alone)
    refused = endpoint.process_err([unsigned(set_on(main.pubkey()), main.pubkey())], stranger)
    assert refused.anchor_error == "AccountNotSigner", refused.logs
    # around the treasurer: the coordinator's own instruction with the run PDA as authority
    run_pda = pda.find_run(run.index, ids)
    direct = coordinator_ix.coordinator_set_verifiers_train(run_id, account, run_pda, True, ids)
    refused = endpoint.process_err([unsigned(direct, run_pda)], stranger)
    assert refused.anchor_error == "AccountNotSigner", refused.logs
    assert stored() is False
    # the main authority through the treasurer: set
    endpoint.process([set_on(main.pubkey())], payer, [main])
    assert stored() is True


def test_the_program_zeroes_what_a_shrunk_verification_account_encoding_leaves_behind(
    endpoint: Endpoint,
) -> None:
    """`verifiers_train` is read right after the account's variable-length log: an encoding that
    shrank must not leave its old end there (Anchor's exit keeps it: an account written by the
    layout before the flag would read a log byte as the flag, and not decode at all when that
    byte is neither 0 nor 1). The program zeroes the bytes past the encoding at every store, so
    a field appended after a variable-length part reads its zero default."""
    run = TreasurerRun.create(endpoint)
    node = NodeIdentity()
    entry = VerificationEntry(1, "punished", node, BatchId(0, 1), reason="x" * 40, role="trainer")
    bump = run.verification().bump
    long_ = RunVerification(bump, bytes(run.account), log=[entry], verifiers_train=True)
    short = RunVerification(
        bump, bytes(run.account), log=[VerificationEntry(2, "verified", node, BatchId(0, 1))]
    )
    # the account as an earlier, longer encoding left it, the shorter one written over it
    data = bytearray(encode_anchor_account(long_, RunVerification, RUN_VERIFICATION_SPACE))
    encoded = encode_anchor_account(short)
    data[: len(encoded)] = encoded
    assert any(data[len(encoded) :])
    before = endpoint.ledger.get_account(run.address)
    assert before is not None
    endpoint.ledger.set_account(
        run.address, Account(before.lamports, bytes(data), before.owner, False, 0)
    )
    endpoint.process([run.set_on(run.main.pubkey())], run.payer, [run.main])  # a store
    data = bytearray(endpoint.account(run.address).data)
    stored = decode_anchor_account(bytes(data), RunVerification)
    assert stored.verifiers_train is True
    assert stored.log == short.log
    end = len(encode_anchor_account(stored))
    assert not any(data[end:]), "the old encoding's end is still there"
