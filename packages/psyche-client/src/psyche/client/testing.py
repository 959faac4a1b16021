"""A coordinator server and its backends inside one trio loop, for tests and research (as
`trio.testing` is for trio).

`InProcessServer` is the centralized server's shell without sockets: a `ServerCore` (the server's
rules, `psyche.coordinator.server_core`) on the real clock, ticked every 500 ms, whose states go
to every connected backend whenever the rules say to broadcast. It adds no rule of its own. Each
`InProcessBackend` is one client's `psyche.coordinator.backend.Backend` (and
`EndpointDiscovery`, `Rejoin`, `RunIdentity`): it receives every state the server broadcasts,
in order.

    server = InProcessServer(load_state_toml("state.toml"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        async with server.connect(identity, "my-run") as backend:
            await Client(backend, network, config).run()

`local_run_state` is the state such a run starts from when its model and tokens are files on
this machine (tests, benchmarks, notebooks).
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import trio

from psyche.coordinator.backend import HealthCheck, OpportunisticData
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.server_core import DEFAULT_BAN_EPOCHS, ServerCore
from psyche.core.definitions import ConstantLR, Distro, LearningRateSchedule, OptimizerDefinition
from psyche.core.node_identity import NodeIdentity

logger = logging.getLogger(__name__)

TICK_INTERVAL_SECS = 0.5


class BackendDisconnected(ConnectionError):
    """The server went away (or this backend was disconnected)."""


class InProcessServer:
    """The server of a run inside this process; the state it starts from is prepared as
    `psyche-server run` prepares a state file (`ServerCore.start`)."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        tick_interval: float = TICK_INTERVAL_SECS,
        withdraw_on_disconnect: bool = True,
        init_warmup_time: int | None = None,
        ban_epochs: int = DEFAULT_BAN_EPOCHS,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        run_identity: str | None = None,
    ) -> None:
        self.tick_interval = tick_interval
        # which instance of the run this is (`RunIdentity`): a new one unless given, as a
        # server started afresh (give the same one to stand for a server resumed from its save)
        self.run_identity = run_identity or secrets.token_hex(16)
        self.clock = clock
        self.rng = rng or random.Random()
        self.core = ServerCore.start(
            coordinator,
            now=self.now(),
            init_warmup_time=init_warmup_time,
            withdraw_on_disconnect=withdraw_on_disconnect,
            ban_epochs=ban_epochs,
        )
        self.backends: dict[bytes, InProcessBackend] = {}
        self.records: dict[bytes, bytes] = {}

    @property
    def coordinator(self) -> Coordinator:
        return self.core.coordinator

    def now(self) -> int:
        return int(self.clock())

    # ---- the loop ------------------------------------------------------------------------------

    # `Any`: trio-stubs (trio-typing's, a libp2p dependency) predate trio.TaskStatus.
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for drop_log in self.core.drop_logs:
                    nursery.start_soon(drop_log.run)
                task_status.started()
                while True:
                    self.tick()
                    await trio.sleep(self.tick_interval)
        finally:
            for backend in list(self.backends.values()):
                backend._close()

    def tick(self) -> None:
        self.core.on_tick(self.now(), self.rng.getrandbits(64))
        self._post_state_change(broadcast=True)

    def _post_state_change(self, *, broadcast: bool) -> None:
        self.core.after_change()
        if broadcast:
            for backend in self.backends.values():
                backend._deliver(self.coordinator.copy())

    # ---- messages ------------------------------------------------------------------------------

    def join(self, identity: NodeIdentity, run_id: str) -> None:
        self.core.on_join(identity, run_id)

    def disconnect(self, identity: NodeIdentity) -> None:
        self.backends.pop(identity.signer, None)
        self.records.pop(identity.signer, None)
        self.core.on_disconnect(identity)
        self._post_state_change(broadcast=False)

    def witness(self, identity: NodeIdentity, data: OpportunisticData) -> None:
        broadcast = self.core.on_witness(identity, data, self.now(), self.rng.getrandbits(64))
        self._post_state_change(broadcast=broadcast)

    def health_check(self, identity: NodeIdentity, checks: list[HealthCheck]) -> None:
        self._post_state_change(broadcast=self.core.on_health_check(identity, checks))

    def checkpoint(self, identity: NodeIdentity, checkpoint: Checkpoint) -> None:
        self._post_state_change(broadcast=self.core.on_checkpoint(identity, checkpoint))

    # ---- backends --------------------------------------------------------------------------

    @asynccontextmanager
    async def connect(self, identity: NodeIdentity, run_id: str) -> AsyncIterator[InProcessBackend]:
        """A backend for `identity`, joined to `run_id`; leaving the block disconnects it."""
        backend = InProcessBackend(self, identity, run_id)
        self.backends[identity.signer] = backend
        self.join(identity, run_id)
        try:
            yield backend
        finally:
            if self.backends.get(identity.signer) is backend:
                self.disconnect(identity)
            backend._close()


