"""The server's status page over real loopback HTTP, on a live run (two honest protocol
clients training through rounds): `/status.json` parsed, `/` parsed with html.parser, what a
stranger can make it hold, and the page in a headless browser where one is installed."""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from psyche.centralized.protocol import ClientToServerMessage
from psyche.centralized.server import CentralizedServer, open_server
from psyche.centralized.status_page import (
    MAX_REQUEST_BYTES,
    StatusHistory,
    StatusSnapshot,
    render_html,
    serve_status,
    snapshot,
    status_json,
)
from psyche.centralized.testing import DummyTrainer, fast_options
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.committee_selection import WitnessProof
from psyche.coordinator.run_state import RunState, Witness, WitnessMetadata
from psyche.coordinator.testing import integration_test_coordinator
from psyche.transport import ConnectionLimits

from ..polling import poll_until

SPEED = 20.0
ROUNDS = (RunState.RoundTrain, RunState.RoundWitness)


async def http_get(port: int, path: str, raw: bytes | None = None) -> tuple[str, bytes]:
    """The status line and body of one request (HTTP/1.0, the connection closes after it)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(raw or f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = bytearray()
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), body


class PageParser(html.parser.HTMLParser):
    """Text by element id, and the members table's rows (cells by class)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.members: list[dict[str, str]] = []
        self._id: str | None = None
        self._cell: str | None = None
        self.refresh: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "meta" and a.get("http-equiv") == "refresh":
            self.refresh = a.get("content")
        if tag == "tr" and a.get("class") == "member":
            self.members.append({})
        if tag == "td" and self.members and a.get("class"):
            self._cell = a["class"]
        if a.get("id"):
            self._id = a["id"]
            self.by_id[self._id] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell = None
        self._id = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self.members[-1][self._cell] = self.members[-1].get(self._cell, "") + data
        if self._id is not None:
            self.by_id[self._id] += data


async def live_run(body: Callable[[CentralizedServer, int], Any]) -> None:
    coordinator = integration_test_coordinator(2, 4, 1)
    async with (
        open_server(coordinator, fast_options(SPEED, init_warmup_time=20)) as server,
        trio.open_nursery() as nursery,
    ):
        history = StatusHistory()
        server.listeners.append(history)
        port = await nursery.start(
            partial(serve_status, partial(snapshot, server, history), "127.0.0.1", 0)
        )
        for _ in range(2):
            await DummyTrainer.start(nursery, f"127.0.0.1:{server.port}", coordinator.run_id)
        with trio.fail_after(60):
            await poll_until(lambda: history.rounds_measured >= 2 and history.reports, 0.01)
            await body(server, port[1])
        nursery.cancel_scope.cancel()


def test_status_json_and_page_show_the_live_runs_members_and_state() -> None:
    async def check(server: CentralizedServer, port: int) -> None:
        members = {str(c.id) for c in server.coordinator.epoch_state.clients}
        status, body = await http_get(port, "/status.json")
        assert status == "HTTP/1.0 200 OK"
        doc = json.loads(body)
        assert doc["run_id"] == server.coordinator.run_id
        assert doc["run_state"] in (RunState.RoundTrain.name, RunState.RoundWitness.name)
        assert {m["id"] for m in doc["members"]} == members
        assert len(members) == 2
        assert all(m["state"] == "Healthy" and m["connected"] for m in doc["members"])
        assert len(doc["round_durations"]) >= 2
        assert all(r["seconds"] > 0 for r in doc["round_durations"])
        assert doc["loss_curve"]
        assert doc["loss_curve"][0]["loss"] == 0.0

        status, body = await http_get(port, "/")
        assert status == "HTTP/1.0 200 OK"
        page = PageParser()
        page.feed(body.decode())
        assert page.refresh == "5"
        assert page.by_id["run-id"] == server.coordinator.run_id
        assert page.by_id["run-state"] in ("RoundTrain", "RoundWitness")
        assert {m["id"] for m in page.members} == members
        assert {m["state"] for m in page.members} == {"Healthy"}
        assert {m["connected"] for m in page.members} == {"yes"}

        assert (await http_get(port, "/nope"))[0] == "HTTP/1.0 404 Not Found"
        post = b"POST / HTTP/1.0\r\nContent-Length: 1\r\n\r\nx"
        assert (await http_get(port, "/", post))[0] == "HTTP/1.0 405 Method Not Allowed"

    trio.run(live_run, check)


