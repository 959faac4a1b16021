"""A joiner the run drops while it waits for its peers to serve the model stops waiting and
joins again (real client, real nodes on loopback; the coordinator's states scripted).

Before, the client stayed "initializing": its model download went on asking the peers, which
serve only in a warmup, until the next warmup, and then loaded a model of an epoch it was not
in (or was refused by peers it was no longer a member for), and it never sent `Join` again."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from psyche.client.client import Client
from psyche.client.round.broadcast import open_network
from psyche.client.setup.init import RunInitConfig
from psyche.client.setup.model_loading import preload_modeling
from psyche.coordinator import Coordinator, HubRepo, RunState
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.run_state import Client as Member
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.network.connection import NetworkConfig
from psyche.network.sharable_model import SharableModel
from psyche.network.testing import serve_model, wait_until
from psyche.network.ticket import BlobTicket
from psyche.network.transmittable import ModelRequestType

from .in_process import RUN_ID, coordinator, write_run
from .scripted_coordinator import WAIT_SECS, ScriptedCoordinator


def _state(base: Coordinator, run_state: RunState, members: list[NodeIdentity]) -> Coordinator:
    state = base.copy()
    state.run_state = run_state
    state.progress.step = 5  # the run has trained: its model comes from the peers
    state.epoch_state.clients = [Member(identity) for identity in members]
    return state


def test_a_joiner_dropped_while_it_waits_for_the_model_stops_and_joins_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preload_modeling()
    base = coordinator(*write_run(tmp_path))
    llm = base.model.value
    assert isinstance(llm.checkpoint, Checkpoint.Hub)
    llm.checkpoint = Checkpoint.P2P(HubRepo(llm.checkpoint.value.repo_id))
    keys = [SecretKey.from_bytes(n.to_bytes(32, "big")) for n in (1, 2)]
    joiner_id, peer_id = (NodeIdentity.from_single_key(k.public_key) for k in keys)

    async def main() -> None:
        async with (
            open_network(NetworkConfig(RUN_ID, keys[0], bind_host="127.0.0.1")) as joiner,
            open_network(NetworkConfig(RUN_ID, keys[1], bind_host="127.0.0.1")) as peer,
            trio.open_nursery() as nursery,
        ):
            peer.set_allowed_peers([joiner.endpoint_id, peer.endpoint_id])
            # the peer's warmup is over: it serves no model now (as after any warmup)
            nursery.start_soon(serve_model, peer, SharableModel())
            joiner.address_book.add(peer.endpoint_addr())
            asked: list[ModelRequestType] = []
            ask_one = joiner.request_model_blob_ticket

            async def counting(
                who: bytes, request: ModelRequestType
            ) -> tuple[BlobTicket, int | None]:
                asked.append(request)
                return await ask_one(who, request)

            monkeypatch.setattr(joiner, "request_model_blob_ticket", counting)
            backend = ScriptedCoordinator()
            client = Client(
                backend, joiner, RunInitConfig(joiner_id, keys[0], RUN_ID, device="cpu")
            )
            nursery.start_soon(client.run)

            await backend.states.send(_state(base, RunState.Warmup, [joiner_id, peer_id]))
            await wait_until(lambda: len(asked) >= 2, WAIT_SECS)  # it waits for the peer
            assert client.stage == "initializing"

            # a health check dropped it: the round goes on without it
            await backend.states.send(_state(base, RunState.RoundTrain, [peer_id]))
            await wait_until(lambda: client.stage == "waiting", WAIT_SECS)
            assert backend.rejoins == 1
            stopped_at = len(asked)
            await trio.sleep(5.0)  # the download asked every 2 s while it waited
            assert len(asked) == stopped_at
            assert client.machine is None
            nursery.cancel_scope.cancel()

    trio.run(main)
