"""Benchmark the coordinator's per-round work against the server's 500 ms tick.

For 1, 16, 64 and 256 clients (up to 32 witnesses), each row is the median of several runs
(time.perf_counter), in milliseconds and as a share of one tick, beside a baseline measured in
the same run:

* tick: a tick that changes nothing, and the tick that ends a round and starts the next;
  baseline: postcard-encoding the coordinator, which the server does after every tick;
* witnesses: the round's witness messages (the last one moves the round to its witness phase);
  baseline: the same code computing each position with psyche.core's `compute_shuffled_index`
  per message, as upstream does, instead of the per-seed cache;
* committee selection: `CommitteeSelection.from_coordinator` plus every client's committee and
  witness proof; baseline: per-index `compute_shuffled_index`;
* data assignment: `assign_data_for_state`; baseline: a literal port of upstream's loop;
* full round: the witnesses plus the ticks of one round (1 s witness phase = 2 idle ticks, then
  the round-ending tick). Goal: under 0.2% of a tick at 256 clients.

Every run uses a fresh round seed, so the per-seed caches start cold as in a real round. As in
timeit, the cyclic garbage collector is paused while a run is timed.

Run: .venv/bin/python scripts/bench/coordinator.py [--repeats N]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from psyche.coordinator import (
    Committee,
    CommitteeSelection,
    Coordinator,
    RunState,
    assign_data_for_state,
)
from psyche.coordinator import committee_selection as committee_module
from psyche.coordinator.testing import (
    integration_test_coordinator,
    round_witness_for,
    simulated_identity,
)
from psyche.core import (
    BatchId,
    compute_shuffled_index,
    deterministic_shuffle,
    sha256,
    sha256v,
)

TICK_SECONDS = 0.5
CLIENT_COUNTS = (1, 16, 64, 256)
GOAL_SHARE = 0.002
BLOOM_KEYS = list(range(1, 9))
IDLE_TICKS = 2


def training(clients: int) -> Coordinator:
    """A coordinator in the second round of an epoch with `clients` clients."""
    witness_nodes = min(clients, 32)
    coordinator = integration_test_coordinator(clients, 1024, witness_nodes)
    coordinator.config.round_witness_time = 1
    ids = [simulated_identity(i) for i in range(clients)]
    coordinator.tick(ids, 1_000, 1)
    coordinator.tick(None, 1_020, 2)
    assert coordinator.run_state is RunState.RoundTrain
    for sender, witness in witnesses(coordinator):
        coordinator.witness(sender, witness, 1_021)
    coordinator.tick(None, 1_022, 3)
    assert coordinator.run_state is RunState.RoundTrain
    return coordinator


def witnesses(coordinator: Coordinator) -> list[tuple[Any, Any]]:
    ids = [c.id for c in coordinator.epoch_state.clients]
    found = []
    for i, node in enumerate(ids):
        witness = round_witness_for(coordinator, i, participants=ids, bloom_keys=BLOOM_KEYS)
        if witness is not None:
            found.append((node, witness))
    return found


@contextmanager
def uncached_shuffle() -> Iterator[None]:
    """Compute every position from scratch, as upstream does."""
    original = committee_module.shuffled_index
    committee_module.shuffled_index = compute_shuffled_index  # type: ignore[assignment]
    try:
        yield
    finally:
        committee_module.shuffled_index = original


def upstream_assign(coordinator: Coordinator) -> dict[BatchId, Any]:
    """Upstream's `assign_data_for_state`, line by line, with per-index shuffles."""
    round_ = coordinator.current_round()
    assert round_ is not None
    seed = sha256v((sha256(round_.random_seed.to_bytes(8, "little")), b"committee"))
    trainers = []
    for i, client in enumerate(coordinator.epoch_state.clients):
        position = compute_shuffled_index(i, round_.clients_len, seed)
        committee = Committee.Trainer if position >= 0 else Committee.TieBreaker
        if committee is Committee.Trainer:
            trainers.append(client)
    deterministic_shuffle(trainers, round_.random_seed)
    total = coordinator.get_target_global_batch_size(round_)
    base, remainder = divmod(total, len(trainers))
    out = {}
    current = round_.data_index
    for k, node in enumerate(trainers):
        size = base + (1 if k < remainder else 0)
        if size > 0:
            out[BatchId(current, current + size - 1)] = node.id
            current += size
    return out


