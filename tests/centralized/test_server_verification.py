"""Issue 27 over loopback TCP: five members (`DummyTrainer`s) of a run with verification_percent
25; the round's verifier accuses a trainer, the tie-breaker's verdict agrees, and the server drops
and bans the trainer. A stranger's report and a member's flood of reports change nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from psyche.centralized.client import CentralizedBackend
from psyche.centralized.protocol import ClientToServerMessage
from psyche.centralized.server import ServerStartError, open_server
from psyche.centralized.status_page import StatusHistory, render_html, snapshot, status_json
from psyche.centralized.testing import DummyTrainer, ProtocolClient, fast_options
from psyche.coordinator.run_state import ClientState
from psyche.coordinator.testing import quick_coordinator
from psyche.coordinator.verification import Finding, VerificationReport
from psyche.core.identity import SecretKey

from .servers import addr, eventually


async def _watching(address: str, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """A `CentralizedBackend` (the real client's) connected to the run until cancelled."""
    async with CentralizedBackend.connect(address, SecretKey.generate(), "test-run") as backend:
        task_status.started(backend)
        await trio.sleep_forever()


def test_an_accused_trainer_is_dropped_and_banned_over_tcp() -> None:
    coordinator = quick_coordinator(init_min_clients=5, global_batch_size=8, epoch_time=600)
    coordinator.config.verification_percent = 25

    async def main() -> None:
        async with open_server(coordinator, fast_options()) as server, trio.open_nursery() as n:
            address = addr(server)
            members = [await DummyTrainer.start(n, address, "test-run") for _ in range(5)]
            await eventually(lambda: bool(server.core.verification), 60)
            watcher = await n.start(_watching, address)
            record = next(iter(server.core.verification.values()))
            duties = record.duties
            by_id = {m.identity: m for m in members}
            verifier = by_id[duties.verifiers[0].verifier]
            tie_breaker = by_id[duties.tie_breakers[0].verifier]
            drawn = duties.checks(verifier.identity, verifier.client.key.sign)
            assert drawn is not None
            liar = drawn[0][0].trainer

            def findings(sender: DummyTrainer) -> VerificationReport:
                """What it checks (a verifier: its draw, signed with its key); the
                tie-breaker's only about the disputed batch."""
                checks = duties.checks(sender.identity, sender.client.key.sign)
                assert checks is not None
                tie = sender is tie_breaker
                return VerificationReport(duties.step, [
                    Finding(d.batch_id, d.trainer != liar, 1.0 if d.trainer == liar else 0.0)
                    for d in checks[0]
                    if not tie or d.trainer == liar
                ], checks[1])  # fmt: skip

            # a stranger is dropped unread; a member's flood is one report
            async with await ProtocolClient.connect(address) as stranger:
                await stranger.send(ClientToServerMessage.Verification(findings(verifier)))
            for _ in range(20):
                await verifier.client.send(ClientToServerMessage.Verification(findings(verifier)))
            # the first is heard; one word decides nothing (the tie-breaker reports at once after
            # it: the round's duties are kept for its next three rounds only)
            await eventually(lambda: bool(server.core.verification_log), 30)
            assert liar not in server.core.banned
            # the server relays what it heard to the run's clients (a tie-breaker's disputes):
            # a real client backend, joined (pending the next epoch), reads the accusation
            heard = await watcher.round_reports(duties.step)
            with trio.fail_after(30):
                while not heard:
                    await trio.sleep(0.05)
                    heard = await watcher.round_reports(duties.step)
            assert heard == {verifier.identity: findings(verifier)}
            await tie_breaker.client.send(ClientToServerMessage.Verification(findings(tie_breaker)))
            await eventually(lambda: liar in server.core.banned, 30)
            await eventually(lambda: server.core.rejected.counts.get("Verification", 0) >= 19, 30)
            assert server.core.ignored.counts.get("Verification from non-members") == 1
            assert set(server.core.banned) == {liar}
            assert any(
                e.kind == "punished" and e.subject == liar for e in server.core.verification_log
            )

            # every member hears of it: the broadcast state has the liar dropped (or gone)
            def liar_out() -> bool:
                latest = members[0].latest
                return latest is not None and all(
                    c.state is not ClientState.Healthy
                    for c in latest.epoch_state.clients
                    if c.id == liar
                )

            await eventually(liar_out, 30)
            # the status page says who was verified, what was found, who was punished
            snap = snapshot(server, StatusHistory())
            kinds = {(v.kind, v.subject, v.matches) for v in snap.verification}
            assert ("punished", str(liar), None) in kinds
            assert ("verified", str(liar), False) in kinds
            page = render_html(snap)
            assert 'id="verification"' in page
            assert "punished" in page
            assert status_json(snap)["verification"][0]["kind"] == "punished"
            n.cancel_scope.cancel()

    trio.run(main)


def test_validate_config_and_the_server_refuse_a_run_without_a_verifier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from psyche.centralized.run import validate_config
    from psyche.coordinator.run_config import load_state_toml

    from ..processes import free_port
    from .servers import tiny_state

    # the tiny run: min_clients 1, so 25 % elects no verifier beside the tie-breaker
    state = tiny_state(
        tmp_path, free_port(), **{"verification_percent = 0": "verification_percent = 25"}
    )
    assert validate_config(state, None) == 1
    err = capsys.readouterr().err
    assert "config.verification_percent" in err, err
    assert "elects no verifier" in err, err
    coordinator = load_state_toml(state)  # it loads, as upstream's configs do

    async def main() -> None:
        async with open_server(coordinator, fast_options()):
            pass

    with pytest.raises(ServerStartError, match=r"config\.verification_percent"):
        trio.run(main)
    # at 0 (upstream) the same file is fine
    (tmp_path / "ok").mkdir()
    assert validate_config(tiny_state(tmp_path / "ok", free_port()), None) == 0


def test_the_status_page_says_what_followers_found() -> None:
    from psyche.centralized.status_page import VerificationStatus, _verification_html

    page = _verification_html(
        [
            VerificationStatus(4, "followed", "aaaa", "bbbb", "B[0, 3]", False, 1.0, ""),
            VerificationStatus(4, "followed", "cccc", "bbbb", "B[4, 7]", True, 0.0, ""),
        ]
    )
    assert "bbbb rebuilt its commitment: <b>not the same</b>" in page
    assert "bbbb rebuilt its commitment: the same, bit for bit" in page
    assert 'class="verification followed"' in page
