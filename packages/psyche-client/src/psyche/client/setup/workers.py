"""A client that is a whole machine: its data-, tensor- and fully-sharded-parallel ranks.

`--data-parallelism N --tensor-parallelism M` (and `--fsdp`) make the client N x M ranks, one
device each. This process is rank 0: the client (one identity, one result per round, one set of
network connections). Ranks 1..N*M-1 are worker processes it spawns (`multiprocessing`'s spawn
start method), which only train: they join the client's process group (gloo on the CPU, NCCL
on CUDA, rendezvous through a file in a private temporary directory, so no port is opened
beyond the ranks' own connections), build the model from the tensors the leader broadcasts
(`psyche.modeling.distributed.broadcast_state`; so a model fetched from peers reaches every
rank) and run the leader's trainer commands (`serve`) until told to exit.

Lifetimes: a worker exits when the leader says so, when the leader process disappears (it
watches its parent), or when a collective fails because a peer died. The leader watches its
workers (`WorkerGroup.watch`): a worker that exits takes the whole client down with one line
(`WorkerDied`), as any departed client is then treated by the run. `close` tells the workers to
exit, waits a bounded time and terminates whatever is left: no orphan processes.

With `--main-host` the ranks meet on a TCP store the leader serves instead, and ranks on other
hosts join it from a `psyche-client sidecar` each (`hosts`, `sidecar`); the leader notices
their deaths through the store's heartbeats as it notices its children's.

The group takes its settings as a `ranks.RankLayout` and builds trainers with a
`trainer_settings.TrainerSettings`. It imports nothing heavy at import time (`run_client` builds the group
before the client reaches its coordinator, while torch loads in a worker thread): torch, the
modeling package and `init`'s error are imported where a rank uses them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psyche.client.background import in_abandoned_thread
from psyche.client.setup.cpu_threads import set_cpu_threads
from psyche.client.setup.hosts import (
    CONNECT_TRY_SECS,
    JOIN_TIMEOUT,
    Heartbeats,
    HeartbeatSettings,
    connect_store,
    open_store,
    use_interface_towards,
    wait_for_remote,
)
from psyche.client.setup.ranks import RankLayout

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    import torch

    from psyche.client.setup.model_loading import LoadedModel
    from psyche.client.setup.trainer_settings import TrainerSettings
    from psyche.modeling.parallel import ParallelDims
    from psyche.modeling.trainer import Trainer

log = logging.getLogger(__name__)

BUILD = "build"
CLOSE_TIMEOUT = 20.0
PARENT_POLL_SECS = 0.5


class WorkerDied(RuntimeError):
    """A rank of this client stopped: the client stops with it."""

    exit_code = 1


class WorkerGroup:
    """Ranks 1..n-1 of this client as child processes, and this process as rank 0."""

    def __init__(self, layout: RankLayout, heartbeats: HeartbeatSettings | None = None) -> None:
        self.layout = layout
        self.heartbeats = heartbeats or HeartbeatSettings()
        self.processes: list[BaseProcess] = []
        self.dims: ParallelDims | None = None
        self._dir: str | None = None
        self._beats: Heartbeats | None = None
        self._closed = threading.Event()

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Resolve the devices, spawn the workers and join their process group (blocks until
        every rank has joined). A device that cannot serve is a `ParallelismError`."""
        import multiprocessing

        from psyche.modeling.parallel import ParallelDims, parse_devices
        from psyche.modeling.sharding import build_mesh, init_world

        layout = self.layout
        devices = parse_devices(layout.device, layout.ranks_here)
        set_cpu_threads(layout.cpu_threads, devices[0], layout.ranks_here)
        if layout.world_size == 1:
            self.dims = ParallelDims(devices[0])
            return
        store = None
        if layout.main_host is None:
            self._dir = tempfile.mkdtemp(prefix="psyche-ranks-")
            init_method = "file://" + os.path.join(self._dir, "rendezvous")
        else:
            use_interface_towards(layout.main_host, layout.port)
            store = open_store(layout)
            init_method = f"tcp://{layout.main_host}:{layout.port}"
            # its own connection: a collective's rendezvous holds the group's while it waits
            own = connect_store(layout.main_host, layout.port, CONNECT_TRY_SECS)
            self._beats = Heartbeats(own, [0], layout.remote_ranks, self.heartbeats)
            self._beats.start()
        context = multiprocessing.get_context("spawn")
        readers = []
        for rank in range(1, layout.ranks_here):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main,
                args=(rank, layout, str(devices[rank]), init_method, os.getpid(), writer),
                name=f"psyche-rank-{rank}",
                daemon=True,
            )
            process.start()
            writer.close()
            self.processes.append(process)
            readers.append(reader)
        log.info(
            "started %d worker rank(s) (data parallelism %d x tensor parallelism %d%s on %s); "
            "waiting for them to join",
            len(self.processes),
            layout.dp,
            layout.tp,
            ", FSDP" if layout.fsdp else "",
            ", ".join(str(d) for d in devices),
        )
        self._wait_ready(readers)
        if self._beats is not None:
            wait_for_remote(self._beats, layout, JOIN_TIMEOUT.total_seconds())
        if store is None:
            init_world(0, layout.world_size, init_method, devices[0])
        else:
            from torch.distributed import PrefixStore

            # the prefix torch gives a `tcp://` rendezvous's store, as the other ranks use
            init_world(
                0, layout.world_size, None, devices[0], store=PrefixStore("default_pg", store)
            )
        dims = ParallelDims(devices[0], layout.dp, layout.tp, layout.fsdp, rank=0)
        self.dims = _with_mesh(dims, build_mesh)

    def _wait_ready(self, readers: list[Any]) -> None:
        """Wait until every worker has loaded torch and is about to join the group; a worker
        that exits first is a `WorkerDied` (the group's rendezvous would wait for it)."""
        from multiprocessing.connection import wait

        pending: dict[Any, int] = dict(zip(readers, range(1, len(readers) + 1)))
        while pending:
            sentinels = {self.processes[rank - 1].sentinel: rank for rank in pending.values()}
            for ready in wait([*pending, *sentinels]):
                conn: Any = ready
                if conn in pending:
                    rank = pending.pop(conn)
                    try:
                        conn.recv()
                        continue
                    except EOFError:
                        pass
                else:
                    rank = sentinels[conn]
                    if rank not in pending.values():
                        continue  # it said ready first: the rendezvous will tell
                process = self.processes[rank - 1]
                process.join(5.0)
                raise WorkerDied(
                    f"rank {rank} of this client's {self.layout.world_size} ranks exited while "
                    f"starting (code {process.exitcode})"
                )

    # -- the trainer ---------------------------------------------------------------------------

    def build_trainer(self, loaded: LoadedModel, llm: Any, settings: TrainerSettings) -> Trainer:
        """Rank 0's trainer over the whole group: the model's tensors go to every rank, each
        builds and lays out its part, and rank 0 gets a `LeaderTrainer`. `loaded.model`
        becomes the laid-out model, or, when rank 0 holds only part of it and evaluations are
        asked for (`RankLayout.keeps_replica`), stays the whole model the trainer keeps equal
        to the ranks' parameters (what evaluations run on)."""
        from psyche.modeling.causal_lm import architecture_name
        from psyche.modeling.distributed import COMMAND_LOCK, LeaderTrainer, broadcast_state
        from psyche.modeling.distributed import send_command as send
        from psyche.modeling.trainer import Trainer

        assert self.dims is not None, "start the group first"
        spec = RankSpec(
            config_json=loaded.config_json,
            tokenizer_json=loaded.tokenizer_json,
            architecture=architecture_name(llm.architecture),
            lr_schedule=llm.lr_schedule,
            optimizer=llm.optimizer,
            trainer=settings,
        )
        if self.layout.world_size == 1:
            trainer = _build_rank(spec, None, loaded, self.dims, self.layout, Trainer)
        else:
            with COMMAND_LOCK:
                send(BUILD, spec=spec)
                state = broadcast_state(loaded.model.extract())
                leader = _build_rank(spec, state, None, self.dims, self.layout, LeaderTrainer)
                assert isinstance(leader, LeaderTrainer)
                if self.layout.keeps_replica:
                    leader.keep_replica(loaded.model)
                    return leader
                trainer = leader
        loaded.model = trainer.model
        return trainer

    # -- lifetimes -----------------------------------------------------------------------------

    def wait_for_a_death(self) -> tuple[int, int | None] | None:
        """Block until a rank exits (its rank and exit code; None for a rank of another host
        gone silent), or the group closes (None)."""
        from multiprocessing.connection import wait

        beats = self._beats
        while not self._closed.is_set():
            alive = [p for p in self.processes if p.exitcode is None]
            dead = [p for p in self.processes if p.exitcode is not None]
            if dead:
                process = dead[0]
                return self.processes.index(process) + 1, process.exitcode
            if beats is not None:
                try:
                    remote = beats.died() or _silent(beats)
                except Exception:  # the store is this process's: it fails only as we close
                    remote = None
                if remote is not None:
                    return remote
            elif not alive:
                return None
            wait([p.sentinel for p in alive], timeout=1.0)
        return None

    async def watch(self) -> None:
        """Return never while the workers live; raise `WorkerDied` when one exits."""
        import trio

        if not self.processes and self._beats is None:
            await trio.sleep_forever()
        death = await in_abandoned_thread(self.wait_for_a_death)
        if death is None:
            await trio.sleep_forever()
        assert death is not None
        rank, code = death
        where = " (on another host)" if rank in self.layout.remote_ranks else ""
        what = "went silent" if code is None else f"exited (code {code})"
        raise WorkerDied(
            f"rank {rank} of this client's {self.layout.world_size} ranks{where} {what}: "
            "the client stops with it"
        )

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Tell the workers to exit, wait up to `timeout` seconds, then terminate (and kill)
        what is left; leave the process group. Safe to call twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._beats is not None:
            self._beats.stop()
        if self.processes:
            from psyche.modeling.distributed import EXIT, send_command

            if all(p.exitcode is None for p in self.processes) and not self._remote_died():
                sender = threading.Thread(target=_quietly, args=(send_command, EXIT), daemon=True)
                sender.start()
                sender.join(timeout / 2)
            deadline = time.monotonic() + timeout / 2
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
            for process in self.processes:
                if process.exitcode is None:
                    log.warning("rank %s did not exit; terminating it", process.name)
                    process.terminate()
                    process.join(2.0)
                if process.exitcode is None:
                    process.kill()
                    process.join(2.0)
            if all(p.exitcode == 0 for p in self.processes) and not self._remote_died():
                from psyche.modeling.sharding import close_world

                _quietly(close_world)
            else:
                # A rank died: a collective of this process may wait on it forever, and the
                # interpreter's finalization would abort under it (SIGABRT, not our status).
                from psyche.core.cli import skip_finalization

                skip_finalization()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _remote_died(self) -> bool:
        if self._beats is None:
            return False
        try:
            return self._beats.died() is not None or self._beats.silent() is not None
        except Exception:
            return True


