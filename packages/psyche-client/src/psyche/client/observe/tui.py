"""`--logs tui`: the client's terminal dashboard (upstream's client TUI: run state, round, loss,
peers and downloads, evaluations), built with textual.

Three parts, each with one job:

* `DashboardState` is what the dashboard shows, a plain object; `DashboardObserver` (a
  `RunObserver`) and `DashboardLogHandler` (a logging handler) fill it from the client's own
  events: coordinator states, round reports, evaluation scores, log records.
* `ClientDashboard` is the textual app: it redraws from the state a few times a second (the
  text of each panel is a pure function of the state: `header_text`, `round_text`, ...). `q`
  or Ctrl+C stops the client.
* `run_with_dashboard` runs the client's trio program inside the app: textual owns the terminal
  and the main thread (its driver installs signal handlers), trio runs as a guest on textual's
  asyncio loop (`trio.lowlevel.start_guest_run`), so the client itself is unchanged. When the
  client ends, the app closes; when the person quits (or SIGTERM arrives), the client's run is
  cancelled and `KeyboardInterrupt` is raised to the caller, as Ctrl+C would be without the
  dashboard.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from psyche.client.observe.logs import ConsoleFormatter, QuietEventFilter
from psyche.client.observe.stats import format_duration
from psyche.client.observe.telemetry import RoundReport

if TYPE_CHECKING:
    from psyche.coordinator import Coordinator

REFRESH_SECONDS = 0.25
MAX_LOSSES = 400
MAX_LOG_LINES = 500


@dataclass
class DashboardState:
    """What the dashboard shows."""

    run_id: str
    identity: str
    run_state: str = "connecting"
    epoch: int = 0
    step: int = 0
    total_steps: int = 0
    clients: int = 0
    round_height: int | None = None
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_LOSSES))
    last_round: RoundReport | None = None
    eval_scores: dict[str, float] = field(default_factory=dict)
    eval_partial: frozenset[str] = frozenset()
    eval_step: int | None = None
    log_lines: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_LOG_LINES))
    log_total: int = 0
    """Lines ever logged (the panel appends the ones it has not shown)."""
    finished: str | None = None
    """The run summary once the run is over."""
    version: int = 0
    """Grows with every change, so the app redraws only when something changed."""

    def add_log(self, line: str) -> None:
        self.log_lines.append(line)
        self.log_total += 1
        self.version += 1


class DashboardObserver:
    """A `RunObserver` that fills a `DashboardState`."""

    def __init__(self, state: DashboardState) -> None:
        self.state = state

    def on_state(self, state: Coordinator) -> None:
        s = self.state
        s.run_state = state.run_state.name
        s.epoch = state.progress.epoch
        s.step = state.progress.step
        s.total_steps = state.config.total_steps
        s.clients = len(state.epoch_state.clients)
        round_ = state.current_round()
        s.round_height = None if round_ is None else round_.height
        s.version += 1

    def on_round(self, report: RoundReport) -> None:
        s = self.state
        s.last_round = report
        if report.loss is not None and math.isfinite(report.loss):
            s.losses.append((report.step, report.loss))
        if report.eval_scores:
            s.eval_scores = dict(report.eval_scores)
            s.eval_partial = frozenset(report.eval_partial)
        s.version += 1

    def on_evals(
        self, step: int, scores: Mapping[str, float], partial: frozenset[str] = frozenset()
    ) -> None:
        self.state.eval_scores = dict(scores)
        self.state.eval_partial = frozenset(partial)
        self.state.eval_step = step
        self.state.version += 1

    def on_finished(self, summary: Mapping[str, Any]) -> None:
        loss = summary.get("final_loss")
        self.state.finished = f"finished at step {summary.get('step')}" + (
            "" if loss is None else f", final loss {loss:.4f}"
        )
        self.state.version += 1


class DashboardLogHandler(logging.Handler):
    """Log records into the dashboard's log panel (formatted by the handler's formatter)."""

    def __init__(self, state: DashboardState) -> None:
        super().__init__()
        self.state = state

    def emit(self, record: logging.LogRecord) -> None:
        try:
            for line in self.format(record).splitlines():
                self.state.add_log(line)
        except Exception:
            self.handleError(record)


# --------------------------------------------------------------------------------------------
# Panel texts: pure functions of the state


def header_text(s: DashboardState) -> str:
    progress = f"step {s.step}/{s.total_steps}" if s.total_steps else f"step {s.step}"
    height = "" if s.round_height is None else f", round {s.round_height}"
    line = (
        f"run {s.run_id}  ·  client {s.identity}\n"
        f"state {s.run_state}  ·  epoch {s.epoch}  ·  {progress}{height}  ·  {s.clients} clients"
    )
    if s.finished:
        line += f"\n{s.finished}"
    return line


def round_text(s: DashboardState) -> str:
    r = s.last_round
    if r is None:
        return "no round finished yet"
    loss = "no batch" if r.loss is None else f"loss {r.loss:.4f}"
    rate = "" if not r.tokens_per_sec else f"  ·  {r.tokens_per_sec:,.0f} tok/s"
    left = "" if r.seconds_left is None else f"  ·  about {format_duration(r.seconds_left)} left"
    timings = [f"train {r.train_seconds:.2f}s", f"distro {r.distro_seconds:.2f}s"]
    if r.download_seconds is not None:
        timings.append(f"download {r.download_seconds:.2f}s")
    if r.witness_seconds is not None:
        timings.append(f"witness {r.witness_seconds:.2f}s")
    lr = "" if r.lr is None else f"  ·  lr {r.lr:.2e}"
    return f"step {r.step}: {loss}{rate}{left}{lr}\n" + "  ·  ".join(timings)


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} GB"


def network_text(s: DashboardState) -> str:
    r = s.last_round
    if r is None:
        return "peers: -"
    n = r.network
    return (
        f"peers {n.peers}  ·  received {_bytes(n.bytes_received)}  ·  sent {_bytes(n.bytes_sent)}"
        f"  ·  {_bytes(n.bandwidth)}/s"
    ) + (f"\n{n.reachability}" if n.reachability else "")


def evals_text(s: DashboardState) -> str:
    if not s.eval_scores:
        return "evaluations: none yet"
    at = "" if s.eval_step is None else f" (step {s.eval_step})"
    return f"evaluations{at}: " + ", ".join(
        f"{k} {v:.4f}" + (" (partial)" if k in s.eval_partial else "")
        for k, v in s.eval_scores.items()
    )


def loss_text(s: DashboardState) -> str:
    if not s.losses:
        return "loss: -"
    values = [v for _, v in s.losses]
    return f"loss {values[-1]:.4f} (min {min(values):.4f}, {len(values)} steps)"


# --------------------------------------------------------------------------------------------
# The app


def make_dashboard_app(
    state: DashboardState,
    on_quit: Callable[[], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> Any:
    """The textual app for `state` (textual is imported here, only for `--logs tui`);
    `on_ready` is called once it is running, `on_quit` when the person asks to stop (default:
    the app exits)."""
    from textual.app import App, ComposeResult
    from textual.binding import Binding
    from textual.widgets import Footer, Log, Sparkline, Static

    class ClientDashboard(App[None]):
        TITLE = "Psyche client"
        CSS = """
        #header { height: auto; border: round $accent; padding: 0 1; }
        #round, #network, #evals { height: auto; padding: 0 1; }
        #loss-label { padding: 0 1; }
        #loss-chart { height: 6; margin: 0 1; }
        #log { border: round $panel; }
        """
        BINDINGS = [  # noqa: RUF012 (textual's declaration)
            Binding("q", "stop_client", "stop the client"),
            Binding("ctrl+c", "stop_client", "stop the client", priority=True),
        ]

        def __init__(self) -> None:
            super().__init__()
            self.state = state
            self._drawn = -1
            self._log_seen = 0

        def compose(self) -> ComposeResult:
            yield Static(id="header")
            yield Static(id="round")
            yield Static(id="loss-label")
            yield Sparkline([], id="loss-chart")
            yield Static(id="network")
            yield Static(id="evals")
            yield Log(id="log", max_lines=MAX_LOG_LINES)
            yield Footer()

        def on_mount(self) -> None:
            self.redraw()
            self.set_interval(REFRESH_SECONDS, self.redraw)
            if on_ready is not None:
                on_ready()

        def redraw(self) -> None:
            s = self.state
            if s.version == self._drawn:
                return
            self._drawn = s.version
            self.query_one("#header", Static).update(header_text(s))
            self.query_one("#round", Static).update(round_text(s))
            self.query_one("#loss-label", Static).update(loss_text(s))
            self.query_one("#loss-chart", Sparkline).data = [v for _, v in s.losses]
            self.query_one("#network", Static).update(network_text(s))
            self.query_one("#evals", Static).update(evals_text(s))
            fresh = min(s.log_total - self._log_seen, len(s.log_lines))
            if fresh > 0:
                self.query_one("#log", Log).write_lines(list(s.log_lines)[-fresh:])
            self._log_seen = s.log_total

        def action_stop_client(self) -> None:
            if on_quit is not None:
                on_quit()
            else:
                self.exit()

    return ClientDashboard()


class Dashboard:
    """The dashboard around a trio program (see the module docstring)."""

    def __init__(self, state: DashboardState) -> None:
        self.state = state
        self.observer = DashboardObserver(state)
        self.log_handler = DashboardLogHandler(state)
        self.quit_requested = False
        self._cancel: Callable[[], None] | None = None
        self._console_handlers: list[logging.Handler] = []

    def take_console_logging(self) -> None:
        """Log lines go to the dashboard's panel instead of the terminal (a `--write-log`
        file keeps its lines), formatted as on the console."""
        self.log_handler.setFormatter(ConsoleFormatter())
        self.log_handler.addFilter(QuietEventFilter())
        root = logging.getLogger()
        self._console_handlers = [
            h
            for h in root.handlers
            if type(h) is logging.StreamHandler and h.stream in (sys.stdout, sys.stderr)
        ]
        for handler in self._console_handlers:
            root.removeHandler(handler)
        root.addHandler(self.log_handler)

    def give_back_console_logging(self) -> None:
        """The terminal gets the log lines back (the run's last lines print after the app)."""
        root = logging.getLogger()
        root.removeHandler(self.log_handler)
        for handler in self._console_handlers:
            root.addHandler(handler)
        self._console_handlers = []

    def request_quit(self) -> None:
        """Stop the client: cancel its trio run (the app closes when it has ended)."""
        self.quit_requested = True
        self.state.add_log("stopping the client…")
        if self._cancel is not None:
            self._cancel()

    def run_trio(self, main: Callable[[], Awaitable[None]], *, headless: bool = False) -> None:
        """Run `main` (a trio program) under the dashboard until it ends. Raises what `main`
        raised, or `KeyboardInterrupt` when the person stopped it. `headless` draws nowhere
        (tests)."""
        import asyncio

        import trio

        outcome: list[Any] = []
        app: Any = None

        async def guest() -> None:
            with trio.CancelScope() as scope:
                token = trio.lowlevel.current_trio_token()
                self._cancel = lambda: token.run_sync_soon(scope.cancel)
                await main()

        def done(result: Any) -> None:
            outcome.append(result)
            app.exit()

        def start_guest() -> None:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                # not possible off the main thread: the keys still stop the client
                with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                    loop.add_signal_handler(signum, self.request_quit)

            # trio types these callbacks as returning None; asyncio's return a Handle
            def soon_threadsafe(fn: Callable[[], object]) -> None:
                loop.call_soon_threadsafe(fn)

            def soon(fn: Callable[[], object]) -> None:
                loop.call_soon(fn)

            trio.lowlevel.start_guest_run(
                guest,
                run_sync_soon_threadsafe=soon_threadsafe,
                run_sync_soon_not_threadsafe=soon,
                done_callback=done,
                host_uses_signal_set_wakeup_fd=True,
            )

        app = make_dashboard_app(self.state, self.request_quit, start_guest)
        app.run(headless=headless)
        if not outcome:  # the app ended first (its terminal went away): nothing more to show
            raise KeyboardInterrupt
        outcome[0].unwrap()
        if self.quit_requested:
            raise KeyboardInterrupt


__all__ = [
    "Dashboard",
    "DashboardLogHandler",
    "DashboardObserver",
    "DashboardState",
    "evals_text",
    "header_text",
    "loss_text",
    "make_dashboard_app",
    "network_text",
    "round_text",
]
