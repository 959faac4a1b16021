"""What a Psyche client asks of the trainer: `train_exact` (the lookahead undone exactly, so
every client keeps bit-identical weights), `prepare_result` (the payload, its commitment hash and
the tensors everyone applies), batches from a data provider's samples, and the trainer's
`ParallelDims`."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from psyche.core.batch_id import BatchId
from psyche.data_provider.types import TokenizedData
from psyche.modeling.serialized_distro import (
    decode_transmittable,
    distro_results_from_transmittable,
)
from psyche.modeling.sharing import model_hash
from psyche.modeling.trainer import Batch, Trainer

from .tiny_trainer import make_trainer

SEQ = 16


def corpus() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, SEQ))).long()


def _never() -> threading.Event:
    return threading.Event()


def weights_hash(trainer: Trainer) -> bytes:
    return model_hash(dict(trainer.model.variables()))


# --------------------------------------------------------------------------------------------
# train_exact


def test_exact_lookahead_keeps_the_results_and_restores_the_weights() -> None:
    plain, exact = make_trainer(weight_decay=0.1), make_trainer(weight_decay=0.1)
    before = [p.detach().clone() for _, p in exact.model.variables()]
    prev: list = []  # type: ignore[type-arg]
    for step in (1, 2):
        a = plain.train(step, Batch(corpus()), prev_self_distro_results=prev)
        b = exact.train_exact(
            step, Batch(corpus()), warmup_lr_between=None, zero_optim=False,
            prev_self_distro_results=prev, cancel=_never(),
        )  # fmt: skip
        assert all(torch.equal(x, y) for x, (_, y) in zip(before, exact.model.variables()))
        exact.decay_weights(step, warmup_lr_between=None)
        assert a.loss == b.loss
        for ra, rb in zip(a.distro_results, b.distro_results):
            assert torch.equal(ra.sparse_idx, rb.sparse_idx)
            assert torch.equal(ra.sparse_val, rb.sparse_val)
        prev = [b.distro_results]
        lr = exact.get_lr(step)
        with torch.no_grad():
            before = [p.mul(1.0 - lr * 0.1) for p in before]
        after = [p for _, p in exact.model.variables()]
        assert all(torch.equal(x, y) for x, y in zip(before, after))
    # upstream's add-back leaves rounding residue; the exact restore does not
    assert any(
        not torch.equal(x, y)
        for (_, x), (_, y) in zip(plain.model.variables(), exact.model.variables())
    )


def test_train_times_generate_only_when_asked() -> None:
    trainer = make_trainer()
    timings: dict[str, float] = {}
    trainer.train_exact(
        1, Batch(corpus()), warmup_lr_between=None, zero_optim=False,
        prev_self_distro_results=[], timings=timings,
    )  # fmt: skip
    assert set(timings) == {"generate"}
    assert timings["generate"] > 0
    out = trainer.train(2, Batch(corpus()), prev_self_distro_results=[])
    assert out.distro_results is not None


@pytest.mark.gpu
def test_exact_lookahead_on_cuda_in_bf16() -> None:
    """On a GPU the weights are bf16, where upstream's add-back drifts the most; the exact
    restore keeps two independent trainers bit-identical and their payloads equal."""
    runs = []
    for _ in range(2):
        trainer = make_trainer(weight_decay=0.1, device="cuda")
        before = [p.detach().clone() for _, p in trainer.model.variables()]
        prev: list = []  # type: ignore[type-arg]
        payloads = []
        for step in (1, 2, 3):
            timings: dict[str, float] = {}
            out = trainer.train_exact(
                step, Batch(corpus()), warmup_lr_between=None, zero_optim=False,
                prev_self_distro_results=prev, cancel=_never(), timings=timings,
            )  # fmt: skip
            assert timings["generate"] > 0
            trainer.decay_weights(step, warmup_lr_between=None)
            prev = [out.distro_results]
            payloads.append([r.sparse_val.cpu() for r in out.distro_results])
            with torch.no_grad():
                before = [b.mul(1.0 - trainer.get_lr(step) * 0.1) for b in before]
            after = [p for _, p in trainer.model.variables()]
            assert all(torch.equal(x, y) for x, y in zip(before, after))
        runs.append((trainer, payloads))
    (a, pa), (b, pb) = runs
    assert all(torch.equal(x, y) for px, py in zip(pa, pb) for x, y in zip(px, py))
    assert weights_hash(a) == weights_hash(b)


# --------------------------------------------------------------------------------------------
# prepare_result


@pytest.mark.parametrize(("quantize", "chunk"), [(True, 16), (False, 16), (True, 64)])
def test_prepare_result_holds_the_tensors_a_peer_decodes(quantize: bool, chunk: int) -> None:
    """A client applies its own result from `sent` without the bytes' round trip: those
    tensors must be exactly what every peer decodes from the payload (chunk 64: two-byte
    indices)."""
    trainer = make_trainer(quantize=quantize, chunk=chunk)
    out = trainer.train_exact(
        1, Batch(corpus()), warmup_lr_between=None, zero_optim=False,
        prev_self_distro_results=[],
    )  # fmt: skip
    batch_id = BatchId(4, 7)
    prepared = trainer.prepare_result(out, step=1, batch_id=batch_id)
    payload = prepared.payload
    assert (payload.step, payload.batch_id, payload.trainer_nonce) == (1, batch_id, out.nonce)
    received = decode_transmittable(payload.to_bytes())
    assert prepared.commitment_hash == payload.compute_hash() == received.compute_hash()
    decoded = distro_results_from_transmittable(
        received, trainer.distro.layouts(), require_1bit=quantize
    )
    assert len(decoded) == len(prepared.sent) == len(out.distro_results)
    for mine, theirs, original in zip(prepared.sent, decoded, out.distro_results):
        assert mine.sparse_val.dtype == (torch.bool if quantize else original.sparse_val.dtype)
        for a, b in ((mine.sparse_idx, theirs.sparse_idx), (mine.sparse_val, theirs.sparse_val)):
            assert (a.dtype, a.shape) == (b.dtype, b.shape)
            assert torch.equal(a, b)
        assert (list(mine.xshape), mine.totalk) == (list(theirs.xshape), theirs.totalk)
    # applying one or the other moves a model to the same bits
    one, other = (make_trainer(quantize=quantize, chunk=chunk) for _ in range(2))
    one.optimize(2, distro_results=[prepared.sent])
    other.optimize(2, distro_results=[decoded])
    assert weights_hash(one) == weights_hash(other)


# --------------------------------------------------------------------------------------------
# Batches from samples


def test_batch_from_samples_stacks_int64_rows() -> None:
    rows = np.arange(12, dtype=np.int32).reshape(3, 4)
    batch = Batch.from_samples(TokenizedData.from_rows(rows))
    assert batch.input_ids.dtype == torch.int64
    assert batch.input_ids.tolist() == rows.tolist()
    assert batch.labels is None
    assert batch.position_ids is None
    assert len(batch) == 3
    with_labels = [TokenizedData(r, labels=-r, position_ids=np.arange(4)) for r in rows]
    batch = Batch.from_samples(with_labels)
    assert batch.labels is not None
    assert batch.labels.tolist() == (-rows).tolist()
    assert batch.position_ids is not None
    assert batch.position_ids.dtype == torch.int64
    # labels only when every sample has them
    mixed = [with_labels[0], TokenizedData(rows[1])]
    assert Batch.from_samples(mixed).labels is None
    with pytest.raises(ValueError, match="different lengths"):
        Batch.from_samples([TokenizedData(rows[0]), TokenizedData(rows[1][:2])])
    with pytest.raises(ValueError, match="empty batch"):
        Batch.from_samples([])
    assert Batch.from_rows(rows.astype(np.uint16)).input_ids.dtype == torch.int64
