"""A client's rank 0 with one worker rank (DP=2 on the CPU, gloo), for test_workers.py:
`python workers_leader.py MODE MODEL_DIR`.

* `train`: build the trainer through the `WorkerGroup` (the model's tensors broadcast to the
  worker), train and apply a step, compare payload and parameters with a one-rank trainer
  (`PAYLOAD_EQUAL`, `PARAMS_EQUAL`), and a forward pass of rank 0's replica alone, as an
  evaluation between rounds runs it, with the one-rank model's logits (`EVAL_EQUAL`); then
  train in a loop while `WorkerGroup.watch` waits
  (`TRAINING`), so the test can SIGKILL the worker: prints `STOPPED <exceptions>` when the
  rank's death stops it (the watch's `WorkerDied`, or the collective that lost its peer), closes
  the group (`CLOSED`) and exits 3.
* `hosts`: as `train`, but the client spans two hosts with argv[4] ranks on each: DP=2 x argv[4]
  with ranks 0 .. argv[4] - 1 here and the others joining from a `psyche-client sidecar` on
  another host (argv[3]: this host's address, the `--main-host`); the batch has two rows per
  rank (each rank trains one of the one-rank client's micro-batches) and DisTrO's payload is
  not sign-quantized, so `PAYLOAD_EQUAL` compares every bit of the trained gradients; the test
  kills a rank of the other host. An argv[5] sets the heartbeat silence that counts as a death
  (`HeartbeatSettings.silence_secs`; the product's default otherwise).
* `replica`: a client whose rank 0 holds only part of the model (argv[3]: `fsdp`, FSDP2 over 2
  ranks, or `tp`, TP=2) with evaluations asked for (`RankLayout.eval_replica`): trains and
  applies a step as `train`, then prints `REPLICA_EQUAL` (the whole replica evaluations run on,
  `loaded.model`, holds every parameter the ranks hold, bit for bit), `EVAL_EQUAL` (its forward
  pass against the one-rank client's, for `fsdp`, whose parameters are the one-rank bits; for
  `tp`, against a one-rank model built from the ranks' gathered parameters), then trains the
  next step on the ranks and on the one-rank client (`NEXT_LOSS <ranks> <one rank>`: the ranks
  still train in step after the replica's forward pass) and exits 0.
* `orphan`: a TP=2 group asked to build a model whose key/value heads (MODEL_DIR's config) do
  not divide by 2: prints `INIT_ERROR <message>` (the worker fails the same check and waits),
  then `WORKERS <pids>`, then waits to be killed (the test kills this process and checks the
  worker goes too).
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import trio

from psyche.client.setup.hosts import HeartbeatSettings
from psyche.client.setup.init import InitRunError
from psyche.client.setup.model_loading import load_from_directory
from psyche.client.setup.ranks import RankLayout
from psyche.client.setup.trainer_settings import TrainerSettings
from psyche.client.setup.workers import WorkerGroup
from psyche.core.batch_id import BatchId
from psyche.core.definitions import ConstantLR, LearningRateSchedule
from psyche.modeling.causal_lm import CausalLM
from psyche.modeling.trainer import Batch, Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "modeling"))
from tiny_trainer import distro, make_trainer


def say(*words: object) -> None:
    print(*words, flush=True)


def batch(step: int, rows: int = 4) -> Batch:
    return Batch(torch.randint(0, 256, (rows, 16), generator=torch.Generator().manual_seed(step)))


def main() -> int:
    mode, model_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    heartbeats = HeartbeatSettings()
    if mode == "hosts":
        per_host = int(sys.argv[4])
        layout = RankLayout(
            dp=2 * per_host, device="cpu", main_host=sys.argv[3], local_ranks=per_host
        )
        if len(sys.argv) > 5:
            heartbeats = HeartbeatSettings(silence_secs=float(sys.argv[5]))
    elif mode == "orphan":
        layout = RankLayout(tp=2, device="cpu")
    elif mode == "replica":
        fsdp = sys.argv[3] == "fsdp"
        dp, tp = (2, 1) if fsdp else (1, 2)
        layout = RankLayout(dp=dp, tp=tp, fsdp=fsdp, device="cpu", eval_replica=True)
    else:
        layout = RankLayout(dp=2, device="cpu")
    group = WorkerGroup(layout, heartbeats)
    group.start()
    llm = SimpleNamespace(
        architecture="HfLlama",
        lr_schedule=LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0)),
        optimizer=distro(quantize=mode != "hosts"),
    )
    settings = TrainerSettings(micro_batch_size=2)
    loaded = load_from_directory(model_dir, "HfLlama", torch.device("cpu"))
    if mode == "orphan":
        try:
            group.build_trainer(loaded, llm, settings)
        except InitRunError as e:
            say("INIT_ERROR", e)
        say("WORKERS", *(p.pid for p in group.processes))
        time.sleep(600)
        return 1
    say("WORKERS", *(p.pid for p in group.processes))
    trainer = group.build_trainer(loaded, llm, settings)
    kwargs = dict(warmup_lr_between=None, zero_optim=False)
    reference = make_trainer(quantize=mode != "hosts")
    first = batch(1, 2 * layout.dp)
    out_t = trainer.train_exact(1, first, prev_self_distro_results=[], **kwargs)
    out_r = reference.train_exact(1, first, prev_self_distro_results=[], **kwargs)
    sent_t = trainer.prepare_result(out_t, step=1, batch_id=BatchId(1, 1))
    sent_r = reference.prepare_result(out_r, step=1, batch_id=BatchId(1, 1))
    say("PAYLOAD_EQUAL", sent_t.payload.to_bytes() == sent_r.payload.to_bytes())
    say("LOSS_EQUAL", out_t.loss == out_r.loss)
    trainer.optimize(1, distro_results=[sent_t.sent, sent_r.sent])
    reference.optimize(1, distro_results=[sent_t.sent, sent_r.sent])
    full = trainer.full_variables()
    say("PARAMS_EQUAL", all(torch.equal(full[n], p) for n, p in reference.model.variables()))
    if mode == "replica":
        code = check_replica(sys.argv[3], loaded.model, trainer, reference, kwargs)
        group.close(timeout=10)
        return code
    # what an evaluation does between rounds, on rank 0 alone while the other rank waits for
    # the next command: a forward pass of its whole replica, the one-rank client's bits
    with torch.no_grad():
        tokens = batch(99).input_ids
        logits = [t.model.forward(tokens, num_logits_to_keep=1)[0] for t in (trainer, reference)]
    say("EVAL_EQUAL", torch.equal(*logits))

    def train_forever() -> None:
        step = 2
        while True:
            trainer.train_exact(step, batch(step), prev_self_distro_results=[], **kwargs)
            step += 1

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(group.watch)
            nursery.start_soon(
                partial(trio.to_thread.run_sync, abandon_on_cancel=True), train_forever
            )
            say("TRAINING")

    try:
        trio.run(run)
    except BaseExceptionGroup as e:
        say("STOPPED", *(type(x).__name__ for x in e.exceptions))
    except Exception as e:
        say("STOPPED", type(e).__name__)
    group.close(timeout=10)
    say("CLOSED")
    return 3


def check_replica(
    how: str, replica: CausalLM, trainer: Trainer, reference: Trainer, kwargs: dict
) -> int:
    """`replica` mode after its first step (see the module docstring)."""
    full = trainer.full_variables()
    say("REPLICA_EQUAL", all(torch.equal(full[n], p) for n, p in replica.variables()))
    single = reference.model
    if how == "tp":  # the one-rank computation on the ranks' parameters
        single = make_trainer().model
        with torch.no_grad():
            for name, p in single.variables():
                p.copy_(full[name])
    with torch.no_grad():
        tokens = batch(99).input_ids
        logits = [m.forward(tokens)[0] for m in (replica, single)]
    say("EVAL_EQUAL", torch.equal(*logits))
    out_t = trainer.train_exact(2, batch(2), prev_self_distro_results=[], **kwargs)
    out_r = reference.train_exact(2, batch(2), prev_self_distro_results=[], **kwargs)
    say("NEXT_LOSS", out_t.loss, out_r.loss)
    return 0


if __name__ == "__main__":
    from psyche.core.cli import exit_process

    exit_process(main())
