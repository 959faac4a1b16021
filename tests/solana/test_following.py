"""Exact verification (followers, issue 27) on the Solana coordinator, on the local endpoint: a
run with `verification_percent = 25` and `exact_verification_threads = 1` (kept in the run's
verification account) and four scripted members following it over JSON-RPC and websockets. The
program records each round's follower duties (every member followed by the other three) and
hears follower reports through `psyche.coordinator.following.RoundFollowing`, the rules the
centralized server runs: a trainer whose three followers all found its commitment differs is
dropped, banned, slashed the treasurer's `slashing_rate_per_client` and its followers credited; a
lone false accuser against two vouchers loses instead; a stranger's, a non-follower's, a second
and an old report are refused and change nothing."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import trio
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from psyche.cli.solana_client.main import main as solana_client
from psyche.coordinator import ClientState, RunState
from psyche.coordinator.following import FOLLOW_DRAW, RoundFollowing
from psyche.coordinator.run_config import MAX_EXACT_VERIFICATION_THREADS
from psyche.coordinator.verification import Finding, VerificationDuty, VerificationReport
from psyche.core.node_identity import NodeIdentity
from psyche.solana import pda
from psyche.solana.backend import SolanaBackendError
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.instructions import treasurer as treasurer_ix
from psyche.solana.localnet.ledger import ManualClock
from psyche.solana.localnet.server import LocalnetThread

from .cli_helpers import RUN_CONFIG, funded_wallet, ok, run_cli
from .conftest import Endpoint
from .scripted import RUN_ID, Driver, make_backend
from .support import VerifiedRun, error_text, verification_state, verified_run
from .verification_support import (
    SLASHING_RATE,
    TreasurerRun,
    instruction_names,
    refused,
    send_report,
    unsigned,
)

EPOCH_REWARD = 1000  # `create_run`'s `set_future_epoch_rates`, shared by the healthy members


def follow_report(step: int, batch: VerificationDuty, matches: bool) -> VerificationReport:
    return VerificationReport(
        step, [Finding(batch.batch_id, matches, 0.0 if matches else 1.0)], FOLLOW_DRAW
    )


async def followed_round(run: VerifiedRun, step: int) -> RoundFollowing:
    stored = (await verification_state(run.owner, run.account)).followed_round(step)
    assert stored is not None, "the program recorded the round's follower duties"
    return stored.record()


async def first_followed(
    run: VerifiedRun, d: Driver
) -> tuple[int, VerificationDuty, list[NodeIdentity]]:
    """The round's step, its first batch's duty and that batch's trainer's followers."""
    assert d.state is not None
    step = d.state.progress.step
    record = await followed_round(run, step)
    batch = record.duties[0]
    followers = [x.verifier for x in record.duties if x.batch_id == batch.batch_id]
    # four members: each trainer is followed by the other three
    members = {c.id for c in d.state.epoch_state.clients}
    assert set(followers) == members - {batch.trainer}
    assert len(followers) == 3
    return step, batch, followers


def dump_verification(run: VerifiedRun, capsys: pytest.CaptureFixture[str]) -> dict:  # type: ignore[type-arg]
    """What `psyche-solana-client json-dump-run` shows (call in a thread)."""
    argv = ["json-dump-run", "--rpc", run.cluster[0].rpc, "--ws-rpc", run.cluster[0].ws_rpc]
    capsys.readouterr()
    code = solana_client([*argv, "--run-id", RUN_ID])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)  # type: ignore[no-any-return]


def key(identity: NodeIdentity) -> str:
    return str(Pubkey.from_bytes(identity.signer))


def test_three_followers_convict_a_lying_trainer_and_the_program_slashes_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            run = await verified_run(nursery, exact_verification_threads=1)
            owner, account, by_signer = run.owner, run.account, run.by_signer
            stranger = make_backend(run.ledger, run.cluster)
            seen: dict[str, object] = {}

            async with run.followed(nursery) as driver:

                async def convict(d: Driver) -> None:
                    if seen:
                        return
                    step, batch, followers = await first_followed(run, d)
                    hostile = batch.trainer
                    # Every member runs with the run's setting (read from the account).
                    for client in run.clients:
                        assert client.runner is not None
                        config = client.runner.latest.state.coordinator.config
                        assert config.exact_verification_threads == 1
                    accusation = follow_report(step, batch, False)
                    address = pda.find_run_verification(account, owner.ids)

                    # Refused, the account unchanged: a stranger; the trainer about its own
                    # batch (it follows the others, not itself); an old round; a verifier-style
                    # report with no draw about the batch (not a follower's report, and the
                    # follower is no verifier of it).
                    before = await owner.get_data(address)
                    assert error_text("SignerNotAClient") in await refused(
                        stranger, account, accusation
                    )
                    own = by_signer[hostile.signer].backend
                    assert error_text("VerificationReportRefused") in await refused(
                        own, account, accusation
                    )
                    first = by_signer[followers[0].signer]
                    old = dataclasses.replace(accusation, step=step + 100)
                    assert error_text("VerificationReportRefused") in await refused(
                        first.backend, account, old
                    )
                    assert await owner.get_data(address) == before

                    # The first accusation goes through the client's backend (no precompile:
                    # the follower's draw is no signature), then the second: two words decide
                    # nothing.
                    assert first.runner is not None
                    await first.runner.send_verification(accusation)
                    with trio.fail_after(10):
                        while True:
                            if (await followed_round(run, step)).reports:
                                break
                            await trio.sleep(0.05)
                    assert error_text("VerificationReportRefused") in await refused(
                        first.backend, account, accusation
                    )  # a second report of the round
                    await send_report(by_signer[followers[1].signer].backend, account, accusation)
                    state = (await owner.get_coordinator_account(account)).state.coordinator
                    trainer = next(c for c in state.epoch_state.clients if c.id == hostile)
                    assert trainer.state is ClientState.Healthy
                    assert (await verification_state(owner, account)).bans == []

                    # The third convicts: dropped, banned (its join refused).
                    await send_report(by_signer[followers[2].signer].backend, account, accusation)
                    state = (await owner.get_coordinator_account(account)).state.coordinator
                    trainer = next(c for c in state.epoch_state.clients if c.id == hostile)
                    assert trainer.state is ClientState.Dropped
                    with pytest.raises(SolanaBackendError, match=error_text("ClientBanned")):
                        await own.join_run(
                            pda.find_coordinator_instance(RUN_ID, owner.ids),
                            account,
                            by_signer[hostile.signer].identity,
                        )
                    seen.update(step=step, hostile=hostile, followers=followers)

                final = await driver.run_epoch(4, between_rounds=convict)

            assert seen, "no round to follow"
            assert final.run_state is RunState.WaitingForMembers
            hostile = seen["hostile"]
            followers = seen["followers"]
            assert isinstance(hostile, NodeIdentity)
            assert isinstance(followers, list)
            assert [c.id for c in final.epoch_state.exited_clients] == [hostile]
            clients = (await owner.get_coordinator_account(account)).state.clients_state.clients
            slashed = {c.id: c.slashed for c in clients}
            earned = {c.id: c.earned for c in clients}
            assert slashed[hostile] == SLASHING_RATE
            assert sum(slashed.values()) == SLASHING_RATE
            credit = SLASHING_RATE // 3  # shared by the three followers, the remainder unpaid
            for follower in followers:
                assert earned[follower] == EPOCH_REWARD // 3 + credit
            assert earned[hostile] == 0
            record = await verification_state(owner, account)
            (punished,) = [e for e in record.log if e.kind == "punished"]
            assert (punished.subject, punished.role) == (hostile, "trainer")
            assert punished.credited == followers
            assert (punished.slashed, punished.credit) == (SLASHING_RATE, credit)
            followed = [(e.by, e.subject, e.matches) for e in record.log if e.kind == "followed"]
            assert followed == [(f, hostile, False) for f in followers]
            assert [b.signer for b in record.bans] == [hostile.signer]

            dumped = await trio.to_thread.run_sync(dump_verification, run, capsys)
            verification = dumped["verification"]
            assert verification["exact_verification_threads"] == 1
            (punished_json,) = [e for e in verification["log"] if e["kind"] == "punished"]
            assert punished_json["subject"] == key(hostile)
            assert punished_json["role"] == "trainer"
            assert punished_json["slashed"] == SLASHING_RATE
            assert punished_json["credited"] == [key(f) for f in followers]
            assert [
                (e["by"], e["subject"], e["matches"])
                for e in verification["log"]
                if e["kind"] == "followed"
            ] == [(key(f), key(hostile), False) for f in followers]
            assert list(verification["bans"]) == [key(hostile)]
            assert verification["following"], "the last rounds' follower duties"
            for round_json in verification["following"]:
                for batch_json in round_json["batches"]:
                    assert len(batch_json["followers"]) == 3
                    assert batch_json["trainer"] not in batch_json["followers"]
            assert (
                dumped["coordinator_account"]["clients"][key(hostile)]["slashed"] == SLASHING_RATE
            )
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_lone_false_accuser_against_two_vouchers_is_punished_instead() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            run = await verified_run(nursery, exact_verification_threads=1)
            owner, account, by_signer = run.owner, run.account, run.by_signer
            parties: dict[str, object] = {}

            async with run.followed(nursery) as driver:

                async def false_accusation(d: Driver) -> None:
                    if parties:
                        return
                    step, batch, followers = await first_followed(run, d)
                    accuser, *vouchers = followers
                    # the owner cannot change the setting while the run is running
                    setter = coordinator_ix.coordinator_set_exact_verification_threads(
                        RUN_ID, account, owner.get_payer(), 2, owner.ids
                    )
                    with pytest.raises(
                        SolanaBackendError, match=error_text("UpdateConfigNotHalted")
                    ):
                        await owner.send_and_retry("Set exact verification threads", [setter])
                    await send_report(
                        by_signer[accuser.signer].backend,
                        account,
                        follow_report(step, batch, False),
                    )
                    # one voucher is not enough (it must be two that outnumber the accusers)
                    await send_report(
                        by_signer[vouchers[0].signer].backend,
                        account,
                        follow_report(step, batch, True),
                    )
                    assert (await verification_state(owner, account)).bans == []
                    await send_report(
                        by_signer[vouchers[1].signer].backend,
                        account,
                        follow_report(step, batch, True),
                    )
                    parties.update(accuser=accuser, trainer=batch.trainer, vouchers=vouchers)

                final = await driver.run_epoch(4, between_rounds=false_accusation)

            assert parties, "no round to follow"
            accuser, trainer, vouchers = parties["accuser"], parties["trainer"], parties["vouchers"]
            assert isinstance(vouchers, list)
            assert [c.id for c in final.epoch_state.exited_clients] == [accuser]
            clients = (await owner.get_coordinator_account(account)).state.clients_state.clients
            slashed = {c.id: c.slashed for c in clients}
            earned = {c.id: c.earned for c in clients}
            assert slashed[accuser] == SLASHING_RATE
            assert sum(slashed.values()) == SLASHING_RATE
            for voucher in vouchers:
                assert earned[voucher] == EPOCH_REWARD // 3 + SLASHING_RATE // 2
            assert earned[trainer] == EPOCH_REWARD // 3
            record = await verification_state(owner, account)
            (punished,) = [e for e in record.log if e.kind == "punished"]
            assert (punished.subject, punished.role) == (accuser, "follower")
            assert punished.credited == vouchers
            assert record.exact_verification_threads == 1
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("treasurer", [False, True], ids=["own", "treasurer"])
@pytest.mark.usefixtures("clean_env")
def test_update_config_sets_exact_verification_threads_and_json_dump_run_shows_it(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str], treasurer: bool
) -> None:
    """The owner's `update-config` sets the run's `exact_verification_threads` (the coordinator
    account has no room for it) with `set_exact_verification_threads`, through the treasurer's
    `run_set_exact_verification_threads` in a treasurer run, in the update's own transaction;
    `json-dump-run` shows it; another wallet is refused and changes nothing."""
    wallet = tmp_path / "owner.json"
    owner = funded_wallet(net, wallet)
    verifying = RUN_CONFIG.replace("verification_percent = 0", "verification_percent = 25")
    verifying = verifying.replace("min_clients = 1", "min_clients = 4")
    on, off = tmp_path / "on.toml", tmp_path / "off.toml"
    on.write_text(verifying.replace("[config]\n", "[config]\nexact_verification_threads = 2\n", 1))
    off.write_text(verifying)
    extra = []
    if treasurer:
        mint = Endpoint(net, ManualClock()).new_mint(owner, owner.pubkey(), 6)
        extra = ["--treasurer-collateral-mint", str(mint)]
    ok(capsys, net, "create-run", "-r", "exact", "-c", "test", *extra, wallet=wallet)

    def threads() -> int:
        dump = json.loads(ok(capsys, net, "json-dump-run", "-r", "exact"))
        return int(dump["verification"]["exact_verification_threads"])

    for path, expected in ((on, 2), (off, 0), (on, 2)):
        out = ok(
            capsys, net, "update-config", "-r", "exact", "--config-path", str(path), wallet=wallet
        )
        assert threads() == expected
    signature = re.search(r"with transaction (\w+)", out)
    assert signature is not None, out
    names = instruction_names(net, signature[1])
    setter = "run_set_exact_verification_threads" if treasurer else "set_exact_verification_threads"
    assert names[-1] == setter, names
    stranger = tmp_path / "stranger.json"
    funded_wallet(net, stranger)
    code, _, err = run_cli(
        capsys, net, "update-config", "-r", "exact", "--config-path", str(off), wallet=stranger
    )
    assert code == 1, err
    assert threads() == 2


def test_the_program_sets_exact_verification_threads_only_for_the_main_authority_and_in_bounds(
    endpoint: Endpoint,
) -> None:
    """The program's own checks on the treasurer's `run_set_exact_verification_threads` (not
    the admin path's): a stranger signing as the authority is refused (`ConstraintRaw`), the
    coordinator's instruction sent around the treasurer with the run's PDA unsigned too
    (`AccountNotSigner`), and a count above `MAX_EXACT_VERIFICATION_THREADS`
    (`ConfigSanityCheckFailed`); the account is unchanged until the main authority signs a
    count in bounds."""
    run = TreasurerRun.create(endpoint)
    stranger, ids = Keypair(), run.ids
    endpoint.airdrop(stranger.pubkey(), 1_000_000_000)

    def set_to(authority: Pubkey, threads: int) -> Instruction:
        return treasurer_ix.treasurer_run_set_exact_verification_threads(
            run.run_id, run.index, run.account, authority, threads, ids
        )

    def stored() -> int:
        return run.verification().exact_verification_threads

    refused = endpoint.process_err([set_to(stranger.pubkey(), 1)], stranger, [stranger])
    assert refused.anchor_error == "ConstraintRaw", refused.logs
    run_pda = pda.find_run(run.index, ids)
    direct = coordinator_ix.coordinator_set_exact_verification_threads(
        run.run_id, run.account, run_pda, 1, ids
    )
    refused = endpoint.process_err([unsigned(direct, run_pda)], stranger)
    assert refused.anchor_error == "AccountNotSigner", refused.logs
    too_many = MAX_EXACT_VERIFICATION_THREADS + 1
    refused = endpoint.process_err([set_to(run.main.pubkey(), too_many)], run.payer, [run.main])
    assert refused.anchor_error == "ConfigSanityCheckFailed", refused.logs
    assert stored() == 0
    endpoint.process([set_to(run.main.pubkey(), 1)], run.payer, [run.main])
    assert stored() == 1
