"""The ranks of one client training as one: the leader's commands and the workers' loop.

Rank 0 is the client (identity, network, one result per round); ranks 1..n-1 only train. Every
rank holds a `Trainer` over its part of the model (`psyche.modeling.sharding`), and every
trainer operation that involves the model's collectives must run on all ranks together, in the
same order. Upstream's Python sidecars get their operations as JSON under TCPStore keys plus
NCCL broadcasts; here the protocol is as small:

* the leader's trainer is a `LeaderTrainer`: each entry point the client calls that changes or
  reads the model (`train`, `train_exact`, `optimize`, `start_epoch`, `extract`,
  `full_variables`, `truncate_bf16`; a new such trainer method belongs here too) first broadcasts
  `(name, arguments)` to the workers over the gloo control group
  (`torch.distributed.broadcast_object_list`), then does its own part;
* a worker runs `serve(trainer)`: it receives each command and calls the same method on its
  own trainer, until `exit`.

What travels: the whole batch (a few KB of token ids; each rank takes its rows, as upstream's
`forward` narrows the batch by DP rank), this client's previous results and the round's
aggregate as the peers sent them (compressed: each rank decodes them itself, which is cheaper
than sending decoded dense tensors and gives the same bits). The cancel flag is voted per
micro-batch inside `Trainer.train` (`ParallelDims.agree`). `broadcast_state` hands the model's
tensors from the leader to every rank once, when the ranks build their model.

Evaluations when rank 0 holds only part of the model (TP, FSDP): the leader can keep a whole
replica (`LeaderTrainer.keep_replica`, the model it loaded before the ranks laid it out) that
evaluations run on alone, as a one-rank client runs them on its model; after every command that
changes the parameters (`optimize`, `truncate_bf16`) the leader gathers them
(`full_variables`, every rank taking part) into the replica. The cost: the model's memory
once more on rank 0's device and one gather per round.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from psyche.modeling.causal_lm import CausalLM
from psyche.modeling.sharding import control_group
from psyche.modeling.trainer import Trainer

log = logging.getLogger(__name__)

EXIT = "exit"
COMMANDS = (
    "train",
    "train_exact",
    "optimize",
    "decay_weights",
    "start_epoch",
    "extract",
    "full_variables",
    "truncate_bf16",
)
"""The trainer methods a leader forwards (all others are local to the leader)."""

_LOCAL_ONLY = ("cancel", "timings")


def broadcast_object(obj: Any = None) -> Any:
    """The leader's `obj` on every rank (rank 0 sends, the others receive and return it)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def broadcast_state(state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The leader's CPU tensors on every rank: the names, shapes and dtypes as one object, then
    each tensor with `torch.distributed.broadcast` (so a large model is never pickled whole)."""
    import torch.distributed as dist

    meta = broadcast_object(
        None
        if state is None
        else [(name, tuple(t.shape), t.dtype) for name, t in sorted(state.items())]
    )
    out: dict[str, torch.Tensor] = {}
    for name, shape, dtype in meta:
        if state is not None:
            tensor = state[name].detach().to("cpu").contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype)
        dist.broadcast(tensor, src=0, group=control_group())
        out[name] = tensor
    return out


class LeaderTrainer(Trainer):
    """Rank 0's trainer: each entry point in `COMMANDS` is announced to the workers first."""

    _depth = 0
    replica: CausalLM | None = None
    """A whole copy of the model on this rank, kept equal to the ranks' parameters (for
    evaluations when this rank holds only part of the model); None: none kept."""

    def keep_replica(self, model: CausalLM) -> None:
        """Keep `model` (whole, the architecture and names of this trainer's model) equal to
        the trainer's parameters from now on."""
        self.replica = model
        self._refresh_replica()

    def _refresh_replica(self) -> None:
        if self.replica is None:
            return
        full = self.full_variables()
        with torch.no_grad():
            for name, p in self.replica.variables():
                p.copy_(full[name])

    @contextmanager
    def _command(self, name: str, **kwargs: Any) -> Iterator[None]:
        with COMMAND_LOCK:
            # only the outermost call is announced (train_exact calls train)
            if self._depth == 0:
                send_command(name, **{k: v for k, v in kwargs.items() if k not in _LOCAL_ONLY})
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1

    def train(self, step: int, batch: Any, **kwargs: Any) -> Any:
        with self._command("train", step=step, batch=batch, **kwargs):
            return super().train(step, batch, **kwargs)

    def train_exact(self, step: int, batch: Any, **kwargs: Any) -> Any:
        with self._command("train_exact", step=step, batch=batch, **kwargs):
            return super().train_exact(step, batch, **kwargs)

    def optimize(self, step: int, **kwargs: Any) -> None:
        with COMMAND_LOCK:
            with self._command("optimize", step=step, **kwargs):
                super().optimize(step, **kwargs)
            self._refresh_replica()

    def decay_weights(self, step: int, **kwargs: Any) -> None:
        with self._command("decay_weights", step=step, **kwargs):
            super().decay_weights(step, **kwargs)

    def start_epoch(self) -> None:
        with self._command("start_epoch"):
            super().start_epoch()

    def extract(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        with self._command("extract", dtype=dtype):
            return super().extract(dtype)

    def full_variables(self) -> dict[str, torch.Tensor]:
        with self._command("full_variables"):
            return super().full_variables()

    def truncate_bf16(self) -> None:
        with COMMAND_LOCK:
            with self._command("truncate_bf16"):
                super().truncate_bf16()
            self._refresh_replica()

    def stop_workers(self) -> None:
        """Tell every worker to leave its loop (the last message)."""
        send_command(EXIT)


COMMAND_LOCK = threading.RLock()
"""One message at a time on the leader, whatever thread sends it (a command's broadcast and the
leader's own part must not interleave with another command's)."""


def send_command(name: str, **kwargs: Any) -> None:
    """The leader's message `(name, kwargs)` to every worker."""
    with COMMAND_LOCK:
        broadcast_object((name, kwargs))


def serve(trainer: Trainer | None) -> tuple[str, dict[str, Any]]:
    """A worker's loop: run each trainer command of the leader on this rank's trainer; returns
    the first message that is not one (`exit`, or what the caller's own protocol sends, such as
    building a trainer)."""
    while True:
        name, kwargs = broadcast_object()
        if name not in COMMANDS:
            return name, kwargs
        if trainer is None:
            raise RuntimeError(f"the leader sent {name!r} before any trainer was built")
        getattr(trainer, name)(**kwargs)


__all__ = [
    "COMMANDS",
    "COMMAND_LOCK",
    "EXIT",
    "LeaderTrainer",
    "broadcast_object",
    "broadcast_state",
    "send_command",
    "serve",
]
