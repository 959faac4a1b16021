"""The server's read-only status page (`psyche-server run --status-port`): `/status.json` and an
HTML page at `/` (rendered here, no JavaScript; it reloads itself with a meta refresh).

Three layers, each with one job:

* `StatusHistory` listens to the server (`CentralizedServer.listeners`): it measures round
  durations (from one RoundTrain to the next) and keeps what each member reported in the
  metadata of its witnesses (loss, tokens/s, bandwidth, evaluation scores), and the run's loss
  curve (the median of the reported losses, per step). It hears only witnesses the coordinator
  accepted, at the step they were accepted in (one per member and round), so a member cannot
  add points, steps or outliers by sending more. Bounded: at most `MAX_POINTS` steps.
* `snapshot(server, history)` copies what a page shows into a `StatusSnapshot`;
  `status_json` and `render_html` are pure functions of a snapshot.
* `serve_status` is the HTTP shell: HTTP/1.0 `GET` only, one request per connection, the
  request (line and headers) at most `MAX_REQUEST_BYTES` and complete within the limits'
  handshake timeout, connections admitted through `psyche.transport.Admission`
  (a cap per remote address and in total, the oldest evicted), so a stranger holds at most a
  few small buffers for a few seconds. It binds to loopback unless told otherwise.
"""

from __future__ import annotations

import html
import json
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from psyche.coordinator.run_state import RunState
from psyche.core.drop_log import DropLog
from psyche.transport import Admission, ConnectionLimits

if TYPE_CHECKING:
    # trio-stubs (trio-typing's, a libp2p dependency) shadow trio's own types and predate
    # trio.TaskStatus: the type is trio_typing's there.
    from trio_typing import TaskStatus

    from psyche.centralized.server import CentralizedServer
    from psyche.coordinator.run_state import WitnessMetadata
    from psyche.core.node_identity import NodeIdentity

log = logging.getLogger(__name__)

MAX_POINTS = 500
"""Steps of loss curve and round durations kept (the page shows them all)."""
MAX_REQUEST_BYTES = 8192
DEFAULT_REFRESH_SECONDS = 5
STATUS_LIMITS = ConnectionLimits(
    max_pending=32, max_pending_per_address=4, handshake_timeout=5.0, send_stall_timeout=10.0
)
"""Connections a status page holds: 32 in all, 4 per remote address, 5 s to send a request."""


# --------------------------------------------------------------------------------------------
# What the server reports


@dataclass(frozen=True)
class MemberReport:
    """A member's latest witness statistics."""

    step: int
    loss: float | None
    tokens_per_sec: float
    bandwidth_per_sec: float
    evals: dict[str, float]
    at: float


