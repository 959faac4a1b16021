"""DiLoCo's math, its sent forms and their checks, and the determinism of its aggregation."""

from __future__ import annotations

import itertools
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
from psyche.modeling.dct import dct
from psyche.modeling.diloco import (
    Diloco,
    DilocoLoop,
    DilocoPeerSimulation,
    DilocoSettings,
    OuterSGD,
    codec,
    deterministic_norm,
    diloco_layouts,
    inner_ranges,
)
from psyche.modeling.diloco.basis import dct_basis
from psyche.modeling.distro import DistroResult
from psyche.modeling.serialized_distro import (
    InvalidDistroResult,
    SerializableTensor,
    SerializableTensorData,
    SerializedDistroResult,
    decode_transmittable,
    serialize_distro_result,
    transmittable_distro_result,
)
from psyche.modeling.trainer import Batch, Trainer

T = DilocoTransmission
LR = 3e-3


def _bf16_payload(values: list[list[float]]) -> list[DistroResult]:
    return [
        DistroResult(
            torch.empty(0, dtype=torch.uint8), torch.tensor(v, dtype=torch.bfloat16), [], 0
        )
        for v in values
    ]


class _Params(torch.nn.Module):
    def __init__(self, *shapes_and_values: tuple[str, torch.Tensor]) -> None:
        super().__init__()
        for name, value in shapes_and_values:
            self.register_parameter(name, torch.nn.Parameter(value.clone()))


# --------------------------------------------------------------------------------------------
# The outer step


def test_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient_by_hand() -> None:
    model = _Params(("w", torch.tensor([1.0, 2.0])))
    settings = DilocoSettings(transmission=T.Bf16, outer_lr=0.5, outer_momentum=0.5, nesterov=True)
    diloco = Diloco(model, settings)
    # two peers: pseudo-gradients [1, 2] and [3, -2]: mean [2, 0]
    diloco.apply([_bf16_payload([[1.0, 2.0]]), _bf16_payload([[3.0, -2.0]])], 0.5)
    # buf = g = [2, 0]; direction = g + 0.5 buf = [3, 0]; w = [1, 2] - 0.5 [3, 0]
    assert model.w.tolist() == [-0.5, 2.0]
    # one peer: g = [1, 1]; buf = 0.5 [2, 0] + [1, 1] = [2, 1]; direction = [1, 1] + [1, 0.5]
    diloco.apply([_bf16_payload([[1.0, 1.0]])], 0.5)
    assert model.w.tolist() == [-1.5, 1.25]
    # an empty round is no step at all
    diloco.apply([], 0.5)
    assert model.w.tolist() == [-1.5, 1.25]
    # the epoch rule: momentum restarts from zero
    diloco.reset_outer_state()
    diloco.apply([_bf16_payload([[1.0, 0.0]])], 0.5)  # buf = [1, 0]; direction = [1.5, 0]
    assert model.w.tolist() == [-2.25, 1.25]


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_sgd_matches_torch_sgd(nesterov: bool) -> None:
    g = torch.Generator().manual_seed(3)
    start = torch.randn(64, generator=g)
    ours, theirs = start.clone(), torch.nn.Parameter(start.clone())
    outer = OuterSGD([ours], 0.9, nesterov)
    reference = torch.optim.SGD([theirs], lr=0.7, momentum=0.9, nesterov=nesterov, foreach=False)
    for _ in range(10):
        grad = torch.randn(64, generator=g)
        outer.step([grad], 0.7)
        theirs.grad = grad.clone()
        reference.step()
        # torch fuses `a + alpha * b` into one rounding where we take two (see OuterSGD)
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-6)


def test_outer_sgd_equals_torch_sgd_bit_for_bit_on_exact_values() -> None:
    """Dyadic values: every product is exact, so fusing cannot change a bit."""
    start = torch.tensor([1.0, -2.0, 0.25, 8.0])
    ours, theirs = start.clone(), torch.nn.Parameter(start.clone())
    outer = OuterSGD([ours], 0.5, True)
    reference = torch.optim.SGD([theirs], lr=0.25, momentum=0.5, nesterov=True, foreach=False)
    for grad in ([1.0, 0.5, -2.0, 4.0], [0.0, 1.0, 1.0, -0.5], [2.0, 2.0, 0.125, 1.0]):
        outer.step([torch.tensor(grad)], 0.25)
        theirs.grad = torch.tensor(grad)
        reference.step()
        assert torch.equal(ours, theirs.detach())