@dataclass(frozen=True)
class RankSpec:
    """What each rank needs to build its trainer besides the tensors (picklable)."""

    config_json: str
    tokenizer_json: str
    architecture: str
    lr_schedule: Any
    optimizer: Any
    trainer: TrainerSettings


def _build_rank(
    spec: RankSpec,
    state: dict[str, torch.Tensor] | None,
    loaded: LoadedModel | None,
    dims: ParallelDims,
    layout: RankLayout,
    cls: type[Trainer],
) -> Trainer:
    """This rank's trainer: the model from `state` (or `loaded`, with one rank), laid out as
    `dims` says. Errors about the layout and the model become `InitRunError`s (one line)."""
    from psyche.client.setup.init import InitRunError
    from psyche.client.setup.model_loading import build_from_parameters
    from psyche.modeling.causal_lm import ModelLoadError
    from psyche.modeling.parallel import ParallelismError
    from psyche.modeling.sharding import parallelize

    try:
        if loaded is None:
            assert state is not None
            loaded = build_from_parameters(
                spec.config_json, spec.tokenizer_json, state, spec.architecture, dims.device
            )
        model = parallelize(loaded.model, dims, layout.sharding())
        model.set_fused_loss(layout.fused_loss)
        return spec.trainer.build(cls, model, spec.lr_schedule, spec.optimizer, dims)
    except (ParallelismError, ModelLoadError) as e:
        raise InitRunError(str(e)) from e


