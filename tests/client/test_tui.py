"""`--logs tui`: the dashboard driven headless with textual's pilot, fed the client's own
objects (a coordinator state, round reports, evaluation scores, log records), and the trio
client program running as a guest inside it."""

from __future__ import annotations

import asyncio
import logging

import pytest
import trio

from psyche.client.observe.telemetry import NetworkNumbers, RoundReport
from psyche.client.observe.tui import (
    Dashboard,
    DashboardLogHandler,
    DashboardObserver,
    DashboardState,
    make_dashboard_app,
)
from psyche.coordinator import RunState
from psyche.coordinator.testing import quick_coordinator


def report(step: int, loss: float | None) -> RoundReport:
    return RoundReport(
        step=step,
        epoch=0,
        total_steps=20,
        round_height=step - 1,
        num_clients=2,
        loss=loss,
        lr=4e-4,
        tokens_per_sec=1234.0,
        total_tokens=step * 128,
        global_token_batch_size=128,
        efficiency=0.5,
        seconds_left=75.0,
        trained=1,
        train_seconds=0.5,
        distro_seconds=0.125,
        download_seconds=0.75,
        witness_seconds=1.25,
        network=NetworkNumbers(
            peers=3,
            bytes_sent=2_500_000,
            bytes_received=1_200,
            bandwidth=0,
            reachability="reachability private; relays: 64af3b8827 reserved",
        ),
    )


def text(app: object, selector: str) -> str:
    return str(app.query_one(selector).content)  # type: ignore[attr-defined]


def test_the_dashboard_shows_run_state_rounds_loss_peers_evals_and_logs() -> None:
    state = DashboardState("tiny-cpu", "client-1")
    observer = DashboardObserver(state)
    coordinator = quick_coordinator(run_id="tiny-cpu")
    coordinator.run_state = RunState.RoundTrain
    coordinator.progress.step = 3
    observer.on_state(coordinator)
    observer.on_round(report(2, 5.5))
    observer.on_round(report(3, 5.25))
    handler = DashboardLogHandler(state)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("test.tui")
    logger.addHandler(handler)
    logger.propagate = False
    quits: list[bool] = []

    async def drive() -> None:
        app = make_dashboard_app(state, on_quit=lambda: quits.append(True))
        async with app.run_test() as pilot:
            await pilot.pause()
            header = text(app, "#header")
            assert "run tiny-cpu" in header
            assert "client client-1" in header
            assert "state RoundTrain" in header
            assert "step 3/" in header
            round_ = text(app, "#round")
            assert "step 3: loss 5.2500" in round_
            assert "1,234 tok/s" in round_
            assert "about 1m15s left" in round_
            assert "download 0.75s" in round_
            assert "witness 1.25s" in round_
            assert "loss 5.2500 (min 5.2500, 2 steps)" in text(app, "#loss-label")
            assert list(app.query_one("#loss-chart").data) == [5.5, 5.25]
            network = text(app, "#network")
            assert "peers 3" in network
            assert "sent 2.5 MB" in network
            assert "1.2 KB" in network
            assert "reachability private; relays: 64af3b8827 reserved" in network
            assert text(app, "#evals") == "evaluations: none yet"

            # what happens next shows at the next redraw
            observer.on_evals(4, {"PIQA": 0.75})
            observer.on_round(report(4, None))
            logger.warning("a peer is slow")
            for _ in range(200):  # redraws every 0.25 s; 10 s at most
                if "PIQA" in text(app, "#evals"):
                    break
                await pilot.pause(0.05)
            assert text(app, "#evals") == "evaluations (step 4): PIQA 0.7500"
            assert "step 4: no batch" in text(app, "#round")
            assert "WARNING a peer is slow" in list(app.query_one("#log").lines)
            await pilot.press("q")
            await pilot.pause()
            assert quits == [True]

    asyncio.run(drive())
    logger.removeHandler(handler)


def test_the_client_program_runs_as_a_guest_and_ends_the_app() -> None:
    dashboard = Dashboard(DashboardState("r", "c"))
    seen: list[str] = []

    async def program() -> None:
        await trio.sleep(0.01)
        dashboard.observer.on_finished({"step": 7, "final_loss": 3.5})
        seen.append(dashboard.state.finished or "")

    dashboard.run_trio(program, headless=True)
    assert seen == ["finished at step 7, final loss 3.5000"]

    async def fails() -> None:
        raise ValueError("the backend went away")

    with pytest.raises(ValueError, match="backend went away"):
        Dashboard(DashboardState("r", "c")).run_trio(fails, headless=True)


def test_stopping_from_the_dashboard_cancels_the_client_as_ctrl_c_would() -> None:
    dashboard = Dashboard(DashboardState("r", "c"))
    cancelled: list[bool] = []

    async def forever() -> None:
        try:
            trio.lowlevel.current_trio_token().run_sync_soon(dashboard.request_quit)
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append(True)
            raise

    with pytest.raises(KeyboardInterrupt):
        dashboard.run_trio(forever, headless=True)
    assert cancelled == [True]
    assert "stopping the client…" in dashboard.state.log_lines