def test_outer_clip_scales_the_mean_to_the_max_norm() -> None:
    model = _Params(("w", torch.zeros(2)))
    diloco = Diloco(
        model,
        DilocoSettings(
            transmission=T.Bf16, outer_momentum=0.0, nesterov=False, outer_clip_grad_norm=1.0
        ),
    )
    diloco.apply([_bf16_payload([[3.0, 4.0]])], 1.0)  # norm 5 -> 1
    torch.testing.assert_close(model.w, torch.tensor([-0.6, -0.8]), rtol=1e-5, atol=0)


def test_deterministic_norm() -> None:
    t = [torch.randn(1000, generator=torch.Generator().manual_seed(1)), torch.ones(3)]
    exact = math.sqrt(math.fsum(float(x) ** 2 for x in torch.cat(t).tolist()))
    assert deterministic_norm(t) == pytest.approx(exact, rel=1e-15)
    assert deterministic_norm([]) == 0.0


def test_inner_ranges() -> None:
    assert inner_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert inner_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert inner_ranges(2, 4) == [(0, 1), (1, 2)]  # fewer samples than inner steps
    assert inner_ranges(0, 4) == []


def test_lookahead_starts_from_the_pending_step_and_leaves_the_run_weights() -> None:
    model = _Params(("w", torch.zeros(4)))
    settings = DilocoSettings(transmission=T.Bf16, outer_lr=0.5, outer_momentum=0.0, nesterov=False)
    diloco = Diloco(model, settings)
    layout = diloco.layouts()[0]
    diloco.begin_round(0, lookahead_lr=0.5)  # nothing of ours is pending
    assert model.w.tolist() == [0.0] * 4
    with torch.no_grad():
        model.w.sub_(torch.tensor([1.0, 2.0, 4.0, 8.0]))  # the inner steps
    diloco.end_round(0)
    assert model.w.tolist() == [0.0] * 4
    # round 0's payload is pending: start from the step it would take alone (0.5 x delta)
    diloco.begin_round(1, lookahead_lr=0.5)
    assert model.w.tolist() == [-0.5, -1.0, -2.0, -4.0]
    with torch.no_grad():
        model.w.sub_(1.0)
    (sent,) = diloco.end_round(1)
    assert codec.decode(sent, layout, "cpu").tolist() == [1.0] * 4  # from the shifted start
    assert model.w.tolist() == [0.0] * 4
    # round 2 sent nothing of ours (an epoch's end, a cancelled round): no lookahead
    diloco.begin_round(3, lookahead_lr=0.5)
    assert model.w.tolist() == [0.0] * 4


def test_the_lookahead_reads_the_measured_pseudo_gradient_not_the_sparse_payload() -> None:
    model = _Params(("w", torch.zeros(16)))
    settings = DilocoSettings(
        compression_chunk=16, compression_topk=1, value_bits=2,
        outer_lr=1.0, outer_momentum=0.0, nesterov=False,
    )  # fmt: skip
    diloco = Diloco(model, settings)
    layout = diloco.layouts()[0]
    delta = torch.linspace(1.0, 2.0, 16)
    diloco.begin_round(0, lookahead_lr=1.0)
    with torch.no_grad():
        model.w.sub_(delta)
    (sent,) = diloco.end_round(0)
    # one DCT coefficient of sixteen was sent: far from what was measured
    assert not torch.allclose(codec.decode(sent, layout, "cpu"), delta, atol=0.1)
    diloco.begin_round(1, lookahead_lr=1.0)
    torch.testing.assert_close(model.w.detach(), -delta)


# --------------------------------------------------------------------------------------------
# The sent forms


