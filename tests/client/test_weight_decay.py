"""DisTrO's weight decay belongs to the step, not to the batches a client trained: clients of
one run that trained one batch of a step, two, or none (a verifier, a client without an
assignment) apply the same results and must hold the same bits after every step
(`round.train.run_round`, `Trainer.decay_weights`). The old code decayed once per batch
trained, inside `train_exact`: the three clients below drifted apart at the first step."""

from __future__ import annotations

from typing import Any

import torch
import trio

from psyche.client.round.fetch import DataFetcher
from psyche.client.round.train import OwnResult, TrainingStep, TrainJob, run_round
from psyche.core.batch_id import BatchId
from psyche.core.token_size import TokenSize
from psyche.data_provider.dummy import DummyDataProvider
from psyche.modeling.sharing import model_hash
from psyche.modeling.trainer import Batch, Trainer

from ..modeling.tiny_trainer import make_trainer
from .support import train_job

WEIGHT_DECAY = 0.1
SEQ = 16
STEPS = 3
ASSIGNED = {
    "one": [BatchId(0, 1)],
    "two": [BatchId(2, 3), BatchId(4, 5)],
    "none": [],  # a verifier or tie-breaker, or a client the round gave nothing
}


def weights_hash(trainer: Trainer) -> bytes:
    return model_hash(dict(trainer.model.variables()))


async def train_step(trainer: Trainer, fetcher: DataFetcher, step_job: TrainJob) -> list[OwnResult]:
    published: list[OwnResult] = []
    handle = TrainingStep()
    await run_round(handle, trainer, None, step_job, fetcher, published.append)
    finished = await handle.finish()  # raises what the step raised
    assert len(finished.trained) == len(step_job.assigned_batches)
    return published


def test_clients_that_trained_one_two_or_no_batch_hold_the_same_weights() -> None:
    clients = {name: make_trainer(weight_decay=WEIGHT_DECAY) for name in ASSIGNED}
    # the old code's sequence for a client that trained one batch: its bits must not change
    reference = make_trainer(weight_decay=WEIGHT_DECAY)
    provider = DummyDataProvider(TokenSize.FourBytes, SEQ, 64)
    hashes: list[dict[str, bytes]] = []

    async def main() -> None:
        prev: dict[str, list[list[Any]]] = {name: [] for name in clients}
        ref_prev: list[list[Any]] = []
        pending: list[list[Any]] = []
        async with trio.open_nursery() as nursery:
            fetcher = DataFetcher(provider, nursery)
            for step in range(1, STEPS + 1):
                # the round's start: every client applies the same results
                for trainer in [*clients.values(), reference]:
                    trainer.optimize(step, distro_results=pending)
                sent: dict[str, list[list[Any]]] = {}
                for name, trainer in clients.items():
                    published = await train_step(
                        trainer, fetcher, train_job(step, ASSIGNED[name], prev[name])
                    )
                    prev[name] = [r.original for r in published]
                    sent[name] = [r.sent for r in published]
                batch = Batch.from_samples(await provider.get_samples(ASSIGNED["one"][0]))
                out = reference.train_exact(
                    step, batch, warmup_lr_between=None, zero_optim=False,
                    prev_self_distro_results=ref_prev,
                )  # fmt: skip
                ref_prev = [out.distro_results or []]
                with torch.no_grad():
                    lr = reference.get_lr(step)
                    for _, p in reference.model.variables():
                        p.mul_(1.0 - lr * WEIGHT_DECAY)
                assert len(sent["one"]) == 1
                pending = sent["one"]  # the run applies the result of the client that trained it
                hashes.append({name: weights_hash(t) for name, t in clients.items()})
                hashes[-1]["reference"] = weights_hash(reference)
            nursery.cancel_scope.cancel()

    trio.run(main)
    for step, by_client in enumerate(hashes, start=1):
        assert len(set(by_client.values())) == 1, (
            step,
            {k: v.hex()[:12] for k, v in by_client.items()},
        )
    # the weights moved: the decay and the applied results are there
    assert hashes[0]["one"] != weights_hash(make_trainer(weight_decay=WEIGHT_DECAY))