class StatusHistory:
    """Listens to a `CentralizedServer` (add it to `server.listeners`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self.round_durations: deque[tuple[int, float]] = deque(maxlen=MAX_POINTS)
        self.rounds_measured = 0
        self.reports: dict[str, MemberReport] = {}
        self._step_losses: dict[int, list[float]] = {}
        self._round_start: tuple[int, float] | None = None
        self._last: tuple[RunState, int] | None = None

    def state_changed(self, server: CentralizedServer) -> None:
        coordinator = server.coordinator
        key = (coordinator.run_state, coordinator.progress.step)
        if key == self._last:
            return
        self._last = key
        if coordinator.run_state is RunState.RoundTrain:
            now = self._clock()
            step = coordinator.progress.step
            if self._round_start is not None and self._round_start[0] == step - 1:
                self.round_durations.append((step - 1, now - self._round_start[1]))
                self.rounds_measured += 1
            self._round_start = (step, now)
        elif coordinator.run_state not in (RunState.RoundWitness, RunState.RoundTrain):
            self._round_start = None

    def witness(self, sender: NodeIdentity, step: int, metadata: WitnessMetadata) -> None:
        """A witness the coordinator accepted at `step` (the current step), and what its sender
        reported with it."""
        loss = float(metadata.loss) if math.isfinite(metadata.loss) else None
        self.reports[str(sender)] = MemberReport(
            step=step,
            loss=loss,
            tokens_per_sec=float(metadata.tokens_per_sec),
            bandwidth_per_sec=float(metadata.bandwidth_per_sec),
            evals={e.name: float(e.value) for e in metadata.evals},
            at=time.time(),
        )
        if loss is not None:
            self._step_losses.setdefault(step, []).append(loss)
            while len(self._step_losses) > MAX_POINTS:
                del self._step_losses[min(self._step_losses)]

    def uptime(self) -> float:
        return self._clock() - self.started

    def loss_curve(self) -> list[tuple[int, float]]:
        """(step, median of the losses members reported with that step's accepted witnesses:
        one member lying among three cannot move it)."""
        return [(s, statistics.median(v)) for s, v in sorted(self._step_losses.items())]


# --------------------------------------------------------------------------------------------
# A snapshot and its two renderings


@dataclass(frozen=True)
class MemberStatus:
    id: str
    state: str
    """Healthy, Dropped, Withdrawn or Ejected (the coordinator's `ClientState`)."""
    connected: bool
    report: MemberReport | None = None


@dataclass(frozen=True)
class VerificationStatus:
    """One thing verification did (`ServerCore.verification_log`): `kind` "verified" (`by`
    recomputed `subject`'s result of `batch`: `matches`, `score`), "followed" (`by` rebuilt its
    commitment exactly: `matches`) or "punished" (`reason`)."""

    step: int
    kind: str
    subject: str
    by: str | None
    batch: str
    matches: bool | None
    score: float | None
    reason: str


@dataclass(frozen=True)
class StatusSnapshot:
    run_id: str
    run_state: str
    epoch: int
    step: int
    total_steps: int
    round_height: int | None
    members: list[MemberStatus]
    pending: int
    """Clients waiting to join at the next epoch."""
    connected: int
    round_durations: list[tuple[int, float]]
    loss_curve: list[tuple[int, float]]
    uptime_seconds: float
    generated_at: float = field(default_factory=time.time)
    verification: list[VerificationStatus] = field(default_factory=list)
    """Verifiers' findings and punishments, newest first (runs with verification_percent > 0)."""


def snapshot(server: CentralizedServer, history: StatusHistory) -> StatusSnapshot:
    """What the page shows, copied from the running server."""
    coordinator = server.coordinator
    connected = {bytes(k) for k in server.connected_clients()}
    round_ = coordinator.current_round()
    members = [
        MemberStatus(
            id=str(c.id),
            state=c.state.name,
            connected=c.id.signer in connected,
            report=history.reports.get(str(c.id)),
        )
        for c in coordinator.epoch_state.clients
    ]
    return StatusSnapshot(
        run_id=coordinator.run_id,
        run_state=coordinator.run_state.name,
        epoch=coordinator.progress.epoch,
        step=coordinator.progress.step,
        total_steps=coordinator.config.total_steps,
        round_height=None if round_ is None else round_.height,
        members=members,
        pending=len(server.core.pending_clients),
        connected=len(connected),
        round_durations=list(history.round_durations),
        loss_curve=history.loss_curve(),
        uptime_seconds=history.uptime(),
        verification=[
            VerificationStatus(
                e.step,
                e.kind,
                str(e.subject),
                None if e.by is None else str(e.by),
                e.batch,
                e.matches,
                e.score,
                e.reason,
            )
            for e in reversed(server.core.verification_log)
        ],
    )


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def status_json(snap: StatusSnapshot) -> dict[str, Any]:
    """The `/status.json` document (strict JSON: no NaN)."""
    doc = asdict(snap)
    doc["round_durations"] = [{"step": s, "seconds": d} for s, d in snap.round_durations]
    doc["loss_curve"] = [{"step": s, "loss": v} for s, v in snap.loss_curve]
    return {k: _clean(v) for k, v in doc.items()}


def _loss_svg(points: list[tuple[int, float]], width: int = 600, height: int = 160) -> str:
    if len(points) < 2:
        return "<p>no loss reported yet</p>"
    steps = [s for s, _ in points]
    losses = [v for _, v in points]
    s0, s1 = min(steps), max(steps)
    lo, hi = min(losses), max(losses)
    span_s, span_l = max(s1 - s0, 1), max(hi - lo, 1e-9)
    coords = " ".join(
        f"{(s - s0) / span_s * (width - 10) + 5:.1f},{(hi - v) / span_l * (height - 10) + 5:.1f}"
        for s, v in points
    )
    return (
        f'<svg id="loss-chart" width="{width}" height="{height}" role="img" '
        f'aria-label="loss from {losses[0]:.4f} to {losses[-1]:.4f}">'
        f'<polyline fill="none" stroke="steelblue" stroke-width="2" points="{coords}"/></svg>'
        f"<p>loss {hi:.4f} (max) … {lo:.4f} (min), steps {s0}–{s1}</p>"
    )


def _num(value: float | None, digits: int = 4) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _verification_html(events: list[VerificationStatus]) -> str:
    """Who verified whom, what was found, who was punished (nothing in a run without it)."""
    if not events:
        return ""
    e = html.escape
    rows = []
    for v in events[:40]:
        if v.kind == "punished":
            found = f"<b>punished</b>: {e(v.reason)}"
        elif v.kind == "followed":  # a follower's exact rebuild (`psyche.coordinator.following`)
            verdict = "the same, bit for bit" if v.matches else "<b>not the same</b>"
            found = f"{e(v.by or '')} rebuilt its commitment: {verdict}"
        else:
            verdict = "matches" if v.matches else "<b>does not match</b>"
            found = f"{e(v.by or '')} recomputed it: {verdict} (score {_num(v.score, 3)})"
        rows.append(
            f'<tr class="verification {e(v.kind)}"><td>{v.step}</td><td>{e(v.subject)}</td>'
            f"<td>{e(v.batch)}</td><td>{found}</td></tr>"
        )
    return (
        '<h2>Verification</h2>\n<table id="verification"><thead><tr><th>step</th>'
        "<th>trainer / member</th><th>batch</th><th>found</th></tr></thead><tbody>\n"
        + "".join(rows)
        + "\n</tbody></table>\n"
    )


def render_html(snap: StatusSnapshot, refresh_seconds: int = DEFAULT_REFRESH_SECONDS) -> str:
    """The HTML page: run state, progress, members with their health and latest report, round
    durations and the loss curve (an inline SVG). Every value from clients is escaped."""
    e = html.escape
    rows = []
    for m in snap.members:
        r = m.report
        evals = "" if r is None else ", ".join(f"{e(k)} {v:.3f}" for k, v in r.evals.items())
        rows.append(
            f'<tr class="member"><td class="id">{e(m.id)}</td><td class="state">{e(m.state)}</td>'
            f'<td class="connected">{"yes" if m.connected else "no"}</td>'
            f"<td>{'' if r is None else r.step}</td><td>{_num(None if r is None else r.loss)}</td>"
            f"<td>{'' if r is None else f'{r.tokens_per_sec:,.0f}'}</td><td>{evals}</td></tr>"
        )
    durations = snap.round_durations[-20:]
    duration_rows = "".join(
        f"<tr><td>{s}</td><td>{d:.2f}</td></tr>" for s, d in reversed(durations)
    )
    height = "–" if snap.round_height is None else str(snap.round_height)
    verification = _verification_html(snap.verification)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{int(refresh_seconds)}">
<title>Psyche run {e(snap.run_id)}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 8px;text-align:left}}</style>
</head><body>
<h1>Run <span id="run-id">{e(snap.run_id)}</span></h1>
<p>State <b id="run-state">{e(snap.run_state)}</b>, epoch <span id="epoch">{snap.epoch}</span>,
step <span id="step">{snap.step}</span> of <span id="total-steps">{snap.total_steps}</span>,
round {height}; {snap.connected} connected, {snap.pending} waiting to join; up
{snap.uptime_seconds:.0f} s.</p>
<h2>Members ({len(snap.members)})</h2>
<table id="members"><thead><tr><th>client</th><th>health</th><th>connected</th><th>step</th>
<th>loss</th><th>tokens/s</th><th>evals</th></tr></thead><tbody>
{"".join(rows)}
</tbody></table>
{verification}<h2>Loss</h2>
{_loss_svg(snap.loss_curve)}
<h2>Round durations</h2>
<table id="rounds"><thead><tr><th>step</th><th>seconds</th></tr></thead><tbody>
{duration_rows}
</tbody></table>
<p><a href="/status.json">status.json</a></p>
</body></html>
"""


# --------------------------------------------------------------------------------------------
# The HTTP shell


def _response(status: str, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def respond(
    request_head: bytes,
    get_snapshot: Callable[[], StatusSnapshot],
    refresh_seconds: int = DEFAULT_REFRESH_SECONDS,
) -> bytes:
    """The whole response to a request's head (its request line and headers)."""
    line = request_head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response("400 Bad Request", "text/plain", b"bad request\n")
    method, target = parts[0], parts[1].split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return _response("405 Method Not Allowed", "text/plain", b"GET only\n")
    if target == "/status.json":
        body = json.dumps(status_json(get_snapshot())).encode()
        out = _response("200 OK", "application/json", body)
    elif target in ("/", "/index.html"):
        body = render_html(get_snapshot(), refresh_seconds).encode()
        out = _response("200 OK", "text/html; charset=utf-8", body)
    else:
        return _response("404 Not Found", "text/plain", b"not found\n")
    if method == "HEAD":
        return out.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
    return out


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    buffer = bytearray()
    while b"\r\n\r\n" not in buffer and b"\n\n" not in buffer:
        chunk = await stream.receive_some(MAX_REQUEST_BYTES)
        if not chunk:
            return None
        buffer += chunk
        if len(buffer) > MAX_REQUEST_BYTES:
            return None
    return bytes(buffer)