def test_basis_is_the_orthonormal_dct() -> None:
    for n in (1, 2, 3, 16, 64):
        f = dct_basis(n).double()
        torch.testing.assert_close(f @ f.T, torch.eye(n, dtype=torch.float64), atol=1e-6, rtol=0)
        if n > 1:
            ref = dct(torch.eye(n, dtype=torch.float64))
            torch.testing.assert_close(f, ref, atol=1e-7, rtol=0)


def _layout(transmission: T, shape: tuple[int, ...], **kw: int) -> codec.DilocoLayout:
    args = {"chunk": 8, "topk": 4, "value_bits": 2, **kw}
    (layout,) = diloco_layouts([("w", shape)], transmission, **args)
    return layout


@pytest.mark.parametrize("shape", [(16, 24), (40,), (3, 16, 24)])
def test_round_trips(shape: tuple[int, ...]) -> None:
    """Every form; the sparse one on 1-D, 2-D and 3-D parameters (a MoE layer's grouped
    experts, blocked as DisTrO blocks them)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    bf16 = _layout(T.Bf16, shape)
    assert torch.equal(codec.decode(codec.encode(x, bf16), bf16, "cpu"), x.bfloat16().float())
    int8 = _layout(T.Int8, shape, chunk=4)  # groups of 16
    back = codec.decode(codec.encode(x, int8), int8, "cpu")
    groups = torch.nn.functional.pad(x.reshape(-1), (0, (-x.numel()) % 16)).view(-1, 16)
    step = (groups.abs().amax(1) / 127).repeat_interleave(16)[: x.numel()].view(shape)
    assert bool(((back - x).abs() <= step / 2 + 1e-7).all())
    # sparse with every coefficient kept at 8 bits: the DCT round trip, up to the code step
    n = 64 if len(shape) >= 2 else 8
    full = _layout(T.Sparse, shape, topk=n, value_bits=8)
    back = codec.decode(codec.encode(x, full), full, "cpu")
    assert (back - x).norm() / x.norm() < 0.01
    # few bits and a small top-k lose most of it, but the sign of the kept mass survives
    sparse = _layout(T.Sparse, shape, topk=4, value_bits=2)
    sent = codec.encode(x, sparse)
    assert codec.sent_bytes(sparse) == sent.sparse_idx.numel() + sent.sparse_val.numel()
    assert float((codec.decode(sent, sparse, "cpu") * x).sum()) > 0
    if len(shape) == 3:  # each expert's matrix is sent as that 2-D matrix alone would be
        (one,) = diloco_layouts([("w", shape[1:])], T.Sparse, chunk=8, topk=4, value_bits=2)
        for e in range(shape[0]):
            alone = codec.encode(x[e], one)
            assert torch.equal(alone.sparse_idx, sent.sparse_idx[e])
            assert torch.equal(alone.sparse_val, sent.sparse_val[e])


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_code_packing(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (5, 7), generator=torch.Generator().manual_seed(bits))
    packed = codec._pack_codes(codes, bits)
    assert packed.shape == (5, math.ceil(7 * bits / 8))
    assert torch.equal(codec._unpack_codes(packed, bits, 7)[:, :7], codes.to(torch.int32))


def test_error_feedback_delivers_everything_eventually() -> None:
    """What was sent plus the residual is the sum of the pseudo-gradients."""
    model = _Params(("a", torch.zeros(16, 16)), ("b", torch.zeros(16)))
    diloco = Diloco(model, DilocoSettings(compression_chunk=8, compression_topk=2, value_bits=1))
    total = [torch.zeros(16, 16), torch.zeros(16)]
    delivered = [torch.zeros(16, 16), torch.zeros(16)]
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        diloco.begin_round()
        with torch.no_grad():
            for i, p in enumerate(diloco.params):
                delta = torch.randn(p.shape, generator=g)
                p.sub_(delta)
                total[i] += delta
        sent = diloco.end_round()
        for i, p in enumerate(diloco.params):
            assert bool((p == 0).all())  # the weights are the round's again
            delivered[i] += codec.decode(sent[i], diloco.layouts()[i], "cpu")
    assert diloco.residuals is not None
    for t, d, r in zip(total, delivered, diloco.residuals):
        torch.testing.assert_close(d + r, t, atol=1e-4, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Checks of received payloads


def _wire(transmission: T, **kw: int) -> tuple[Diloco, SerializedDistroResult]:
    model = _Params(("w", torch.zeros(16, 16)))
    settings = DilocoSettings(transmission=transmission, compression_chunk=8, **kw)
    diloco = Diloco(model, settings)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(5))
    return diloco, serialize_distro_result(codec.encode(x, diloco.layouts()[0]))


def _tensor(
    t: SerializableTensor, raw: bytes | None = None, **changes: object
) -> SerializableTensor:
    return SerializableTensor(
        changes.get("dims", t.dims),  # type: ignore[arg-type]
        changes.get("kind", t.kind),  # type: ignore[arg-type]
        False,
        SerializableTensorData.Full(raw if raw is not None else t.raw_tensor_data()),
    )


def _check(diloco: Diloco, entry: SerializedDistroResult, message: str) -> None:
    payload = transmittable_distro_result([], 1, 0, BatchId(0, 0))
    payload = type(payload)(1, 0, BatchId(0, 0), [entry])
    with pytest.raises(InvalidDistroResult, match=message):
        diloco.results_from_transmittable(payload)


def test_valid_payloads_pass() -> None:
    for transmission in T:
        diloco, entry = _wire(transmission)
        payload = type(transmittable_distro_result([], 1, 0, BatchId(0, 0)))(
            1, 0, BatchId(0, 0), [entry]
        )
        (result,) = diloco.results_from_transmittable(decode_transmittable(payload.to_bytes()))
        assert torch.equal(result.sparse_val, codec_tensor(entry.sparse_val))


def codec_tensor(t: SerializableTensor) -> torch.Tensor:
    from psyche.modeling.serialized_distro import torch_from_serializable_tensor

    return torch_from_serializable_tensor(t)


def test_hostile_sparse_payloads_are_refused() -> None:
    diloco, e = _wire(T.Sparse, compression_topk=4, value_bits=2)
    idx, val = e.sparse_idx, e.sparse_val
    rows = bytearray(idx.raw_tensor_data())
    dup = bytearray(rows)
    dup[1] = dup[0]
    _check(
        diloco, SerializedDistroResult(_tensor(idx, bytes(dup)), val, e.xshape, e.totalk), "repeats"
    )
    high = bytearray(rows)
    high[0] = 64  # blocks of 8 x 8 = 64 coefficients
    _check(
        diloco,
        SerializedDistroResult(_tensor(idx, bytes(high)), val, e.xshape, e.totalk),
        "out of range",
    )
    _check(diloco, SerializedDistroResult(idx, val, [1, 4, 8, 8], e.totalk), "xshape")
    _check(diloco, SerializedDistroResult(idx, val, e.xshape, 65), "totalk")
    _check(diloco, SerializedDistroResult(idx, _tensor(val, kind=6, raw=bytes(len(val.raw_tensor_data()) * 4)), e.xshape, e.totalk), "kind Float")  # fmt: skip
    short = _tensor(val, raw=val.raw_tensor_data()[:-1])
    _check(diloco, SerializedDistroResult(idx, short, e.xshape, e.totalk), "data bytes")
    raw = bytearray(val.raw_tensor_data())
    raw[0:2] = bytes([0xC0, 0x7F])  # bf16 NaN scale
    _check(
        diloco, SerializedDistroResult(idx, _tensor(val, bytes(raw)), e.xshape, e.totalk), "scale"
    )
    raw = bytearray(val.raw_tensor_data())
    raw[0:2] = bytes([0x00, 0x48])  # bf16 131072, beyond MAX_ABS_VALUE
    _check(
        diloco, SerializedDistroResult(idx, _tensor(val, bytes(raw)), e.xshape, e.totalk), "beyond"
    )


def test_padding_bits_must_be_zero() -> None:
    diloco, e = _wire(T.Sparse, compression_topk=3, value_bits=2)  # 6 bits of codes in a byte
    raw = bytearray(e.sparse_val.raw_tensor_data())
    raw[2] |= 0x80
    _check(diloco, SerializedDistroResult(e.sparse_idx, _tensor(e.sparse_val, bytes(raw)), e.xshape, e.totalk), "padding")  # fmt: skip


def test_hostile_dense_payloads_are_refused() -> None:
    diloco, e = _wire(T.Int8)
    scales = bytearray(e.sparse_idx.raw_tensor_data())
    scales[0:4] = bytes([0, 0, 0x80, 0xFF])  # -inf
    _check(diloco, SerializedDistroResult(_tensor(e.sparse_idx, bytes(scales)), e.sparse_val, [], e.totalk), "scale")  # fmt: skip
    codes = bytearray(e.sparse_val.raw_tensor_data())
    codes[3] = 0x80
    _check(diloco, SerializedDistroResult(e.sparse_idx, _tensor(e.sparse_val, bytes(codes)), [], e.totalk), "-128")  # fmt: skip
    _check(diloco, SerializedDistroResult(e.sparse_idx, e.sparse_val, [], 3), "totalk")
    _check(diloco, SerializedDistroResult(e.sparse_idx, _tensor(e.sparse_val, dims=[256]), [], e.totalk), "dims")  # fmt: skip
    diloco, e = _wire(T.Bf16)
    values = bytearray(e.sparse_val.raw_tensor_data())
    values[0:2] = bytes([0x80, 0x7F])  # +inf
    _check(diloco, SerializedDistroResult(e.sparse_idx, _tensor(e.sparse_val, bytes(values)), [], 0), "infinite")  # fmt: skip
    payload = type(transmittable_distro_result([], 1, 0, BatchId(0, 0)))(1, 0, BatchId(0, 0), [])
    with pytest.raises(InvalidDistroResult, match="0 entries"):
        diloco.results_from_transmittable(payload)


# --------------------------------------------------------------------------------------------
# Deterministic aggregation


def _random_rounds(sender: Diloco, rounds: int, seed: int) -> list[list[DistroResult]]:
    """`sender`'s payloads of `rounds` rounds, each after a small random move of its
    parameters."""
    g = torch.Generator().manual_seed(seed)
    payloads = []
    for _ in range(rounds):
        sender.begin_round()
        with torch.no_grad():
            for p in sender.params:
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)
        payloads.append(sender.end_round())
    return payloads


@pytest.mark.parametrize("transmission", list(T))
def test_aggregation_is_the_same_bits_in_any_order(transmission: T) -> None:
    shapes = [("a", torch.zeros(32, 48)), ("b", torch.zeros(48))]
    settings = DilocoSettings(transmission=transmission, compression_chunk=16, value_bits=4)
    payloads = _random_rounds(Diloco(_Params(*shapes), settings), 4, seed=6)
    finals = set()
    for order in itertools.permutations(range(4)):
        model = _Params(*shapes)
        diloco = Diloco(model, settings)
        for _ in range(2):  # two outer steps: momentum enters too
            diloco.apply([payloads[i] for i in order], 0.7)
        finals.add(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    assert len(finals) == 1


# --------------------------------------------------------------------------------------------
# The trainer and the research API


def _trainer(tiny_llama: Callable, settings: DilocoSettings) -> Trainer:
    schedule = LearningRateSchedule.Constant(ConstantLR(LR, 0.0, 0))
    definition = OptimizerDefinition.DiLoCo(settings.definition())
    return Trainer(tiny_llama(), schedule, definition, micro_batch_size=8)


def test_trainer_round_restores_weights_and_counts_one_nonce(
    tiny_llama: Callable, corpus: torch.Tensor
) -> None:
    trainer = _trainer(tiny_llama, DilocoSettings(inner_steps=4))
    before = [p.detach().clone() for _, p in trainer.model.variables()]
    out = trainer.train_exact(
        1, Batch(corpus[:8]), warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[]
    )
    assert out.nonce == 0
    assert trainer.nonce == 1
    assert math.isfinite(out.loss)
    assert all(torch.equal(a, p) for a, (_, p) in zip(before, trainer.model.variables()))
    prepared = trainer.prepare_result(out, step=1, batch_id=BatchId(0, 7))
    back = trainer.results_from_payload(decode_transmittable(prepared.payload.to_bytes()))
    trainer.optimize(1, distro_results=[back])
    assert not all(torch.equal(a, p) for a, (_, p) in zip(before, trainer.model.variables()))


def test_simulation_matches_client_style_trainers_bit_for_bit(
    tiny_llama: Callable, corpus: torch.Tensor
) -> None:
    """Three `Trainer`s driven as Psyche clients drive them (train_exact, the payload, the
    apply of round N - 2 at round N) end with the simulation's weights, bit for bit."""
    settings = DilocoSettings(inner_steps=2, compression_chunk=16, compression_topk=8)
    trainers = [_trainer(tiny_llama, settings) for _ in range(3)]
    sim = DilocoPeerSimulation(
        [tiny_llama().model for _ in range(3)], settings, lr=LR, through_wire=True
    )
    rounds = 4
    in_flight: list[list[list[DistroResult]]] = []
    for r in range(rounds):
        for inner in range(2):
            sim.zero_grad()
            for i, m in enumerate(sim.models):
                ids = corpus[(r * 3 + i) * 4 + inner * 2 :][:2]
                m(ids, labels=ids, use_cache=False).loss.backward()
            sim.step(r * 2 + inner + 1)
        payloads = []
        for i, t in enumerate(trainers):
            ids = corpus[(r * 3 + i) * 4 :][:4]
            out = t.train_exact(
                r, Batch(ids), warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[]
            )
            prepared = t.prepare_result(out, step=r, batch_id=BatchId(i, i))
            payloads.append(prepared.payload)
        in_flight.append(payloads)
        if len(in_flight) > 1:
            due = in_flight.pop(0)
            for t in trainers:
                t.optimize(r, distro_results=[t.results_from_payload(p) for p in due])
    assert sim.outer_steps == rounds - 1
    for replica in sim.replicas:  # between rounds a replica holds its lookahead start
        replica.diloco.abort_round()
    for t in trainers:
        mine = dict(t.model.variables())
        for name, q in sim.models[0].named_parameters():
            assert torch.equal(mine[name], q), name


