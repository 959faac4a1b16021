"""Issue 24, item 3, over loopback TCP: a witness whose message arrives after its round is not
banned and the run goes on; a member banned for keeping silent is back after its ban without
joining again (before, both sat connected outside the pending set and a run that needed them
waited in WaitingForMembers forever).

The server ticks as a loaded one does (`LOADED`: three seconds of its clock a tick, missed
ticks skipped), so a cooldown passes in one tick: the case where the ban's kick was not undone
by a later cooldown tick."""

from __future__ import annotations

import trio

from psyche.centralized.server import open_server
from psyche.centralized.testing import DummyTrainer, ProtocolClient, fast_options
from psyche.coordinator.run_state import RunState
from psyche.coordinator.testing import quick_coordinator

from .servers import addr, eventually

TRAINING = (RunState.RoundTrain, RunState.RoundWitness)
LOADED = {"tick_interval": 0.3}  # the clock runs 10 s a second: a tick every 3 s of it


def test_a_late_witness_is_not_banned_and_the_run_goes_on() -> None:
    # two clients, both needed to start an epoch; one witness a round; long epochs, so that an
    # epoch ends only when a round has no witness
    coordinator = quick_coordinator(init_min_clients=2, epoch_time=600)

    async def main() -> None:
        async with (
            open_server(coordinator, fast_options(**LOADED)) as server,
            trio.open_nursery() as n,
        ):
            address = addr(server)
            honest = await DummyTrainer.start(n, address, "test-run")
            late = await DummyTrainer.start(n, address, "test-run", late=True)
            # the first round the late one is elected witness of ends without a witness: every
            # client is withdrawn and the epoch ends; its witness arrives in the cooldown
            await eventually(lambda: server.coordinator.progress.epoch >= 1, 60)
            assert not server.core.banned
            both = {honest.identity, late.identity}
            await eventually(
                lambda: (
                    server.coordinator.run_state in TRAINING
                    and {c.id for c in server.coordinator.epoch_state.clients} == both
                ),
                60,
            )
            assert server.coordinator.progress.epoch >= 1
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_banned_member_is_back_after_its_ban_without_joining_again() -> None:
    coordinator = quick_coordinator(init_min_clients=2)  # epochs of 8 s (0.8 s here)

    async def main() -> None:
        async with (
            open_server(coordinator, fast_options(**LOADED)) as server,
            trio.open_nursery() as n,
        ):
            address = addr(server)
            for _ in range(2):
                await DummyTrainer.start(n, address, "test-run")
            silent = await ProtocolClient.connect(address)  # joins once, then only listens
            await silent.join("test-run")

            async def listen() -> None:
                while True:
                    await silent.receive()
                    silent.received.clear()

            n.start_soon(listen)
            await eventually(lambda: silent.identity in server.core.banned, 120)
            ban = server.core.banned[silent.identity]
            # it sits out the epochs of its ban, its Join kept; then it is a member again
            await eventually(
                lambda: (
                    server.coordinator.progress.epoch >= ban.until_epoch
                    and server.coordinator.run_state in TRAINING
                ),
                120,
            )
            assert silent.identity in {c.id for c in server.coordinator.epoch_state.clients}
            n.cancel_scope.cancel()

    trio.run(main)