def _silent(beats: Heartbeats) -> tuple[int, None] | None:
    rank = beats.silent()
    return None if rank is None else (rank, None)


def _with_mesh(dims: ParallelDims, build_mesh: Any) -> ParallelDims:
    from dataclasses import replace

    return replace(dims, mesh=build_mesh(dims))


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:  # the group is going away; a failed goodbye changes nothing
        log.debug("while closing the ranks: %s", e)


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker as soon as the leader process is gone (it would wait forever)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(PARENT_POLL_SECS)


def _worker_main(
    rank: int,
    layout: RankLayout,
    device_name: str,
    init_method: str,
    parent_pid: int,
    ready: Any,
) -> None:
    """A worker rank: join the group, then build trainers and serve the leader until `exit`."""
    import signal

    # Ctrl+C reaches the whole terminal's process group: the leader decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    import torch

    from psyche.client.setup.init import InitRunError
    from psyche.modeling.distributed import EXIT, broadcast_state, serve
    from psyche.modeling.parallel import ParallelDims
    from psyche.modeling.sharding import build_mesh, close_world, init_world
    from psyche.modeling.trainer import Trainer

    device = torch.device(device_name)
    set_cpu_threads(layout.cpu_threads, device, layout.ranks_here)
    ready.send(rank)
    ready.close()
    init_world(rank, layout.world_size, init_method, device)
    dims = _with_mesh(
        ParallelDims(device, layout.dp, layout.tp, layout.fsdp, rank=rank), build_mesh
    )
    trainer: Trainer | None = None
    name, kwargs = serve(trainer)
    while name != EXIT:
        if name != BUILD:
            raise RuntimeError(f"unknown message {name!r} from the leader")
        state = broadcast_state(None)
        trainer = None
        # a layout the model cannot take fails the same check on the leader, before any
        # collective, and the leader says why: this rank waits for what comes next
        with contextlib.suppress(InitRunError):
            trainer = _build_rank(kwargs["spec"], state, None, dims, layout, Trainer)
        del state
        name, kwargs = serve(trainer)
    close_world()


__all__ = ["WorkerDied", "WorkerGroup"]
