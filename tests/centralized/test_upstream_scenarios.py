"""Upstream's centralized integration tests (testing/tests/integration_tests.rs), replayed against
the real server over TCP with dummy-training clients (no model), as upstream runs them.

Upstream's timings (warmup 20 s, rounds of 5 s + 2 s, cooldown 3 s, epochs of 30 s, 2 s of extra
waiting, `--init-warmup-time 20`) run on a server clock 20x the wall clock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from psyche.centralized.server import CentralizedServer, open_server
from psyche.centralized.testing import DummyTrainer, fast_options
from psyche.coordinator import Coordinator, RunState
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.testing import integration_test_coordinator

from ..polling import poll_until

SPEED = 20.0


def seconds(upstream_seconds: float) -> float:
    return upstream_seconds / SPEED


def scenario(
    init_min_clients: int,
    global_batch_size: int,
    witness_nodes: int,
    body: Callable[[CentralizedServer, Any], Awaitable[None]],
) -> None:
    async def main() -> None:
        coordinator = integration_test_coordinator(
            init_min_clients, global_batch_size, witness_nodes
        )
        options = fast_options(SPEED, init_warmup_time=20)
        async with open_server(coordinator, options) as server, trio.open_nursery() as nursery:

            async def spawn(
                count: int = 1, delay: float = 2.0, warmup: float = 2.0
            ) -> list[DummyTrainer]:
                trainers = []
                for _ in range(count):
                    trainers.append(
                        await DummyTrainer.start(
                            nursery,
                            f"127.0.0.1:{server.port}",
                            coordinator.run_id,
                            training_delay=seconds(delay),
                            warmup_delay=seconds(warmup),
                        )
                    )
                    await trio.sleep(0.01)
                return trainers

            with trio.fail_after(60):
                await body(server, spawn)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def until(server: CentralizedServer, predicate: Callable[[Coordinator], bool]) -> None:
    await poll_until(lambda: predicate(server.coordinator), 0.005)


async def reached(server: CentralizedServer, state: RunState, since: int = 0) -> int:
    """Wait until the run has entered `state` (after `since` transitions); the transitions seen
    so far. States can be brief, so the server's transition log is read, not its current state."""
    while True:
        transitions = list(server.transitions)
        for i in range(since, len(transitions)):
            if transitions[i][1] is state:
                return i + 1
        await trio.sleep(0.005)


def healthy_score(coordinator: Coordinator, round_index: int) -> int:
    witnesses = coordinator.epoch_state.rounds[round_index].witnesses
    return sum(
        coordinator.trainer_healthy_score_by_witnesses(c.id, witnesses)
        for c in coordinator.epoch_state.clients
    )


def test_connect_multiple_nodes() -> None:
    async def body(server: CentralizedServer, spawn: Any) -> None:
        await spawn(10)
        await until(server, lambda c: len(server.core.pending_clients) == 10)
        await trio.sleep(seconds(4))
        assert server.coordinator.run_state is RunState.WaitingForMembers

    scenario(15, 4, 1, body)


def test_waiting_for_members_to_round_witness() -> None:
    async def body(server: CentralizedServer, spawn: Any) -> None:
        mark = 0
        assert server.coordinator.run_state is RunState.WaitingForMembers
        await spawn(2, delay=10)
        mark = await reached(server, RunState.Warmup, mark)
        assert len(server.coordinator.epoch_state.clients) == 2
        mark = await reached(server, RunState.RoundTrain, mark)
        mark = await reached(server, RunState.RoundWitness, mark)
        assert len(server.coordinator.epoch_state.clients) == 2

    scenario(2, 4, 1, body)


def test_shutdown_node_in_warmup() -> None:
    async def body(server: CentralizedServer, spawn: Any) -> None:
        mark = 0
        trainers = await spawn(2, warmup=100)  # still loading the model
        mark = await reached(server, RunState.Warmup, mark)
        trainers[1].stop()
        mark = await reached(server, RunState.WaitingForMembers, mark)
        assert len(server.coordinator.epoch_state.clients) == 1
        assert len(server.core.pending_clients) == 1

    scenario(2, 4, 1, body)


def test_validate_all_clients_participate_in_witness_bloom() -> None:
    async def body(server: CentralizedServer, spawn: Any) -> None:
        mark = 0
        assert server.coordinator.epoch_state.rounds_head == 0
        assert server.coordinator.epoch_state.rounds[0].witnesses == []
        await spawn(5)
        mark = await reached(server, RunState.RoundTrain, mark)
        await until(server, lambda c: c.epoch_state.rounds_head == 2)
        # one witness attests all five trainers
        assert healthy_score(server.coordinator, 1) == 5

    scenario(5, 5, 1, body)


def test_finish_epoch_then_p2p_checkpoint() -> None:
    async def body(server: CentralizedServer, spawn: Any) -> None:
        mark = 0
        await spawn(2)
        mark = await reached(server, RunState.RoundTrain, mark)
        for head in (1, 2, 3):
            await until(server, lambda c, h=head: c.epoch_state.rounds_head == h)
        mark = await reached(server, RunState.Cooldown, mark)
        await until(server, lambda c: c.progress.epoch == 1)
        checkpoint = server.coordinator.model.value.checkpoint  # type: ignore[attr-defined]
        assert isinstance(checkpoint, Checkpoint.P2P)  # Dummy -> P2P at the end of the epoch

    scenario(2, 2, 1, body)


def test_client_join_in_training() -> None:
    async def body(server: CentralizedServer, spawn: Any) -> None:
        mark = 0
        await spawn(2)
        mark = await reached(server, RunState.RoundTrain, mark)
        await spawn(1)
        await until(server, lambda c: len(server.core.pending_clients) == 3)
        assert len(server.coordinator.epoch_state.clients) == 2
        await until(server, lambda c: c.epoch_state.rounds_head == 2)
        assert healthy_score(server.coordinator, 1) == 2
        await until(server, lambda c: c.progress.epoch == 1)
        mark = await reached(server, RunState.Warmup, mark)
        assert len(server.coordinator.epoch_state.clients) == 3

    scenario(2, 2, 1, body)


def test_shutdown_node_in_training_and_complete_round() -> None:
    async def body(server: CentralizedServer, spawn: Any) -> None:
        mark = 0
        trainers = await spawn(3)
        mark = await reached(server, RunState.RoundTrain, mark)
        assert len(server.coordinator.epoch_state.clients) == 3
        trainers[0].stop()
        mark = await reached(server, RunState.RoundWitness, mark)
        # the withdrawn client leaves at the round's end: fewer than min_clients, so cooldown
        mark = await reached(server, RunState.Cooldown, mark)
        mark = await reached(server, RunState.WaitingForMembers, mark)
        await spawn(1)
        mark = await reached(server, RunState.Warmup, mark)
        assert len(server.coordinator.epoch_state.clients) == 3

    scenario(3, 3, 2, body)