def test_loop_learns_and_payloads_are_small(tiny_llama: Callable, corpus: torch.Tensor) -> None:
    model = tiny_llama()
    loop = DilocoLoop(model.model, DilocoSettings(inner_steps=4), lr=LR, through_wire=True)
    losses = []
    for step in range(1, 41):
        loop.zero_grad()
        ids = corpus[(step - 1) * 8 : step * 8]
        loss = model.model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(float(loss.detach()))
        loop.step(step)
    loop.flush(40)
    assert loop.outer_steps == 10
    assert sum(losses[-4:]) < sum(losses[:4]) * 0.8
    dense_bf16 = 2 * sum(p.numel() for p in model.model.parameters())
    assert loop.last_payload_bytes[0] * 20 < dense_bf16


@pytest.mark.gpu
@pytest.mark.parametrize("transmission", list(T))
def test_cpu_and_cuda_take_the_same_outer_step(transmission: T) -> None:
    """The aggregation's rules (elementwise ops, fixed order, software basis) give the same bits
    on a GPU as on the CPU, clipping and momentum included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    shapes = [("a", torch.zeros(64, 96)), ("b", torch.zeros(96))]
    settings = DilocoSettings(
        transmission=transmission, compression_chunk=16, value_bits=2, outer_clip_grad_norm=0.5
    )
    payloads = _random_rounds(Diloco(_Params(*shapes), settings), 3, seed=8)
    finals = []
    for device in ("cpu", "cuda"):
        model = _Params(*shapes).to(device)
        diloco = Diloco(model, settings)
        for _ in range(3):
            diloco.apply(payloads, 0.7)
        finals.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*finals):
        assert torch.equal(a, b)
