"""What a client reports about each round, and who hears it: experiment trackers (`--wandb-*`,
`--tensorboard-dir`, `--metrics-jsonl`, `--oltp-*`), the terminal dashboard, the events file.

One source of truth: the state machine (`steps`) measures a round once, into a `RoundReport`;
the progress line is formatted from it, and the same report goes to every `RunObserver`.
`round_metrics` turns a report into the tracker keys of `psyche.metrics.names` (upstream's
W&B keys, plus this port's round timings and byte counts), a pure function.

A report is handed over when its round is over (the client left the round's witness step),
so it carries the round's witness and download times too; the progress line is logged when
the round's training ends, from the same numbers.

    observers = Observers([TrackerObserver(tracker), dashboard])
    observers.on_round(report)        # never raises: a failing observer is dropped, once
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from psyche.metrics import names

if TYPE_CHECKING:
    from psyche.client.observe.verification import VerificationTally
    from psyche.coordinator import Coordinator
    from psyche.core.node_identity import NodeIdentity
    from psyche.metrics import MetricValue, Tracker, TrackerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NetworkNumbers:
    """The client's network at one moment."""

    peers: int = 0
    bytes_sent: int = 0
    """Payload and model bytes served to peers since the start."""
    bytes_received: int = 0
    """Bytes of peers' results downloaded since the start."""
    bandwidth: float = 0.0
    """Current receive bandwidth, bytes per second."""
    reachability: str = ""
    """Whether peers can dial this client, its relays and hole punches, in one line
    (`ReachabilityStatus.summary`)."""


@dataclass(frozen=True)
class RoundReport:
    """One finished round as this client saw it. Durations are seconds from the round's start
    (this client's training step starting); None where the round had none (no witness duty, no
    peer result downloaded)."""

    step: int
    epoch: int
    total_steps: int
    round_height: int
    num_clients: int
    loss: float | None
    """Mean loss of the batches this client trained (None: no batch this round)."""
    lr: float | None
    tokens_per_sec: float | None
    """The whole run's tokens per second over the recent steps (as the progress line)."""
    total_tokens: int
    global_token_batch_size: int
    efficiency: float | None
    seconds_left: float | None
    trained: int
    """Batches this client trained in the round."""
    train_seconds: float
    distro_seconds: float
    download_seconds: float | None = None
    witness_seconds: float | None = None
    network: NetworkNumbers = field(default_factory=NetworkNumbers)
    eval_scores: Mapping[str, float] = field(default_factory=dict)
    eval_partial: tuple[str, ...] = ()
    """The tasks of `eval_scores` whose score is partial (fewer documents than the task)."""
    optim_stats: Mapping[str, float] = field(default_factory=dict)
    at: float = field(default_factory=time.time)
    """Unix time the report was made."""


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def round_metrics(report: RoundReport) -> dict[str, MetricValue]:
    """The tracker values of one round (names from `psyche.metrics.names`); a value the
    round does not have is left out rather than logged as 0."""
    out: dict[str, MetricValue] = {
        names.COORDINATOR_STEP: report.step,
        names.COORDINATOR_EPOCH: report.epoch,
        names.COORDINATOR_ROUND: report.round_height,
        names.COORDINATOR_NUM_CLIENTS: report.num_clients,
        names.TRAIN_TOTAL_TOKENS: report.total_tokens,
        names.TRAIN_GLOBAL_TOKEN_BATCH_SIZE: report.global_token_batch_size,
        names.ROUND_TRAIN_SECONDS: report.train_seconds,
        names.ROUND_DISTRO_SECONDS: report.distro_seconds,
        names.P2P_PEERS: report.network.peers,
        names.P2P_UPLOAD_BYTES: report.network.bytes_sent,
        names.P2P_DOWNLOAD_BYTES: report.network.bytes_received,
        names.P2P_BANDWIDTH: report.network.bandwidth,
    }
    if _finite(report.loss):
        assert report.loss is not None
        out[names.TRAIN_LOSS] = report.loss
        out[names.TRAIN_PERPLEXITY] = math.exp(min(report.loss, 700.0))
        out[names.TRAIN_CONFIDENCE] = math.exp(-report.loss)
    for key, value in (
        (names.TRAIN_LR, report.lr),
        (names.TRAIN_TOKENS_PER_SEC, report.tokens_per_sec),
        (names.TRAIN_EFFICIENCY, report.efficiency),
        (names.ROUND_DOWNLOAD_SECONDS, report.download_seconds),
        (names.ROUND_WITNESS_SECONDS, report.witness_seconds),
    ):
        if _finite(value):
            assert value is not None
            out[key] = value
    for task, score in report.eval_scores.items():
        if _finite(score):
            out[names.eval_key(task, partial=task in report.eval_partial)] = score
    for stat, value in report.optim_stats.items():
        if _finite(value):
            out[names.OPTIM_PREFIX + stat] = value
    return out


# --------------------------------------------------------------------------------------------
# Round timings


@dataclass
class RoundTimes:
    """When things happened in one round (monotonic seconds), measured by the state machine."""

    started: float
    distro_seconds: float = 0.0
    witness_sent: float | None = None
    last_download: float | None = None

    def since_start(self, at: float | None) -> float | None:
        return None if at is None else max(0.0, at - self.started)


