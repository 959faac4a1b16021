"""`psyche-client sidecar`: ranks of a client whose leader runs on another host (upstream's
`psyche-sidecar python --main-host --port --world-size --start-rank --num-local-ranks`).

It connects to the leader's store, takes the layout the leader published, starts its ranks as
the leader starts its local ones (`workers._worker_main`: each joins the group, builds its part
of the model from the tensors the leader broadcasts and runs the leader's commands), then
watches both sides (`hosts.Heartbeats`): a rank of its own that exits is reported to the leader
(`died/<rank>`) and the sidecar stops the others and exits 1; a leader that goes away (its
store fails, or its counter stops for `SILENCE_SECS`) stops every rank and exits 1. When the
leader closes the group, every rank exits 0 and so does the sidecar. SIGINT/SIGTERM stop the
ranks and exit (the core CLI's codes).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from psyche.client.setup.hosts import (
    BEAT_SECS,
    Heartbeats,
    HostsError,
    connect_store,
    died_key,
    read_layout,
    use_interface_towards,
)
from psyche.client.setup.ranks import SidecarLayout

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)

CLOSING_SECS = 5.0
"""How long ranks may take to exit after their client went away before they are stopped."""

CONNECT_SECS = 600.0
"""How long a sidecar keeps trying to reach the leader's store when it starts first."""


def run_sidecar(sidecar: SidecarLayout, connect_secs: float = CONNECT_SECS) -> int:
    """Run ranks `start_rank ..` of the client at `main_host:port` until the leader ends them;
    the exit code: 0 when the leader closed the group, 1 when a rank or the leader died."""
    import multiprocessing

    from psyche.client.setup.workers import _worker_main
    from psyche.modeling.parallel import parse_devices

    use_interface_towards(sidecar.main_host, sidecar.port)
    log.info(
        "ranks %d..%d: waiting for the client's store at %s:%d",
        sidecar.start_rank,
        sidecar.start_rank + sidecar.num_local_ranks - 1,
        sidecar.main_host,
        sidecar.port,
    )
    store = connect_store(sidecar.main_host, sidecar.port, connect_secs)
    layout = sidecar.layout().joining(read_layout(store), sidecar)
    if layout.world_size != sidecar.world_size:
        raise HostsError(
            f"--world-size {sidecar.world_size}, but the client at {sidecar.main_host} has "
            f"{layout.dp} x {layout.tp} = {layout.world_size} ranks"
        )
    ranks = range(sidecar.start_rank, sidecar.start_rank + sidecar.num_local_ranks)
    beats = Heartbeats(store, own=ranks, watched=[0])
    beats.start()
    devices = parse_devices(sidecar.device, sidecar.num_local_ranks)
    context = multiprocessing.get_context("spawn")
    processes: dict[int, BaseProcess] = {}
    readers = []  # kept open: each rank says it is ready through one
    try:
        for index, rank in enumerate(ranks):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main,
                args=(
                    rank,
                    layout,
                    str(devices[index]),
                    f"tcp://{sidecar.main_host}:{sidecar.port}",
                    os.getpid(),
                    writer,
                ),
                name=f"psyche-rank-{rank}",
                daemon=True,
            )
            process.start()
            writer.close()
            readers.append(reader)
            processes[rank] = process
        log.info(
            "started rank(s) %s of the client at %s:%d (data parallelism %d x tensor "
            "parallelism %d)",
            ", ".join(f"{r} (pid {p.pid})" for r, p in processes.items()),
            sidecar.main_host,
            sidecar.port,
            layout.dp,
            layout.tp,
        )
        return _watch(processes, beats)
    finally:
        beats.stop()
        _stop(processes)


def _watch(processes: dict[int, BaseProcess], beats: Heartbeats) -> int:
    """Until every rank exited 0 (0), a rank exited otherwise, or the leader went away (1)."""
    from multiprocessing.connection import wait

    while True:
        exited = {r: p.exitcode for r, p in processes.items() if p.exitcode is not None}
        failed = {r: c for r, c in exited.items() if c != 0}
        if failed:
            # When one rank dies its peers fail their next collective and exit 1 soon after;
            # by the time this loop looks, several may have exited. A rank killed by a signal
            # is the likelier cause, so it is named (and told to the client) first.
            ordered = sorted(failed.items(), key=lambda item: (item[1] >= 0, item[0]))
            log.error(
                "%s: stopping this host's ranks",
                ", ".join(f"rank {rank} exited (code {code})" for rank, code in ordered),
            )
            rank, code = ordered[0]
            try:
                beats.store.set(died_key(rank), str(code))
            except Exception as e:
                log.debug("could not tell the client: %s", e)
            return 1
        if len(exited) == len(processes):
            log.info("the client closed its ranks")
            return 0
        try:
            gone = "went silent" if beats.silent() is not None else None
        except Exception as e:
            gone = f"went away ({e})"
        if gone is not None:
            # a client that closed its ranks and exited: they are exiting 0 now
            for process in processes.values():
                process.join(CLOSING_SECS)
            if all(p.exitcode == 0 for p in processes.values()):
                log.info("the client closed its ranks")
                return 0
            log.error("the client %s: stopping this host's ranks", gone)
            return 1
        alive = [p.sentinel for p in processes.values() if p.exitcode is None]
        wait(alive, timeout=BEAT_SECS)


def _stop(processes: dict[int, BaseProcess]) -> None:
    for process in processes.values():
        if process.exitcode is None:
            process.terminate()
    deadline = time.monotonic() + 5.0
    for process in processes.values():
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join(2.0)


__all__ = ["run_sidecar"]