async def serve_status(
    get_snapshot: Callable[[], StatusSnapshot],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    limits: ConnectionLimits = STATUS_LIMITS,
    refresh_seconds: int = DEFAULT_REFRESH_SECONDS,
    task_status: TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the page until cancelled; `task_status.started` gets the bound (host, port)."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    drops = DropLog(log, "status page connections dropped")
    admission = Admission(limits, drops)
    bound = listeners[0].socket.getsockname()
    log.info("status page on http://%s:%d/", bound[0], bound[1])

    async def handle(stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()[0]
        except OSError:
            peer = "?"
        async with stream:
            with admission.pending_connection(peer):
                with trio.move_on_after(limits.handshake_timeout) as timer:
                    try:
                        head = await _read_head(stream)
                        if head is None:
                            reply = _response("400 Bad Request", "text/plain", b"bad request\n")
                        else:
                            reply = respond(head, get_snapshot, refresh_seconds)
                        await stream.send_all(reply)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        return
                if timer.cancelled_caught:
                    drops.note("slow", f"status page: {peer} too slow, closed", logging.DEBUG)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drops.run)
        task_status.started((bound[0], bound[1]))
        await trio.serve_listeners(handle, listeners, handler_nursery=nursery)


__all__ = [
    "MAX_REQUEST_BYTES",
    "MemberReport",
    "MemberStatus",
    "StatusHistory",
    "StatusSnapshot",
    "render_html",
    "respond",
    "serve_status",
    "snapshot",
    "status_json",
]
