"""Verification on the Solana coordinator (issue 27), end to end on the local endpoint: four
scripted members follow a run with `verification_percent = 25` over JSON-RPC and websockets; a
hostile trainer's result is disputed, the tie-breaker's report decides, and the program drops,
bans and slashes the loser and credits the members that found it out. A stranger's report, a
member's report about duties it does not have, a second report and a flood of them are refused
and change nothing."""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import pytest
import trio
from solders.instruction import Instruction
from solders.pubkey import Pubkey

from psyche.cli.solana_client.main import main as solana_client
from psyche.client.observe.verification import VerificationEvents, VerificationTally
from psyche.client.round.verify import disputes, plan_verification
from psyche.coordinator import ClientState, RunState
from psyche.coordinator.data_selection import verification_duties_for_state
from psyche.coordinator.server_core import VERIFIED_ROUNDS
from psyche.coordinator.verification import (
    VERIFIED_BATCHES_PER_VERIFIER,
    Finding,
    VerificationReport,
    draw_batches,
)
from psyche.core.batch_id import BatchId
from psyche.core.ed25519_strict import IDENTITY, compress
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.solana import pda
from psyche.solana.app import watch_verification
from psyche.solana.backend import SolanaBackendError
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.instructions.ed25519 import (
    ED25519_PROGRAM,
    Ed25519SignatureOffsets,
    PrecompileError,
    new_ed25519_instruction,
)
from psyche.solana.keypair import derive_p2p_secret_key
from psyche.solana.verification import verification_to_json

from ..polling import poll_until
from .scripted import (
    RUN_ID,
    Driver,
    ScriptedClient,
    make_backend,
)
from .support import VerifiedRun, error_text, verification_state, verified_run
from .verification_support import SLASHING_RATE, refused, send_report

FLOOD = 12


