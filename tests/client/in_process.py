"""The in-process run the client tests share: a tiny Llama's config and a learnable token
stream on disk, the run's coordinator state (its timers scaled to this machine), whole clients
against an `InProcessServer` on loopback (`three_client_run`: one whose rounds a missing result
cuts short; `run_beside_server`: members that end by themselves), and the structured fields of
what they logged."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import trio

from psyche.client.client import Client
from psyche.client.round.broadcast import open_network
from psyche.client.setup.init import RunInitConfig
from psyche.client.setup.model_loading import preload_modeling
from psyche.client.testing import InProcessBackend, InProcessServer, local_run_state
from psyche.coordinator import Coordinator
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.modeling.configs import llama_config_dict
from psyche.network.connection import NetworkConfig

from ..polling import poll_until
from ..timing import scale_config_timers, scaled, scaled_timer

if TYPE_CHECKING:
    from psyche.network import NetworkConnection

SEQ = 32
RUN_ID = "in-process"


def write_run(tmp_path: Path) -> tuple[Path, Path]:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(llama_config_dict("tiny")))
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    # a learnable token stream: a fixed random walk over a small bigram table
    rng = np.random.default_rng(0)
    successors = rng.integers(0, 256, size=(256, 2))
    stream = np.empty(SEQ * 400, dtype=np.uint16)
    stream[0] = 1
    for i in range(1, len(stream)):
        stream[i] = successors[stream[i - 1], rng.integers(0, 2)]
    (data_dir / "tokens.ds").write_bytes(stream.astype("<u2").tobytes())
    return model_dir, data_dir


def coordinator(model_dir: Path, data_dir: Path) -> Coordinator:
    """The run, its timers scaled to this machine's speed (`tests/timing.py`)."""
    state = local_run_state(model_dir, data_dir, run_id=RUN_ID, seq_len=SEQ, lr=3e-3)
    scale_config_timers(state.config)
    return state


def member_key(number: int) -> SecretKey:
    """Member `number`'s key (the same number gives the same identity in every test)."""
    return SecretKey.from_bytes(number.to_bytes(32, "big"))


def identities(*numbers: int) -> list[NodeIdentity]:
    return [NodeIdentity.from_single_key(member_key(n).public_key) for n in numbers]


@asynccontextmanager
async def client_parts(
    server: InProcessServer, number: int, checkpoint_dir: Path | None = None
) -> AsyncIterator[tuple[InProcessBackend, NetworkConnection, RunInitConfig]]:
    """What a `Client` of member `number` is made of: its backend joined to `server`'s run, its
    network on 127.0.0.1 and its init settings (checkpoints kept in `checkpoint_dir` if given);
    leaving the block closes the network and disconnects the backend."""
    from psyche.client.checkpoints.store import CheckpointConfig

    key = member_key(number)
    identity = NodeIdentity.from_single_key(key.public_key)
    checkpoint = None if checkpoint_dir is None else CheckpointConfig(checkpoint_dir)
    init = RunInitConfig(identity, key, RUN_ID, device="cpu", checkpoint=checkpoint)
    config = NetworkConfig(run_id=RUN_ID, secret_key=key, bind_host="127.0.0.1")
    async with (
        open_network(config) as network,
        server.connect(identity, RUN_ID) as backend,
    ):
        yield backend, network, init


async def run_client(
    server: InProcessServer,
    number: int,
    kind: type[Client] = Client,
    started: list[Client] | None = None,
    checkpoint_dir: Path | None = None,
) -> None:
    """Client `number` (a `kind`, appended to `started`, its checkpoints kept in
    `checkpoint_dir` if given) until cancelled or it ends."""
    async with client_parts(server, number, checkpoint_dir) as (backend, network, init):
        client = kind(backend, network, init)
        if started is not None:
            started.append(client)
        await client.run()


async def run_client_until_finished(
    server: InProcessServer, number: int, checkpoint_dir: Path | None
) -> Client:
    """A client that must end by itself (its `run()` returns) once the run is Finished."""
    async with client_parts(server, number, checkpoint_dir) as parts:
        client = Client(*parts)
        await client.run()
    return client


def run_beside_server(
    server: InProcessServer, seconds: float, *members: Callable[[], Awaitable[object]]
) -> None:
    """`server` running while each of `members` (a task each, side by side) runs to its own
    end, which must come within `scaled(seconds)`; then the server is stopped."""

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            with trio.fail_after(scaled(seconds)):
                async with trio.open_nursery() as side_by_side:
                    for member in members:
                        side_by_side.start_soon(member)
            nursery.cancel_scope.cancel()

    trio.run(scenario)


def fields(records: list[logging.LogRecord], name: str) -> list[dict]:  # type: ignore[type-arg]
    return [r.psyche_fields for r in records if r.getMessage() == name]


LATE_ROUND_SECS = 2
"""`max_round_train_time` of the three-client runs (seconds on the tuning machine, scaled): a round
whose results are all in ends once its witness has them (within a second here: a step of one
batch of 4 x 32 tokens takes milliseconds); only a round some result never reaches (a late, junk
or dropped member's) waits the whole time out, and those are what these tests make. With the
harness's 5 s each such round waited 3 s more, for nothing."""


def three_client_run(
    tmp_path: Path, epoch_time: int, server: type[InProcessServer] = InProcessServer
) -> InProcessServer:
    """A `server` (no bans) for a run that starts with three clients, its rounds cut short at
    `LATE_ROUND_SECS`."""
    preload_modeling()
    state = coordinator(*write_run(tmp_path))
    state.config.epoch_time = scaled_timer(epoch_time)
    state.config.max_round_train_time = scaled_timer(LATE_ROUND_SECS)
    state.config.init_min_clients = 3
    return server(state, ban_epochs=0)


async def wait_until(condition: Callable[[], bool]) -> None:
    await poll_until(condition, 0.1)