class InProcessBackend:
    """One client's view of an `InProcessServer` (upstream's centralized client backend)."""

    def __init__(self, server: InProcessServer, identity: NodeIdentity, run_id: str) -> None:
        self.server = server
        self.identity = identity
        self.run_id = run_id
        self._send, self._receive = trio.open_memory_channel[Coordinator](math.inf)
        self.connected = True

    def _deliver(self, state: Coordinator) -> None:
        if self.connected:
            self._send.send_nowait(state)

    def _close(self) -> None:
        self.connected = False
        self._send.close()

    def _check(self) -> None:
        if not self.connected:
            raise BackendDisconnected("disconnected from the in-process server")

    async def wait_for_new_state(self) -> Coordinator:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise BackendDisconnected("the in-process server closed the connection") from None

    async def send_witness(self, opportunistic_data: OpportunisticData) -> None:
        self._check()
        self.server.witness(self.identity, opportunistic_data)

    async def send_health_check(self, health_checks: list[HealthCheck]) -> None:
        self._check()
        self.server.health_check(self.identity, health_checks)

    async def send_checkpoint(self, checkpoint: Checkpoint) -> None:
        self._check()
        self.server.checkpoint(self.identity, checkpoint)

    async def rejoin(self) -> None:
        self._check()
        self.server.join(self.identity, self.run_id)

    def run_identity(self) -> str:
        return self.server.run_identity

    async def publish_endpoint(self, record: bytes) -> None:
        self._check()
        self.server.records[self.identity.signer] = bytes(record)

    def peer_endpoints(self) -> list[bytes]:
        return [r for k, r in self.server.records.items() if k != self.identity.signer]

    def disconnect(self) -> None:
        """Drop the connection as a crashed client would (the server withdraws it)."""
        if self.connected:
            self.server.disconnect(self.identity)
            self._close()


def local_run_state(
    model_dir: str | os.PathLike[str],
    data_dir: str | os.PathLike[str],
    *,
    run_id: str,
    seq_len: int,
    lr: float,
    **config: int,
) -> Coordinator:
    """A run waiting for members: the Hugging Face Llama whose `config.json` is in `model_dir`
    (no weights: every client builds the same ones from the fixed seed), the token files in
    `data_dir`, DisTrO (chunk 16, top-k 8, 1-bit) at a constant `lr`, one witness a round and
    batches of 4 sequences of `seq_len` tokens. `config` overrides `CoordinatorConfig` fields
    (times in seconds; two clients start the run, one keeps it going)."""
    from psyche.coordinator import (
        CoordinatorConfig,
        CoordinatorProgress,
        HubRepo,
        LLMTrainingDataLocation,
        RunState,
    )
    from psyche.coordinator.model import LLM, LLMArchitecture, LLMTrainingDataType, Model

    llm = LLM(
        max_seq_len=seq_len,
        cold_start_warmup_steps=0,
        architecture=LLMArchitecture.HfLlama,
        checkpoint=Checkpoint.Hub(HubRepo(str(model_dir))),
        data_type=LLMTrainingDataType.Pretraining,
        data_location=LLMTrainingDataLocation.Local(str(data_dir)),
        lr_schedule=LearningRateSchedule.Constant(ConstantLR(lr, 0.0, 0)),
        optimizer=OptimizerDefinition.Distro(
            Distro(
                clip_grad_norm=1.0,
                compression_decay=0.999,
                compression_topk=8,
                compression_chunk=16,
                quantize_1bit=True,
            )
        ),
    )
    settings: dict[str, Any] = {
        "warmup_time": 4,
        "cooldown_time": 1,
        "max_round_train_time": 5,
        "round_witness_time": 1,
        "global_batch_size_warmup_tokens": 0,
        "epoch_time": 5,
        "total_steps": 1000,
        "init_min_clients": 2,
        "min_clients": 1,
        "witness_nodes": 1,
        "global_batch_size_start": 4,
        "global_batch_size_end": 4,
        "verification_percent": 0,
        "waiting_for_members_extra_time": 1,
        "verifiers_train": False,
        "exact_verification_threads": 0,
    }
    unknown = set(config) - set(settings)
    if unknown:
        raise TypeError(f"local_run_state: unknown config fields {sorted(unknown)}")
    settings.update(config)
    return Coordinator(
        run_id=run_id,
        run_state=RunState.WaitingForMembers,
        model=Model.LLM(llm),
        config=CoordinatorConfig(**settings),
        progress=CoordinatorProgress(),
    )


@contextmanager
def gcs_emulator_process(bucket: str, *, start_timeout: float = 60.0) -> Iterator[str]:
    """A GCS emulator (`gcp-storage-emulator`, in memory, `bucket` created) in its own process on
    a free loopback port, for the tests and benchmarks of GCS checkpoints; yields its URL, for
    `STORAGE_EMULATOR_HOST` (this function does not touch the environment). Stopped at exit."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    argv = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
            "--port", str(port), "--in-memory", "-q", "--default-bucket", bucket]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    err = process.stderr.read().decode() if process.stderr else ""
                    raise RuntimeError(f"the GCS emulator did not start: {err[-2000:]}") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