def test_a_disputed_result_is_decided_by_the_tie_breaker_and_the_loser_slashed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            run = await verified_run(nursery)
            cluster, owner, account, by_signer = run.cluster, run.owner, run.account, run.by_signer
            stranger = make_backend(run.ledger, cluster)
            seen: dict[str, object] = {}

            async with run.followed(nursery) as driver:
                observer = driver.observer

                async def dispute(d: Driver) -> None:
                    if seen:
                        return
                    step, duties = await run.this_round(d)
                    # 4 clients: 1 tie-breaker, 1 verifier (both trainers' batches), 2 trainers
                    assert {d.verifier for d in duties.verifiers} == {duties.verifiers[0].verifier}
                    duty = duties.verifiers[0]
                    tie_breaker = duties.tie_breakers[0].verifier
                    hostile = duty.trainer
                    verifier = by_signer[duty.verifier.signer]
                    trainer_backend = by_signer[hostile.signer].backend
                    accusation = VerificationReport(step, [Finding(duty.batch_id, False, 57.0)])

                    # Refused, and nothing changes: a stranger, a trainer (no duties), a report
                    # about a batch that is not the sender's, a report about an old round.
                    before = await owner.get_data(pda.find_run_verification(account, owner.ids))
                    assert error_text("SignerNotAClient") in await refused(
                        stranger, account, accusation
                    )
                    assert error_text("VerificationReportRefused") in await refused(
                        trainer_backend, account, accusation
                    )
                    other = BatchId(10_000, 10_001)
                    foreign = VerificationReport(step, [Finding(other, False, 1.0)])
                    assert error_text("VerificationReportRefused") in await refused(
                        verifier.backend, account, foreign
                    )
                    old = dataclasses.replace(accusation, step=step + 100)
                    assert error_text("VerificationReportRefused") in await refused(
                        verifier.backend, account, old
                    )
                    after = await owner.get_data(pda.find_run_verification(account, owner.ids))
                    assert after == before

                    # The verifier's accusation goes through the client's backend.
                    assert verifier.runner is not None
                    await verifier.runner.send_verification(accusation)
                    with trio.fail_after(10):
                        while True:
                            found = (await verification_state(owner, account)).round(step)
                            assert found is not None
                            if found.reports:
                                break
                            await trio.sleep(0.05)

                    # A flood: the same verifier again, a stranger, a trainer: all refused, the
                    # account unchanged (each attempt costs its sender a fee).
                    before = await owner.get_data(pda.find_run_verification(account, owner.ids))
                    for k in range(FLOOD):
                        sender = (verifier.backend, stranger, trainer_backend)[k % 3]
                        await refused(sender, account, accusation)
                    after = await owner.get_data(pda.find_run_verification(account, owner.ids))
                    assert after == before

                    # A client reads the round's reports from the account (a tie-breaker
                    # learns its disputes so, in the next round).
                    heard = await verifier.runner.round_reports(step)
                    assert heard == {duty.verifier: accusation}

                    # The tie-breaker is heard only about the disputed batch: naming another
                    # (undisputed) one beside it is refused, the account unchanged.
                    tie_backend = by_signer[tie_breaker.signer].backend
                    too_much = VerificationReport(
                        step, [Finding(d.batch_id, True, 2.0) for d in duties.tie_breakers]
                    )
                    assert len(too_much.findings) > 1
                    before = await owner.get_data(pda.find_run_verification(account, owner.ids))
                    assert error_text("VerificationReportRefused") in await refused(
                        tie_backend, account, too_much
                    )
                    after = await owner.get_data(pda.find_run_verification(account, owner.ids))
                    assert after == before

                    # It recomputed the disputed batch: the hostile result is wrong.
                    verdict = VerificationReport(step, [Finding(duty.batch_id, False, 50.0)])
                    await send_report(tie_backend, account, verdict)
                    seen.update(
                        step=step, hostile=hostile, verifier=duty.verifier, tie_breaker=tie_breaker
                    )
                    state = (await owner.get_coordinator_account(account)).state
                    loser = next(
                        c for c in state.coordinator.epoch_state.clients if c.id == hostile
                    )
                    assert loser.state is ClientState.Dropped
                    # Banned: its join is refused by the program.
                    with pytest.raises(SolanaBackendError, match=error_text("ClientBanned")):
                        await by_signer[hostile.signer].backend.join_run(
                            pda.find_coordinator_instance(RUN_ID, owner.ids),
                            account,
                            by_signer[hostile.signer].identity,
                        )

                # What a person sees: the client's watcher logs the punishment, which its
                # trackers' tally counts (psyche.client.observe.verification).
                tally = VerificationTally()
                events = VerificationEvents(tally).attach()
                nursery.start_soon(partial(watch_verification, observer, interval=0.2))
                try:
                    final = await driver.run_epoch(4, between_rounds=dispute)
                    with trio.fail_after(10):
                        await poll_until(lambda: bool(tally.punished), 0.1)
                finally:
                    events.detach()

            assert seen, "no round to dispute"
            assert final.run_state is RunState.WaitingForMembers
            hostile, verifier, tie_breaker = seen["hostile"], seen["verifier"], seen["tie_breaker"]
            # The loser left the epoch as a dropped client.
            assert [c.id for c in final.epoch_state.exited_clients] == [hostile]
            clients_state = (await owner.get_coordinator_account(account)).state.clients_state
            slashed = {c.id: c.slashed for c in clients_state.clients}
            earned = {c.id: c.earned for c in clients_state.clients}
            assert slashed[hostile] == SLASHING_RATE
            assert sum(slashed.values()) == SLASHING_RATE
            # The verifier and the tie-breaker share the slashed points (on top of the epoch's
            # reward shared by the healthy members, the loser excluded).
            share = 1000 // 3
            assert earned[verifier] == share + SLASHING_RATE // 2
            assert earned[tie_breaker] == share + SLASHING_RATE // 2
            assert earned[hostile] == 0
            record = await verification_state(owner, account)
            (punished,) = [e for e in record.log if e.kind == "punished"]
            assert punished.subject == hostile
            assert punished.role == "trainer"
            assert punished.credited == [verifier, tie_breaker]
            assert punished.slashed == SLASHING_RATE
            verified = [(e.by, e.subject, e.matches) for e in record.log if e.kind == "verified"]
            assert (verifier, hostile, False) in verified
            assert (tie_breaker, hostile, False) in verified
            assert [b.signer for b in record.bans] == [hostile.signer]
            (punished_seen,) = tally.punished
            assert punished_seen.loser == str(hostile)
            assert punished_seen.slashed == SLASHING_RATE
            assert punished_seen.step == seen["step"]

            # What `psyche-solana-client json-dump-run` shows (the command, in a thread).
            capsys.readouterr()
            argv = ["json-dump-run", "--rpc", cluster[0].rpc, "--ws-rpc", cluster[0].ws_rpc]
            code = await trio.to_thread.run_sync(solana_client, [*argv, "--run-id", RUN_ID])
            out = capsys.readouterr().out
            assert code == 0, out
            dumped = json.loads(out)["verification"]
            key = lambda identity: str(Pubkey.from_bytes(identity.signer))  # noqa: E731
            (punished_json,) = [e for e in dumped["log"] if e["kind"] == "punished"]
            assert punished_json["subject"] == key(hostile)
            assert punished_json["slashed"] == SLASHING_RATE
            assert punished_json["credited"] == [key(verifier), key(tie_breaker)]
            assert {"by": key(verifier), "subject": key(hostile), "matches": False}.items() <= next(
                e for e in dumped["log"] if e["kind"] == "verified"
            ).items()
            assert list(dumped["bans"]) == [key(hostile)]
            # The last rounds' duties (the disputed one is older than the account keeps).
            assert 0 < len(dumped["rounds"]) <= VERIFIED_ROUNDS
            for round_json in dumped["rounds"]:
                roles = {d["role"] for d in round_json["duties"]}
                assert roles <= {"verifier", "tie_breaker"}
            clients_json = json.loads(out)["coordinator_account"]["clients"]
            assert clients_json[key(hostile)]["slashed"] == SLASHING_RATE
            assert clients_json[key(hostile)]["earned"] == 0
            # the members that found it out, credited with the slashed points
            for credited in (verifier, tie_breaker):
                assert clients_json[key(credited)]["earned"] == share + SLASHING_RATE // 2
                assert clients_json[key(credited)]["slashed"] == 0
            assert punished_json["credit_each"] == SLASHING_RATE // 2
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_verifier_that_accuses_an_honest_result_is_punished_instead() -> None:
    """The tie-breaker finds the accused results right: the accuser loses both disputes
    (dropped, banned, and slashed once: once per epoch, as the ban) and the tie-breaker alone is
    credited; the trainers keep their places."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            run = await verified_run(nursery)
            owner, account, by_signer = run.owner, run.account, run.by_signer
            parties: dict[str, NodeIdentity] = {}

            async with run.followed(nursery) as driver:

                async def false_accusation(d: Driver) -> None:
                    if parties:
                        return
                    step, duties = await run.this_round(d)
                    duty = duties.verifiers[0]
                    # It accuses every result it verified (both trainers').
                    accusation = VerificationReport(
                        step, [Finding(d.batch_id, False, 30.0) for d in duties.verifiers]
                    )
                    await send_report(by_signer[duty.verifier.signer].backend, account, accusation)
                    tie_breaker = duties.tie_breakers[0].verifier
                    verdict = VerificationReport(
                        step, [Finding(d.batch_id, True, 2.0) for d in duties.tie_breakers]
                    )
                    await send_report(by_signer[tie_breaker.signer].backend, account, verdict)
                    parties.update(
                        accuser=duty.verifier, trainer=duty.trainer, tie_breaker=tie_breaker
                    )

                final = await driver.run_epoch(4, between_rounds=false_accusation)

            assert parties, "no round to dispute"
            accuser, trainer = parties["accuser"], parties["trainer"]
            assert [c.id for c in final.epoch_state.exited_clients] == [accuser]
            assert [c.state for c in final.epoch_state.exited_clients] == [ClientState.Dropped]
            clients_state = (await owner.get_coordinator_account(account)).state.clients_state
            slashed = {c.id: c.slashed for c in clients_state.clients}
            earned = {c.id: c.earned for c in clients_state.clients}
            assert slashed[accuser] == SLASHING_RATE
            assert sum(slashed.values()) == SLASHING_RATE
            assert earned[parties["tie_breaker"]] == 1000 // 3 + SLASHING_RATE
            assert earned[trainer] == 1000 // 3
            record = await verification_state(owner, account)
            punished = [e for e in record.log if e.kind == "punished"]
            assert len(punished) == 2  # one per dispute it lost
            assert {e.subject for e in punished} == {accuser}
            assert {e.role for e in punished} == {"verifier"}
            assert [e.credited for e in punished] == [[parties["tie_breaker"]]] * 2
            assert [(e.slashed, e.credit) for e in punished] == [
                (SLASHING_RATE, SLASHING_RATE),
                (0, 0),
            ]
            nursery.cancel_scope.cancel()

    trio.run(main)


async def replayed_and_kept_draws(
    run: VerifiedRun, d: Driver, monkeypatch: pytest.MonkeyPatch
) -> int:
    """The checks of `test_a_drawn_report_is_kept_with_its_draw_and_a_replayed_draw_is_refused`
    in the round `d` is at (its step)."""
    owner, account, by_signer = run.owner, run.account, run.by_signer
    assert d.state is not None
    step, duties = await run.this_round(d)
    own = verification_duties_for_state(d.state)  # a member's derivation
    v = duties.verifiers[0].verifier
    assert duties.draw_message(v) == own.draw_message(v)
    pool = duties.pool(v)
    assert len(pool) == 3 > VERIFIED_BATCHES_PER_VERIFIER
    verifier = by_signer[v.signer]
    key = SecretKey.from_bytes(derive_p2p_secret_key(RUN_ID, verifier.backend.payer))

    def accusing(draw: bytes) -> VerificationReport:
        drawn = draw_batches(pool, draw)
        return VerificationReport(step, [Finding(x.batch_id, False, 40.0) for x in drawn], draw)

    # The hostile verifier's draws from elsewhere: refused, nothing changes, whichever
    # precompile goes with them: one of the message it signed verifies (the runtime passes it)
    # but is not this round's; one claiming this round's message fails the runtime's check.
    message = duties.draw_message(v)
    before = await owner.get_data(pda.find_run_verification(account, owner.ids))
    for elsewhere in (
        dataclasses.replace(duties, run_id="another-run"),
        dataclasses.replace(duties, seed=bytes(32)),
    ):
        replayed = accusing(key.sign(elsewhere.draw_message(v)))
        assert error_text("VerificationReportRefused") in await refused(
            verifier.backend, account, replayed, (key.public_key, elsewhere.draw_message(v))
        )
        forged = await refused(verifier.backend, account, replayed, (key.public_key, message))
        assert "custom program error: 0x2" in forged  # PrecompileError::InvalidSignature
    # Its own draw without the precompile (the program has no ed25519 call of its own), or
    # beside a precompile of another key's signature of the same message: refused.
    own_draw = accusing(key.sign(message))
    assert error_text("VerificationReportRefused") in await refused(
        verifier.backend, account, own_draw
    )
    other = by_signer[duties.tie_breakers[0].verifier.signer].backend.payer
    other_key = SecretKey.from_bytes(derive_p2p_secret_key(RUN_ID, other))
    mismatched = [
        new_ed25519_instruction(other_key.public_key, message, other_key.sign(message)),
        coordinator_ix.coordinator_verification_report(
            pda.find_coordinator_instance(RUN_ID, owner.ids),
            account,
            verifier.backend.get_payer(),
            own_draw,
            owner.ids,
        ),
    ]
    with pytest.raises(SolanaBackendError) as info:
        await verifier.backend.send_and_retry("Verification report", mismatched)
    assert error_text("VerificationReportRefused") in str(info.value)
    # Its own draw named by a precompile whose offsets point into another instruction (a
    # precompile of another key's signature that carries the key, draw and message after its
    # own entry): the runtime verifies both, the program reads only what a precompile holds in
    # its own data, and refuses the report.
    carrier = new_ed25519_instruction(other_key.public_key, message, other_key.sign(message))
    at = len(carrier.data)
    carried = Instruction(
        ED25519_PROGRAM, bytes(carrier.data) + key.public_key + own_draw.draw + message, []
    )
    offsets = Ed25519SignatureOffsets(at + 32, 0, at, 0, at + 96, len(message), 0)
    pointing = Instruction(ED25519_PROGRAM, b"\x01\x00" + offsets.to_bytes(), [])
    report_ix = mismatched[1]
    with pytest.raises(SolanaBackendError) as info:
        await verifier.backend.send_and_retry("Verification report", [carried, pointing, report_ix])
    assert error_text("VerificationReportRefused") in str(info.value)  # not a precompile error
    after = await owner.get_data(pda.find_run_verification(account, owner.ids))
    assert after == before

    # Its own draw, with the precompile the client sends (key and message from the round as it
    # followed it: what it signed), is heard, and kept with the report. The client reads no
    # account for it: here every read of the verification account fails (before, the report
    # then went without its precompile and was refused).
    report = own_draw
    signer = (await verification_state(owner, account)).draw_signer(step, v.signer)
    assert signer == (key.public_key, message)
    runner = verifier.runner
    assert runner is not None

    async def unreadable() -> None:
        return None  # what `read_verification` gives when its read fails

    monkeypatch.setattr(runner, "read_verification", unreadable)
    await runner.send_verification(report)
    with trio.fail_after(10):
        while True:
            kept = (await verification_state(owner, account)).round(step)
            if kept is not None and any(r.sender == v for r in kept.reports):
                break
            await trio.sleep(0.05)
    tie_breaker = duties.tie_breakers[0].verifier
    tie_runner = by_signer[tie_breaker.signer].runner
    assert tie_runner is not None
    heard = await tie_runner.round_reports(step)
    assert heard == {v: report}
    job = plan_verification(d.state, tie_breaker, None)
    assert job is not None
    assert job.tie_breaker
    wanted = disputes(job, heard)
    assert {x.batch_id for x in wanted.duties} == {f.batch_id for f in report.findings}
    # what json-dump-run shows: the draw and the seed it was checked under
    shown = verification_to_json(await verification_state(owner, account))
    (round_json,) = [r for r in shown["rounds"] if r["step"] == step]
    assert round_json["draws"] == {str(Pubkey.from_bytes(v.signer)): report.draw.hex()}
    assert round_json["seed"] == own.seed.hex()
    return step


def test_a_drawn_report_is_kept_with_its_draw_and_a_replayed_draw_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Five members at 25 %: the verifier's pool holds the three trainers' batches, so which two
    it checks is its draw (its p2p key's signature). The program checks the draw through the
    transaction's `Ed25519SigVerify` instruction, read back from the instructions sysvar, as a
    program on a real cluster must: it refuses a draw replayed from another run of the same
    members (same step and pool) or from the round under another seed (with a precompile of
    what it signed, or one claiming this round's message, which the runtime fails), its own
    draw without a precompile, beside another key's, or named by a precompile whose offsets
    point into another instruction (which the runtime verifies; the program reads a precompile's
    own data only), and keeps an honest report with its draw, sent through the client's runner
    with every read of the verification account failing: a tie-breaker reading it back checks it against
    its own derivation of the round (the centralized path's rule) and hears the dispute; an
    account that dropped the draw would leave the dispute unheard."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            run = await verified_run(nursery, "abcde")
            checked: list[int] = []

            async def once(d: Driver) -> None:
                if not checked:
                    checked.append(await replayed_and_kept_draws(run, d, monkeypatch))

            async with run.followed(nursery) as driver:
                await driver.run_epoch(5, between_rounds=once)
            assert checked, "no round to check"
            nursery.cancel_scope.cancel()

    trio.run(main)


SMALL_ORDER_KEY = compress(IDENTITY)
"""A p2p key of small order (the identity's encoding): under it (R = identity, S = 0) passes
RFC 8032's cofactorless check for every message, so its holder could "sign" any draw."""


class SmallOrderKeyMember(ScriptedClient):
    """A member that joined with `SMALL_ORDER_KEY` as its p2p identity (the program takes any
    32 bytes)."""

    @property
    def identity(self) -> NodeIdentity:
        return NodeIdentity(bytes(self.backend.get_payer()), SMALL_ORDER_KEY)


def test_a_draw_under_a_small_order_key_is_refused_by_the_precompile() -> None:
    """A verifier whose p2p key is of small order sends the draw of its choice (R = identity,
    S = 0, which RFC 8032 verification accepts under that key for any message) with the
    precompile naming its key and this round's draw message, as the program requires: the
    runtime fails the transaction with agave's `InvalidSignature` (`verify_strict` refuses a
    small-order key), and the verification account is unchanged. Before, the emulation verified
    with plain RFC 8032 and the program kept the forged draw."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            run = await verified_run(nursery, "abcde")
            hostile = SmallOrderKeyMember("x", run.clients[0].backend)
            run.clients[0] = hostile
            checked: list[int] = []

            async def once(d: Driver) -> None:
                if checked:
                    return
                step, duties = await run.this_round(d)
                v = next(
                    (x.verifier for x in duties.verifiers
                     if x.verifier.signer == hostile.identity.signer),
                    None,
                )  # fmt: skip
                if v is None:
                    return  # not a verifier this round
                assert v.p2p_identity == SMALL_ORDER_KEY
                message = duties.draw_message(v)
                forged_draw = SMALL_ORDER_KEY + bytes(32)
                drawn = draw_batches(duties.pool(v), forged_draw)
                report = VerificationReport(
                    step, [Finding(x.batch_id, False, 40.0) for x in drawn], forged_draw
                )
                before = await run.owner.get_data(
                    pda.find_run_verification(run.account, run.owner.ids)
                )
                error = await refused(
                    hostile.backend, run.account, report, (SMALL_ORDER_KEY, message)
                )
                code = int(PrecompileError.InvalidSignature)
                assert f"custom program error: 0x{code:x}" in error
                after = await run.owner.get_data(
                    pda.find_run_verification(run.account, run.owner.ids)
                )
                assert after == before
                checked.append(step)

            async with run.followed(nursery) as driver:
                await driver.run_epoch(5, between_rounds=once)
            assert checked, "the small-order member was no verifier in the epoch"
            nursery.cancel_scope.cancel()

    trio.run(main)