class Bench:
    def __init__(self, clients: int, repeats: int) -> None:
        self.base = training(clients)
        self.repeats = repeats
        self.seed = 10_000

    def fresh(self) -> Coordinator:
        """A copy of the round with a new seed (and cold caches)."""
        self.seed += 1
        coordinator = self.base.copy()
        round_ = coordinator.current_round()
        assert round_ is not None
        round_.random_seed = self.seed * 0x9E3779B97F4A7C15 % 2**64
        return coordinator

    def median(self, prepare: Callable[[], Any], run: Callable[[Any], Any]) -> float:
        samples = []
        for _ in range(self.repeats + 1):
            state = prepare()
            committee_module.clear_caches()
            # as timeit does: no cyclic-GC pass (triggered by the preparation's allocations)
            # inside the timed region
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                run(state)
                samples.append(time.perf_counter() - start)
            finally:
                gc.enable()
        return statistics.median(samples[1:])

    # ---- the measured work -------------------------------------------------------------------

    def round_messages(self) -> tuple[Coordinator, list[tuple[Any, Any]]]:
        coordinator = self.fresh()
        return coordinator, witnesses(coordinator)

    @staticmethod
    def send_witnesses(state: tuple[Coordinator, list[tuple[Any, Any]]]) -> None:
        coordinator, messages = state
        for sender, witness in messages:
            coordinator.witness(sender, witness, 1_023)

    @staticmethod
    def full_round(state: tuple[Coordinator, list[tuple[Any, Any]]]) -> None:
        coordinator, messages = state
        for sender, witness in messages:
            coordinator.witness(sender, witness, 1_023)
        for _ in range(IDLE_TICKS):
            coordinator.tick(None, 1_023, 77)
        coordinator.tick(None, 1_024, 77)
        assert coordinator.run_state is RunState.RoundTrain

    @staticmethod
    def idle_tick(coordinator: Coordinator) -> None:
        coordinator.tick(None, 1_022, 5)

    def witness_phase(self) -> Coordinator:
        coordinator, messages = self.round_messages()
        self.send_witnesses((coordinator, messages))
        return coordinator

    @staticmethod
    def round_end_tick(coordinator: Coordinator) -> None:
        coordinator.tick(None, 1_024, 5)
        assert coordinator.run_state is RunState.RoundTrain

    @staticmethod
    def selection(coordinator: Coordinator) -> None:
        selection = CommitteeSelection.from_coordinator(coordinator, 0)
        for i in range(len(coordinator.epoch_state.clients)):
            selection.get_committee(i)
            selection.get_witness(i)

    @staticmethod
    def assignment(coordinator: Coordinator) -> None:
        assign_data_for_state(coordinator, CommitteeSelection.from_coordinator(coordinator, 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    print(
        f"coordinator per-round work, median of {args.repeats} runs; "
        f"tick = {TICK_SECONDS * 1000:.0f} ms"
    )
    header = (
        f"{'clients':>7} {'operation':<26}{'ms':>9}{'% tick':>9}  "
        f"{'baseline':<22}{'ms':>9}{'x faster':>10}"
    )
    print(header)
    print("-" * len(header))
    full_round_share = {}
    for clients in CLIENT_COUNTS:
        bench = Bench(clients, args.repeats)
        sample = bench.fresh()
        assert assign_data_for_state(
            sample, CommitteeSelection.from_coordinator(sample, 0)
        ) == upstream_assign(sample)

        encode = bench.median(bench.fresh, lambda c: c.to_bytes())
        witness_state = bench.witness_phase
        rows: list[tuple[str, float, str, float]] = [
            ("tick, nothing due", bench.median(bench.fresh, bench.idle_tick), "encode", encode),
            (
                "tick, round end + start",
                bench.median(witness_state, bench.round_end_tick),
                "encode",
                bench.median(witness_state, lambda c: c.to_bytes()),
            ),
        ]
        ours_witness = bench.median(bench.round_messages, bench.send_witnesses)
        ours_selection = bench.median(bench.fresh, bench.selection)
        ours_round = bench.median(bench.round_messages, bench.full_round)
        with uncached_shuffle():
            base_witness = bench.median(bench.round_messages, bench.send_witnesses)
            base_selection = bench.median(bench.fresh, bench.selection)
            base_round = bench.median(bench.round_messages, bench.full_round)
        witness_count = len(witnesses(bench.base))
        rows += [
            (f"witnesses x{witness_count}", ours_witness, "per-message shuffle", base_witness),
            ("committee selection, all", ours_selection, "per-index shuffle", base_selection),
            (
                "data assignment",
                bench.median(bench.fresh, bench.assignment),
                "upstream loop",
                bench.median(bench.fresh, upstream_assign),
            ),
            ("full round", ours_round, "per-message shuffle", base_round),
        ]
        for name, ours, base_name, base in rows:
            print(
                f"{clients:>7} {name:<26}{ours * 1e3:>9.3f}{ours / TICK_SECONDS * 100:>8.3f}%  "
                f"{base_name:<22}{base * 1e3:>9.3f}{base / ours:>10.2f}"
            )
        full_round_share[clients] = ours_round / TICK_SECONDS
    share = full_round_share[256]
    verdict = "met" if share < GOAL_SHARE else "NOT met"
    print(
        f"\nfull round at 256 clients: {share * 100:.3f}% of a tick "
        f"(goal < {GOAL_SHARE * 100:.1f}%): {verdict}"
    )


if __name__ == "__main__":
    main()