class RoundClock:
    """The `RoundTimes` of the rounds still open (the current one and the one before: its
    payloads may still arrive), by step."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._rounds: dict[int, RoundTimes] = {}

    def start(self, step: int) -> None:
        self._rounds[step] = RoundTimes(self._clock())
        for old in [s for s in self._rounds if s < step - 1]:
            del self._rounds[old]

    def witness_sent(self, step: int) -> None:
        times = self._rounds.get(step)
        if times is not None and times.witness_sent is None:
            times.witness_sent = self._clock()

    def downloaded(self, step: int) -> None:
        times = self._rounds.get(step)
        if times is not None:
            times.last_download = self._clock()

    def get(self, step: int) -> RoundTimes | None:
        return self._rounds.get(step)


def complete_report(report: RoundReport, times: RoundTimes | None) -> RoundReport:
    """`report` with the witness and download times its round ended with."""
    if times is None:
        return report
    return replace(
        report,
        download_seconds=times.since_start(times.last_download),
        witness_seconds=times.since_start(times.witness_sent),
    )


# --------------------------------------------------------------------------------------------
# Observers


class RunObserver(Protocol):
    """Who hears about the run: every method is called on the client's trio loop, must return
    quickly (no I/O: hand it to a thread) and may be a no-op."""

    def on_state(self, state: Coordinator) -> None: ...

    def on_round(self, report: RoundReport) -> None: ...

    def on_evals(
        self, step: int, scores: Mapping[str, float], partial: frozenset[str] = frozenset()
    ) -> None:
        """`partial`: the tasks whose score is over fewer documents than the task holds."""
        ...

    def on_finished(self, summary: Mapping[str, Any]) -> None: ...


class Observers:
    """Several observers as one. One that raises is dropped with one warning (a dashboard
    that broke must not stop training)."""

    def __init__(self, observers: Iterable[RunObserver] = ()) -> None:
        self.observers: list[RunObserver] = list(observers)

    def add(self, observer: RunObserver) -> None:
        self.observers.append(observer)

    def _each(self, method: str, *args: Any) -> None:
        for observer in list(self.observers):
            try:
                getattr(observer, method)(*args)
            except Exception as e:
                self.observers = [o for o in self.observers if o is not observer]
                log.warning(
                    "%s failed and is off for the rest of the run: %s",
                    type(observer).__name__,
                    e,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )

    def on_state(self, state: Coordinator) -> None:
        self._each("on_state", state)

    def on_round(self, report: RoundReport) -> None:
        self._each("on_round", report)

    def on_evals(
        self, step: int, scores: Mapping[str, float], partial: frozenset[str] = frozenset()
    ) -> None:
        self._each("on_evals", step, scores, partial)

    def on_finished(self, summary: Mapping[str, Any]) -> None:
        self._each("on_finished", summary)


class TrackerObserver:
    """Rounds into a `Tracker` (`round_metrics` per step, with what verification did by then:
    `psyche.client.observe.verification`), the run summary as its summary.

    Without a `verification` tally of its own, it makes one and hears this process's
    verification events until the run's end (`on_finished`)."""

    def __init__(self, tracker: Tracker, verification: VerificationTally | None = None) -> None:
        from psyche.client.observe.verification import VerificationEvents, VerificationTally

        self.tracker = tracker
        self._events: VerificationEvents | None = None
        if verification is None:
            verification = VerificationTally()
            self._events = VerificationEvents(verification).attach()
        self.verification = verification

    def on_state(self, state: Coordinator) -> None:
        pass

    def on_round(self, report: RoundReport) -> None:
        values = round_metrics(report)
        values.update(self.verification.take(report.step).metrics())
        self.tracker.log(values, report.step)

    def on_evals(
        self, step: int, scores: Mapping[str, float], partial: frozenset[str] = frozenset()
    ) -> None:
        pass  # the next round's report carries them

    def on_finished(self, summary: Mapping[str, Any]) -> None:
        if self._events is not None:
            self._events.detach()
            self._events = None
        values: dict[str, MetricValue] = {}
        for key in ("step", "epochs", "final_loss", "tokens_per_sec", "wall_secs"):
            value = summary.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                values[f"summary/{key}"] = value
        if values:
            self.tracker.log_summary(values)


def client_tracker(
    trackers: TrackerConfig,
    identity: NodeIdentity | str,
    service: str,
    *,
    run_id: str,
    run_config: Mapping[str, Any] = MappingProxyType({}),
) -> Tracker:
    """The trackers `trackers` asks for (`psyche.metrics.build_tracker`; a `NoopTracker`
    when none), for this client of run `run_id`. `service` is the OpenTelemetry service name
    (upstream's `psyche-centralized-client` / `psyche-solana-client`); the W&B run defaults to
    `<run id>-<identity>` as upstream, its config is the run and identity and `run_config`. A
    tracker that cannot work is a `TrackerConfigError` (one line); nothing here touches the
    network."""
    from psyche.metrics import ServiceInfo, build_tracker

    return build_tracker(
        trackers,
        service=ServiceInfo.from_env(service, str(identity), run_id=run_id, scope="psyche_client"),
        run_name=f"{run_id}-{identity}",
        run_config={"run_id": run_id, "identity": str(identity), **run_config},
    )


__all__ = [
    "NetworkNumbers",
    "Observers",
    "RoundClock",
    "RoundReport",
    "RoundTimes",
    "RunObserver",
    "TrackerObserver",
    "client_tracker",
    "complete_report",
    "round_metrics",
]
