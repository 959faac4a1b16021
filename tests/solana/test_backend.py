"""The Solana backend end to end: scripted clients follow a run through a whole epoch over the
local endpoint's JSON-RPC and websockets, and survive the RPC endpoint going away."""

from __future__ import annotations

import pytest
import trio

from psyche.coordinator import ClientState, RunState
from psyche.coordinator.backend import Backend
from psyche.coordinator.model import Checkpoint, HubRepo
from psyche.solana import admin
from psyche.solana.backend import Cluster, SolanaBackendError
from psyche.solana.follower import follow_run
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.localnet.ledger import Ledger, ManualClock
from psyche.solana.localnet.server import start_localnet

from ..polling import poll_until
from .scripted import (
    START,
    Driver,
    ScriptedClient,
    config,
    create_run,
    make_backend,
    open_localnet,
    tiny_model,
)
from .support import open_run


def test_three_clients_run_an_epoch_with_a_health_check_and_a_checkpoint() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ledger, cluster, owner, account = await open_run(nursery, config())

            lazy = make_backend(ledger, cluster)
            lazy_signers = {bytes(lazy.get_payer())}
            clients = [
                ScriptedClient(
                    "a",
                    make_backend(ledger, cluster),
                    lazy_signers,
                    health_checker=True,
                    checkpointer=True,
                ),
                ScriptedClient("b", make_backend(ledger, cluster), lazy_signers),
                ScriptedClient("lazy", lazy, lazy_signers),
            ]
            async with follow_run(owner, "e2e", account) as observer:
                assert isinstance(observer, Backend)
                for client in clients:
                    await nursery.start(client.run, account)
                driver = Driver(ledger, owner, observer)

                async def expect_health_check_and_checkpoint(d: Driver) -> None:
                    state = d.state
                    assert state is not None
                    round_ = state.current_round()
                    if round_ is not None and round_.height >= 2:
                        # the lazy client is dropped by the health check sent in this round
                        await d.wait_for(
                            lambda s: all(
                                c.state is not ClientState.Healthy
                                for c in s.epoch_state.clients
                                if c.id.signer in lazy_signers
                            ),
                            "health check",
                        )
                    if round_ is not None and round_.height >= 1:
                        await d.wait_for(
                            lambda s: (
                                s.model.value.checkpoint
                                == Checkpoint.Hub(HubRepo("psyche/tiny", "step-1"))
                            ),
                            "checkpoint",
                        )

                final = await driver.run_epoch(3, between_rounds=expect_health_check_and_checkpoint)

            assert final.progress.epoch == 1
            assert final.run_state is RunState.WaitingForMembers
            assert driver.history.count(RunState.RoundWitness) >= 6
            assert RunState.Cooldown in driver.history
            assert RunState.RoundWitness in driver.history
            assert final.progress.step > 4
            # The lazy trainer was dropped at height 2 and left the epoch.
            assert [c.state for c in final.epoch_state.exited_clients] == [ClientState.Dropped]
            assert final.epoch_state.exited_clients[0].id.signer in lazy_signers
            # After a completed epoch the checkpoint is served peer to peer.
            assert final.model.value.checkpoint == Checkpoint.P2P(HubRepo("psyche/tiny", "step-1"))
            account_state = (await owner.get_coordinator_account(account)).state
            earned = {c.id.signer: c.earned for c in account_state.clients_state.clients}
            for client in clients[:2]:
                assert earned[bytes(client.backend.get_payer())] == 1000 // 2
            assert earned[bytes(lazy.get_payer())] == 0
            # The lazy client learnt it was dropped and left, as upstream's client exits.
            assert clients[2].left == "the coordinator says this client is Dropped"
            assert clients[0].left is None
            assert clients[1].left is None
            for client in clients:
                assert client.runner is not None
                assert client.runner.failed_sends == 0, client.name
                assert client.runner.completed_sends > 0
                assert client.states_seen > 10
            # The P2P identity each client joined with is what the run recorded.
            identities = {
                c.id.signer: c.id.p2p_identity for c in account_state.clients_state.clients
            }
            for client in clients:
                assert identities[client.identity.signer] == client.identity.p2p_identity
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_rpc_going_away_mid_run_is_survived() -> None:
    """Two endpoints over one chain: the client's primary goes away mid-epoch (it falls back to the
    backup), comes back, then the backup goes away (it returns to the primary)."""

    async def main() -> None:
        ledger = Ledger(clock=ManualClock(START))
        async with trio.open_nursery() as nursery:
            primary = await start_localnet(nursery, ledger)
            backup = await start_localnet(nursery, ledger)
            primary_cluster = Cluster(primary.rpc_url, primary.ws_url)
            backup_cluster = Cluster(backup.rpc_url, backup.ws_url)
            owner = make_backend(ledger, [primary_cluster, backup_cluster])
            account = await create_run(owner, config(init_min_clients=1, min_clients=1))
            client = ScriptedClient("solo", make_backend(ledger, [primary_cluster, backup_cluster]))
            await nursery.start(client.run, account)
            events: list[str] = []

            async def outages(d: Driver) -> None:
                state = d.state
                assert state is not None
                height = state.current_round().height
                if height == 1 and not events:
                    await primary.stop()
                    events.append("primary down")
                elif height == 3 and events == ["primary down"]:
                    await primary.start()
                    # wait until the client's websocket is subscribed to the primary again
                    with trio.fail_after(10):
                        await poll_until(lambda: primary.server.websocket_clients, 0.05)
                    await backup.stop()
                    events.append("primary back, backup down")

            async with follow_run(owner, "e2e", account) as observer:
                driver = Driver(ledger, owner, observer)
                final = await driver.run_epoch(1, between_rounds=outages)

            assert events == ["primary down", "primary back, backup down"]
            assert final.progress.epoch == 1
            assert final.run_state is RunState.WaitingForMembers
            assert client.runner is not None
            assert client.runner.failed_sends == 0
            account_state = (await owner.get_coordinator_account(account)).state
            (solo,) = account_state.clients_state.clients
            assert solo.earned == 1000  # the only finished client gets the whole epoch's reward
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_wait_for_new_state_is_cancel_safe() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ledger, _, owner, account = await open_run(nursery, config())
            async with follow_run(owner, "e2e", account) as runner:
                first = await runner.wait_for_new_state()
                assert first.run_state is RunState.WaitingForMembers
                with trio.move_on_after(0.2):
                    await runner.wait_for_new_state()  # nothing happens: cancelled
                ledger.advance_clock(1)
                other = runner.subscribe()
                runner.send_tick()
                state = await runner.wait_for_new_state()
                assert state.run_state is RunState.WaitingForMembers
                assert (await other.receive()).run_state is RunState.WaitingForMembers
                assert runner.latest.nonce > 0
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_auto_tick_moves_the_run_on_its_clock() -> None:
    """No driver: the client's own tick check advances the run when its timeouts expire."""

    async def main() -> None:
        clock = ManualClock(START)
        async with trio.open_nursery() as nursery:
            run_config = config(init_min_clients=1, min_clients=1)
            ledger, cluster, _, account = await open_run(nursery, run_config, clock)
            client = make_backend(ledger, cluster)
            async with follow_run(client, "e2e", account) as runner:
                nursery.start_soon(lambda: runner.auto_tick(interval=0.02, now=clock.now))
                await runner.join_run(ScriptedClient("x", client).identity)
                seen = []
                with trio.fail_after(10):
                    while RunState.Warmup not in seen:
                        if not seen:
                            ledger.advance_clock(1)  # the extra wait for members expires
                        seen.append((await runner.wait_for_new_state()).run_state)
                # the tick that did it was the runner's own (the join's tick came too early)
                with trio.fail_after(10):
                    await poll_until(lambda: runner.completed_sends >= 1, 0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_join_without_authorization_fails_clearly() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ledger, _, cluster = await open_localnet(nursery)
            owner = make_backend(ledger, cluster)
            created = await admin.create_run(owner, "private", "test")  # no authorization
            await owner.send_and_retry(
                "Configure",
                [
                    coordinator_ix.coordinator_update(
                        "private",
                        created.account_address,
                        owner.get_payer(),
                        config=config(),
                        model=tiny_model(),
                    )
                ],
            )
            client = make_backend(ledger, cluster)
            identity = ScriptedClient("x", client).identity
            with pytest.raises(SolanaBackendError, match="has not authorized everyone"):
                await client.join_run(created.instance_address, created.account_address, identity)
            # The join authority authorizes a grantee; someone else is still refused.
            grantee = make_backend(ledger, cluster)
            await admin.join_authorization_create(owner, grantee.get_payer())
            with pytest.raises(SolanaBackendError, match="does not cover"):
                await client.join_run(
                    created.instance_address,
                    created.account_address,
                    identity,
                    authorizer=grantee.get_payer(),
                )
            me = ScriptedClient("g", grantee).identity
            await grantee.join_run(
                created.instance_address,
                created.account_address,
                me,
                authorizer=grantee.get_payer(),
            )
            state = (await owner.get_coordinator_account(created.account_address)).state
            assert [c.id.signer for c in state.clients_state.clients] == [me.signer]
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_client_leaves_when_the_run_is_paused() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            run_config = config(init_min_clients=1, min_clients=1)
            ledger, cluster, owner, account = await open_run(nursery, run_config)
            client = ScriptedClient("x", make_backend(ledger, cluster))
            async with follow_run(owner, "e2e", account) as observer:
                await nursery.start(client.run, account)
                driver = Driver(ledger, owner, observer)
                await driver.next_state()
                await driver._wait_for_joins(1)
                await admin.set_paused(owner, "e2e", True)  # not mid-round: pauses at once
                with trio.fail_after(10):
                    await poll_until(lambda: client.left is not None, 0.01)
            assert client.left == "the run is Paused"
            nursery.cancel_scope.cancel()

    trio.run(main)
