"""The figures of a chaos run, computed from the clients' JSON events (the functional core).

Inputs are plain lists of event dicts (`round_start`, `applied_results`, `loaded_model`,
`cooldown_model`, `trained_batch`) and fault records; nothing here touches a process.
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Event = Mapping[str, Any]

_BATCH = re.compile(r"(\d+)\D+(\d+)")


def batch_bounds(batch: str) -> tuple[int, int]:
    """`"B[3, 5]"` -> (3, 5)."""
    match = _BATCH.search(batch)
    if match is None:
        raise ValueError(f"not a batch id: {batch!r}")
    return int(match.group(1)), int(match.group(2))


def batch_key(batch: str) -> tuple[int, int]:
    return batch_bounds(batch)


def batch_sequences(batch: str) -> int:
    start, end = batch_bounds(batch)
    return end - start + 1


def of(events: Iterable[Event], message: str) -> list[Event]:
    return [e for e in events if e.get("message") == message]


def applied_tokens(events: Iterable[Event], seq_len: int, t0: float, t1: float) -> int:
    """Tokens in the batches a client applied between `t0` and `t1` (wall clock)."""
    total = 0
    for e in of(events, "applied_results"):
        if t0 <= e["ts"] < t1:
            total += sum(batch_sequences(b) for b in e["batches"]) * seq_len
    return total


def median_round_seconds(rounds: Sequence[tuple[float, int]]) -> float | None:
    """The median time between the starts of consecutive rounds of one epoch, from the server's
    (time, epoch) of each `RoundTrain` transition: how fast the run trains while it trains,
    leaving out the epoch boundaries (cooldown, waiting for members, warmup)."""
    gaps = [
        later - earlier
        for (earlier, epoch), (later, next_epoch) in itertools.pairwise(rounds)
        if epoch == next_epoch
    ]
    return statistics.median(gaps) if gaps else None


@dataclass(frozen=True)
class LostAssignment:
    step: int
    batch: str
    owner: str
    ts: float
    """When the round started (the reference client's `round_start`)."""


def lost_assignments(reference: Sequence[Event]) -> list[LostAssignment]:
    """Batches assigned in a round whose results were never applied two rounds later, seen by
    one client that was in both rounds (every honest client applies the same)."""
    applied: dict[int, set[tuple[int, int]]] = {}
    for e in of(reference, "applied_results"):
        applied[e["step"]] = {batch_key(b) for b in e["batches"]}
    lost = []
    for e in of(reference, "round_start"):
        done = applied.get(e["step"] + 2)
        if done is None:
            continue  # the epoch ended (nothing trains in its last rounds) or the log did
        for assignment in e["assignments"]:
            batch, _, owner = assignment.rpartition("=")
            if batch_key(batch) not in done:
                lost.append(LostAssignment(e["step"], batch, owner, e["ts"]))
    return lost


@dataclass(frozen=True)
class Fault:
    t: float
    kind: str
    target: str
    detail: str = ""
    until: float | None = None
    """When the fault ended (a pause, a partition, a latency window)."""
    owner: str | None = None
    """The short client id of the target, when it is a client."""


def lost_per_fault(
    lost: Sequence[LostAssignment], faults: Sequence[Fault], round_secs: float
) -> list[int]:
    """For each fault aimed at a client, its assignments lost from one round before the fault
    began until two rounds after it ended (a departed client: until it came back)."""
    counts = []
    for fault in faults:
        if fault.owner is None:
            continue
        start = fault.t - round_secs
        end = (fault.until or fault.t) + 2 * round_secs
        counts.append(sum(1 for x in lost if x.owner == fault.owner and start <= x.ts <= end))
    return counts


@dataclass
class ModelAgreement:
    identical: bool
    """No disagreement was found and at least one epoch was compared (nothing compared is no
    evidence of agreement)."""
    epochs_checked: int
    """Epochs whose cooldown hash was logged by two clients or more."""
    joiners_checked: int
    problems: list[str] = field(default_factory=list)


def model_agreement(clients: Mapping[str, Sequence[Event]]) -> ModelAgreement:
    """Every client's weights at each cooldown hash alike, and every client that loaded the
    model from its peers got exactly the model they had at the previous cooldown."""
    by_epoch: dict[int, dict[str, str]] = {}
    for name, events in clients.items():
        for e in of(events, "cooldown_model"):
            by_epoch.setdefault(e["epoch"], {})[name] = e["model_hash"]
    problems = []
    for epoch, hashes in sorted(by_epoch.items()):
        if len(set(hashes.values())) > 1:
            problems.append(f"epoch {epoch}: cooldown hashes differ: {hashes}")
    joiners = 0
    for name, events in clients.items():
        for e in of(events, "loaded_model"):
            if "P2P" not in str(e.get("checkpoint", "")):
                continue
            expected = set(by_epoch.get(e["epoch"] - 1, {}).values())
            if not expected:
                continue  # no cooldown of that epoch was logged by anyone
            joiners += 1
            if e["model_hash"] not in expected:
                problems.append(
                    f"{name} loaded {e['model_hash'][:12]} in epoch {e['epoch']}, "
                    f"peers had {sorted(h[:12] for h in expected)}"
                )
    checked = sum(1 for hashes in by_epoch.values() if len(hashes) >= 2)
    if checked == 0:
        problems.append("no epoch's cooldown hash was logged by two clients: nothing compared")
    return ModelAgreement(not problems, checked, joiners, problems)


def applied_agreement(clients: Mapping[str, Sequence[Event]]) -> list[str]:
    """Steps at which two clients applied different batches (should be none)."""
    seen: dict[int, tuple[str, list[str]]] = {}
    problems = []
    for name, events in clients.items():
        for e in of(events, "applied_results"):
            batches = sorted(e["batches"], key=batch_key)
            if e["step"] in seen and seen[e["step"]][1] != batches:
                other, theirs = seen[e["step"]]
                problems.append(f"step {e['step']}: {name} applied {batches}, {other} {theirs}")
            seen.setdefault(e["step"], (name, batches))
    return problems


@dataclass(frozen=True)
class Rejoin:
    client: str
    restarted: float
    loaded: float | None
    first_trained: float | None
    rounds_waited: int | None
    """Rounds the run went through between the model being loaded and the client training."""
    hash_identical: bool | None

    @property
    def seconds(self) -> float | None:
        return None if self.first_trained is None else self.first_trained - self.restarted


def rejoin(
    client: str,
    restarted: float,
    events: Sequence[Event],
    peers: Mapping[str, Sequence[Event]],
    round_starts: Sequence[float],
) -> Rejoin:
    """How a replacement started at `restarted` came back: when it had the model, whether that
    model was its peers' (hash), and when it trained again."""
    loaded = next((e for e in of(events, "loaded_model") if e["ts"] >= restarted), None)
    trained = next((e for e in of(events, "trained_batch") if e["ts"] >= restarted), None)
    identical = None
    if loaded is not None:
        expected = {
            e["model_hash"]
            for evs in peers.values()
            for e in of(evs, "cooldown_model")
            if e["epoch"] == loaded["epoch"] - 1
        }
        if "P2P" in str(loaded.get("checkpoint", "")) and expected:
            identical = loaded["model_hash"] in expected
        elif not expected:
            identical = None  # loaded from the repo (no epoch finished yet)
    first_round = next(
        (e for e in of(events, "round_start") if e["ts"] >= restarted and e["assigned"]), None
    )
    waited = None
    if loaded is not None and first_round is not None:
        # the server's RoundTrain lines since the model was loaded, less the round it trains in
        waited = max(0, sum(1 for t in round_starts if loaded["ts"] <= t < first_round["ts"]) - 1)
    return Rejoin(
        client,
        restarted,
        None if loaded is None else loaded["ts"],
        None if trained is None else trained["ts"],
        waited,
        identical,
    )
