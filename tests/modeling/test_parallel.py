"""`ParallelDims` in one process: the degrees and their checks, which rows and micro-batches a
rank trains, the device list, and the trainer's one-rank layout (the multi-rank behaviour is in
test_parallel_ranks.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from psyche.core.definitions import ConstantLR, LearningRateSchedule
from psyche.modeling.parallel import ParallelDims, ParallelismError, parse_devices
from psyche.modeling.trainer import Batch, Trainer

from .tiny_trainer import distro, make_trainer

CPU = torch.device("cpu")


def test_parallel_dims_checks_say_how_to_fix() -> None:
    dims = ParallelDims(CPU)
    assert (dims.dp, dims.tp, dims.world_size, dims.is_leader) == (1, 1, 1, True)
    dims.require_world()
    with pytest.raises(ParallelismError, match="--data-parallelism 1"):
        ParallelDims(CPU, dp=0)
    with pytest.raises(ParallelismError, match="--tensor-parallelism 1"):
        ParallelDims(CPU, tp=True)  # type: ignore[arg-type]
    with pytest.raises(ParallelismError, match="--fsdp shards the model over"):
        ParallelDims(CPU, fsdp=True)
    with pytest.raises(ParallelismError, match="rank 4 is outside a world of 4"):
        ParallelDims(CPU, dp=2, tp=2, rank=4)
    two = ParallelDims(CPU, dp=2)
    assert two.world_size == 2
    with pytest.raises(ParallelismError, match="2 ranks need their process group"):
        two.require_world()
    config = SimpleNamespace(
        model_type="llama", num_attention_heads=6, num_key_value_heads=2, intermediate_size=64
    )
    ParallelDims(CPU, tp=2).check_model(config)
    with pytest.raises(ParallelismError, match=r"num_attention_heads \(6\).*1 or 2 or 3 or 6"):
        ParallelDims(CPU, tp=4).check_model(config)
    config.intermediate_size = 65
    with pytest.raises(ParallelismError, match=r"intermediate_size \(65\)"):
        ParallelDims(CPU, tp=2).check_model(config)
    deepseek = SimpleNamespace(
        model_type="deepseek_v3", num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, moe_intermediate_size=6, n_shared_experts=1,
    )  # fmt: skip
    with pytest.raises(ParallelismError, match=r"moe_intermediate_size x n_shared_experts \(6\)"):
        ParallelDims(CPU, tp=4).check_model(deepseek)
    ParallelDims(CPU, tp=2).check_model(deepseek)
    with pytest.raises(
        ParallelismError,
        match="built for llama, seed_oss, deepseek_v2, deepseek_v3 models, not 'gpt2'",
    ):
        ParallelDims(CPU, tp=2).check_model(SimpleNamespace(model_type="gpt2"))
    with pytest.raises(ParallelismError, match="the model is on cpu"):
        ParallelDims(torch.device("cuda", 0)).check_device(CPU)


def test_ranks_are_numbered_as_upstream_and_split_the_rows() -> None:
    # rank = dp_rank * tp + tp_rank; the ranks of one TP group see the same rows
    places = [(d.dp_rank, d.tp_rank) for d in (ParallelDims(CPU, 2, 2, rank=r) for r in range(4))]
    assert places == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [ParallelDims(CPU, 2, 2, rank=r).local_rows(6) for r in range(4)] == [
        (0, 3),
        (0, 3),
        (3, 3),
        (3, 3),
    ]
    # uneven: torch.tensor_split's rule, the first ranks get one more
    rows = [ParallelDims(CPU, 3, rank=r).local_rows(7) for r in range(3)]
    assert rows == [(0, 3), (3, 2), (5, 2)]
    assert [int(t.shape[0]) for t in torch.tensor_split(torch.zeros(7), 3)] == [3, 2, 2]
    assert ParallelDims(CPU).local_rows(5) == (0, 5)
    # every rank runs as many micro-batches as the rank with the most rows
    assert ParallelDims(CPU, 3).micro_batches(7, 2) == 2
    assert ParallelDims(CPU).micro_batches(7, 2) == 4


def test_device_lists() -> None:
    assert parse_devices("cpu", 2) == [CPU, CPU]
    if not torch.cuda.is_available():
        assert parse_devices("auto", 3) == [CPU] * 3
        with pytest.raises(ParallelismError, match="2 ranks need 2 CUDA devices, 0 present"):
            parse_devices("cuda", 2)
        with pytest.raises(ParallelismError, match="cuda:0 does not exist"):
            parse_devices("cuda:0,1", 2)
    with pytest.raises(ParallelismError, match=r"names 1 devices for .* = 2 ranks"):
        parse_devices("cuda:0", 2)
    with pytest.raises(ParallelismError, match="list 2 distinct devices"):
        parse_devices("cuda:1,1", 2)
    with pytest.raises(ParallelismError, match="expected auto, cpu, cuda"):
        parse_devices("mps", 1)
    with pytest.raises(ParallelismError, match="numbers"):
        parse_devices("cuda:a,b", 2)


def test_the_trainer_owns_one_rank_by_default() -> None:
    trainer = make_trainer()
    assert trainer.parallel == ParallelDims(trainer.model.device)
    model = trainer.model
    schedule = LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0))
    with pytest.raises(ParallelismError, match="2 ranks need their process group"):
        Trainer(model, schedule, distro(), 2, parallel=ParallelDims(model.device, tp=2))
    with pytest.raises(ParallelismError, match="this rank's device"):
        Trainer(model, schedule, distro(), 2, parallel=ParallelDims(torch.device("meta")))
    # one rank: whole tensors are the parameters themselves
    full = trainer.full_variables()
    assert all(full[name] is p for name, p in model.variables())


def test_one_rank_micro_batches_are_upstreams_chunks() -> None:
    trainer = make_trainer()  # micro-batch size 2
    batch = Batch(torch.arange(5 * 4).reshape(5, 4))
    chunks = trainer._micro_batches(batch)
    assert [c[0].tolist() for c in chunks] == [
        t.tolist() for t in torch.chunk(batch.input_ids, 3, 0)
    ]
    assert all(c[3] == 1.0 for c in chunks)


def test_activation_checkpointing_recomputes_the_same_bits() -> None:
    from psyche.core.batch_id import BatchId
    from psyche.modeling.sharding import ShardingOptions, parallelize

    plain = make_trainer()
    checkpointed = make_trainer()
    model = parallelize(
        checkpointed.model, checkpointed.parallel, ShardingOptions(activation_checkpointing=True)
    )
    assert model.model.is_activation_checkpointing
    checkpointed = Trainer(
        model, plain.lr_schedule, distro(), micro_batch_size=2, parallel=checkpointed.parallel
    )
    batch = Batch(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3)))
    payloads = []
    for trainer in (plain, checkpointed):
        out = trainer.train_exact(
            1, batch, warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[]
        )
        payloads.append(trainer.prepare_result(out, step=1, batch_id=BatchId(1, 1)))
    assert payloads[0].payload.to_bytes() == payloads[1].payload.to_bytes()
    grads = [[p.grad for _, p in t.model.variables()] for t in (plain, checkpointed)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