def test_a_stranger_gets_nothing_big_or_lasting() -> None:
    """An oversized request is cut off, a silent or trickling connection is closed after the
    limits' timeout, and a flood from one address evicts itself."""

    def empty() -> StatusSnapshot:
        return StatusSnapshot("r", "Warmup", 0, 0, 10, None, [], 0, 0, [], [], 0.0)

    limits = ConnectionLimits(max_pending=4, max_pending_per_address=2, handshake_timeout=0.5)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            _, port = await nursery.start(
                partial(serve_status, empty, "127.0.0.1", 0, limits=limits)
            )
            huge = b"GET /" + b"a" * (2 * MAX_REQUEST_BYTES) + b" HTTP/1.0\r\n\r\n"
            try:  # answered 400 and closed unread: the reply may be lost to the reset
                status, _ = await http_get(port, "/", huge)
                assert status == "HTTP/1.0 400 Bad Request"
            except trio.BrokenResourceError:
                pass
            silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
            with trio.fail_after(10):  # each is closed: by eviction or by the timeout
                for stream in silent:
                    assert await stream.receive_some(100) == b""
            # the server still answers
            assert (await http_get(port, "/status.json"))[0] == "HTTP/1.0 200 OK"
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_page_escapes_what_clients_report() -> None:
    from psyche.centralized.status_page import MemberReport, MemberStatus

    report = MemberReport(3, 2.5, 100.0, 0.0, {"<script>x</script>": 0.5}, 0.0)
    snap = StatusSnapshot(
        "<b>run</b>", "RoundTrain", 0, 3, 10, 1,
        [MemberStatus("abc", "Healthy", True, report)], 0, 1, [(2, 1.5)], [(1, 3.0), (2, 2.5)], 1.0,
    )  # fmt: skip
    page = render_html(snap)
    assert "<script>" not in page
    assert "&lt;script&gt;" in page
    assert "<b>run</b>" not in page
    assert json.loads(json.dumps(status_json(snap)))["members"][0]["report"]["loss"] == 2.5


def test_the_page_in_a_headless_browser() -> None:
    import pytest

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium to run this test)")

    async def check(server: CentralizedServer, port: int) -> None:
        # the run goes on while the browser starts (seconds on a loaded machine, long enough for
        # a new epoch's warmup): the page must show a state the run was in meanwhile
        states_seen: set[str] = set()

        async def watch_states() -> None:
            while True:
                states_seen.add(server.coordinator.run_state.name)
                await trio.sleep(0.005)

        async with trio.open_nursery() as watcher:
            states_seen.add(server.coordinator.run_state.name)
            watcher.start_soon(watch_states)
            dom = await trio.to_thread.run_sync(
                lambda: subprocess.run(
                    [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                     f"http://127.0.0.1:{port}/"],
                    capture_output=True, text=True, timeout=60, check=True,
                ).stdout
            )  # fmt: skip
            states_seen.add(server.coordinator.run_state.name)
            watcher.cancel_scope.cancel()
        page = PageParser()
        page.feed(dom)
        members = {str(c.id) for c in server.coordinator.epoch_state.clients}
        assert {m["id"] for m in page.members} == members
        assert page.by_id["run-id"] == server.coordinator.run_id
        assert page.by_id["run-state"] in states_seen, (page.by_id["run-state"], states_seen)

    trio.run(live_run, check)


def test_a_member_cannot_rewrite_the_loss_curve() -> None:
    """Issue 24, item 7: a member (training honestly besides) sends 200 Witness messages a round
    with made-up steps and losses of +-1e30. The page shows only the witnesses the coordinator
    accepted, at the step they were accepted in: every point is what the honest witnesses
    reported (0.0), at a step the run has trained."""
    coordinator = integration_test_coordinator(3, 4, 1)

    async def spam(hostile: DummyTrainer) -> None:
        """200 made-up witnesses in every round the hostile member sees."""
        spammed: set[tuple[int, int]] = set()
        while True:
            await trio.sleep(0.01)
            state = hostile.latest
            current = None if state is None else state.current_round()
            if state is None or current is None or state.run_state not in ROUNDS:
                continue
            if (state.progress.epoch, current.height) in spammed:
                continue
            spammed.add((state.progress.epoch, current.height))
            for i in range(200):
                fake = Witness(WitnessProof(position=i, index=i, witness=False))
                made_up = WitnessMetadata(
                    step=1000 + 7 * i, loss=1e30 if i % 2 else -1e30, tokens_per_sec=1e30
                )
                data = OpportunisticData.WitnessStep((fake, made_up))
                await hostile.client.send(ClientToServerMessage.Witness(data))

    async def main() -> None:
        async with (
            open_server(coordinator, fast_options(SPEED, init_warmup_time=20)) as server,
            trio.open_nursery() as nursery,
        ):
            history = StatusHistory()
            server.listeners.append(history)
            _, port = await nursery.start(
                partial(serve_status, partial(snapshot, server, history), "127.0.0.1", 0)
            )
            address = f"127.0.0.1:{server.port}"
            trainers = [await DummyTrainer.start(nursery, address, "test-run") for _ in range(3)]
            nursery.start_soon(spam, trainers[2])
            with trio.fail_after(90):  # three rounds spammed, four measured
                await poll_until(
                    lambda: server.core.rejected.counts["Witness (InvalidWitness)"] >= 600, 0.05
                )
                await poll_until(lambda: history.rounds_measured >= 4, 0.05)
            status, body = await http_get(port, "/status.json")
            assert status == "HTTP/1.0 200 OK"
            doc = json.loads(body)
            trained = server.coordinator.progress.step
            curve = doc["loss_curve"]
            assert curve, curve
            assert all(p["loss"] == 0.0 for p in curve), curve
            assert all(p["step"] <= trained for p in curve), (curve, trained)
            reports = [m["report"] for m in doc["members"] if m["report"] is not None]
            assert reports
            assert all(r["loss"] == 0.0 and r["step"] <= trained for r in reports)
            assert all(r["tokens_per_sec"] < 1e30 for r in reports)
            nursery.cancel_scope.cancel()

    trio.run(main)
