"""How many CPU threads a client's torch uses (`--cpu-threads`, env `CPU_THREADS`).

torch sizes its intra-op pool (OpenMP, and MKL where built with it) to every core of the
machine. One client alone is right to; several on one machine (`psyche-local-testnet`, or a test
run) then run cores x clients busy threads on cores threads' worth of CPU, and OpenMP's spinning
workers make each step far slower than its share (three clients on two cores: rounds 2.4 times
longer, and a witness late for its deadline). `--cpu-threads N` gives the client N threads in
all, split among its ranks; the local testnet gives each of its clients
`threads_per_client(cores, clients)`. Unset, a one-rank client keeps torch's default and the
ranks of a CPU client split the cores among them.

Guaranteed: the threads are set before the model is built or trained (the device is set up
first), at least one per rank; nothing here imports torch at import time.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_per_client(cores: int, clients: int) -> int:
    """Each of `clients` processes sharing `cores`: an equal share, at least one."""
    return max(1, cores // max(1, clients))


def rank_threads(cpu_threads: int | None, device: torch.device, world_size: int) -> int | None:
    """The threads each rank of a `world_size`-rank client uses, or None for torch's default:
    `cpu_threads` split among the ranks when given; else, on the CPU with several ranks, the
    cores split among them."""
    if cpu_threads is not None:
        return threads_per_client(cpu_threads, world_size)
    if device.type == "cpu" and world_size > 1:
        return threads_per_client(available_cores(), world_size)
    return None


def set_cpu_threads(cpu_threads: int | None, device: torch.device, world_size: int = 1) -> None:
    """Apply `rank_threads` to this process's torch (call once torch is imported, before the
    model trains)."""
    threads = rank_threads(cpu_threads, device, world_size)
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)
    log.info("torch uses %d CPU thread(s) in this process", threads)


__all__ = ["available_cores", "rank_threads", "set_cpu_threads", "threads_per_client"]
