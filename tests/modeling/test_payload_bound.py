"""`Trainer.max_payload_size`: the largest payload a run's model and compression can produce, the
bound on the result tickets a client downloads (issue 24, item 4). A real payload of each form
fits it, the widest payload the receiver's checks accept is exactly it, and one byte more of
data is refused by those checks."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import (
    ConstantLR,
    DilocoTransmission,
    LearningRateSchedule,
    OptimizerDefinition,
)
from psyche.modeling.diloco import DilocoSettings
from psyche.modeling.serialized_distro import (
    KIND_UINT8,
    InvalidDistroResult,
    SerializableTensor,
    SerializableTensorData,
    SerializedDistroResult,
    TransmittableDistroResult,
    decode_transmittable,
)
from psyche.modeling.trainer import Batch, Trainer

from .tiny_trainer import adamw_def, constant, distro

FLOAT64 = 7
BOOL = 11


def widest_distro_payload(trainer: Trainer) -> TransmittableDistroResult:
    """The largest payload `results_from_payload` accepts: every layout's values as float64
    (or as sign bits in a 1-bit run), step, nonce and batch at their widest encodings."""
    assert trainer.distro is not None
    results = []
    for layout in trainer.distro.layouts():
        n = math.prod(layout.val_shape)
        if trainer.quantize_1bit:
            val = SerializableTensor(
                list(layout.val_shape),
                BOOL,
                False,
                SerializableTensorData.OneBit(bytes(-(-n // 8))),
            )
        else:
            val = SerializableTensor(
                list(layout.val_shape), FLOAT64, False, SerializableTensorData.Full(bytes(8 * n))
            )
        idx = SerializableTensor(
            list(layout.idx_shape),
            KIND_UINT8,
            False,
            SerializableTensorData.Full(bytes(math.prod(layout.idx_shape))),
        )
        results.append(SerializedDistroResult(idx, val, list(layout.xshape), layout.totalk))
    return TransmittableDistroResult(2**32 - 1, 2**32 - 1, BatchId(2**64 - 1, 2**64 - 1), results)


@pytest.mark.parametrize("quantize", [True, False])
def test_distro_the_widest_accepted_payload_is_the_bound(
    tiny_llama: Callable, corpus: torch.Tensor, quantize: bool
) -> None:
    definition = distro(quantize=quantize, chunk=16)
    trainer = Trainer(tiny_llama(), constant(1e-3), definition, micro_batch_size=4)
    out = trainer.train(1, Batch(corpus[:8]), prev_self_distro_results=[])
    real = trainer.prepare_result(out, step=1, batch_id=BatchId(0, 7)).payload.to_bytes()
    bound = trainer.max_payload_size()
    assert len(real) <= bound
    widest = widest_distro_payload(trainer)
    encoded = widest.to_bytes()
    trainer.results_from_payload(decode_transmittable(encoded))  # accepted
    assert len(encoded) == bound
    # one value more in the first entry: refused by the receiver's checks
    first = widest.distro_results[0]
    longer = SerializableTensor(
        first.sparse_val.dims,
        first.sparse_val.kind,
        False,
        type(first.sparse_val.data)(first.sparse_val.data.value + b"\0"),
    )
    widest.distro_results[0] = SerializedDistroResult(
        first.sparse_idx, longer, first.xshape, first.totalk
    )
    with pytest.raises(InvalidDistroResult):
        trainer.results_from_payload(widest)


@pytest.mark.parametrize("transmission", list(DilocoTransmission))
def test_diloco_payloads_are_exactly_the_bound(
    tiny_llama: Callable, corpus: torch.Tensor, transmission: DilocoTransmission
) -> None:
    """DiLoCo's forms fix every tensor's kind and dims: a real payload with the widest step,
    nonce and batch is the bound to the byte."""
    settings = DilocoSettings(inner_steps=2, transmission=transmission)
    schedule = LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0))
    definition = OptimizerDefinition.DiLoCo(settings.definition())
    trainer = Trainer(tiny_llama(), schedule, definition, micro_batch_size=4)
    out = trainer.train_exact(
        1, Batch(corpus[:8]), warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[]
    )
    payload = trainer.prepare_result(out, step=2**32 - 1, batch_id=BatchId(2**64 - 1, 2**64 - 1))
    widest = TransmittableDistroResult(
        payload.payload.step, 2**32 - 1, payload.payload.batch_id, payload.payload.distro_results
    )
    encoded = widest.to_bytes()
    trainer.results_from_payload(decode_transmittable(encoded))
    assert len(encoded) == trainer.max_payload_size()


def test_without_distro_only_an_empty_payload_fits(tiny_llama: Callable) -> None:
    trainer = Trainer(tiny_llama(), constant(1e-3), adamw_def(), micro_batch_size=4)
    empty = TransmittableDistroResult(2**32 - 1, 2**32 - 1, BatchId(2**64 - 1, 2**64 - 1), [])
    assert len(empty.to_bytes()) == trainer.max_payload_size() < 64
