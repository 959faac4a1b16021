"""Top-k compression and index byte views: upstream's distro.rs tests and the wire-width rule."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from psyche.modeling.compression import (
    compress,
    compress_idx,
    decompress,
    decompress_idx,
    index_width,
)
from psyche.modeling.distro import (
    quantize_nozeros_tensor_to_boolean_sign,
    unpack_tensor_sign_from_boolean,
)

I64_MAX = 2**63 - 1
TRUTH_4X4 = [
    [0.5000, 0.5000, 0.5000, 0.5000],
    [0.6533, 0.2706, -0.2706, -0.6533],
    [0.5000, -0.5000, -0.5000, 0.5000],
    [0.2706, -0.6533, 0.6533, -0.2706],
]


def test_compress_2d() -> None:
    r = torch.tensor(
        [
            [0.1911, 0.4076, 0.1649, 0.8059],
            [0.2803, 0.9381, 0.9071, 0.2573],
            [0.4070, 0.5765, 0.7226, 0.9486],
            [0.0737, 0.7378, 0.1898, 0.2990],
        ]
    )
    idx, val, xshape, totalk = compress(r, 2)
    assert idx.dtype == torch.uint8
    assert idx.tolist() == [[3, 1], [1, 2], [3, 2], [1, 3]]
    expected = torch.tensor(
        [[0.8059, 0.4076], [0.9381, 0.9071], [0.9486, 0.7226], [0.7378, 0.2990]]
    )
    assert torch.allclose(val, expected, rtol=1e-4, atol=1e-8)
    assert xshape == [4, 4]
    assert totalk == 4


def test_compress_1d() -> None:
    r = torch.tensor([0.5223, 0.9625, 0.5487, 0.2152, 0.2161, 0.0363, 0.4944, 0.0974])
    idx, val, xshape, totalk = compress(r, 2)
    assert idx.tolist() == [1, 2]
    assert torch.allclose(val, torch.tensor([0.9625, 0.5487]), rtol=1e-4, atol=1e-8)
    assert xshape == [8]
    assert totalk == 8


def test_compress_4d_blocks_flatten_the_last_two_dims() -> None:
    y = torch.zeros(2, 3, 4, 4)
    y[1, 2, 3, 1] = -5.0  # flat index 13 in its block
    idx, val, xshape, totalk = compress(y, 1)
    assert xshape == [2, 3, 4, 4]
    assert totalk == 16
    assert list(idx.shape) == [2, 3, 1]
    assert idx[1, 2, 0].item() == 13
    assert val[1, 2, 0].item() == -5.0


def test_compress_takes_an_encoded_tensor_that_is_not_contiguous() -> None:
    """On CUDA the DCT encode returns a permuted view of its einsum output (found on an H200:
    DiLoCo's sparse encode raised there); compress gives what it gives for a contiguous copy."""
    x = torch.randn(2, 16, 3, 16).permute(0, 2, 1, 3)  # [2, 3, 16, 16], not contiguous
    assert not x.is_contiguous()
    idx, val, xshape, totalk = compress(x, 5)
    c_idx, c_val, c_xshape, c_totalk = compress(x.contiguous(), 5)
    assert (xshape, totalk) == (c_xshape, c_totalk) == ([2, 3, 16, 16], 256)
    assert torch.equal(idx, c_idx)
    assert torch.equal(val, c_val)


def test_topk_is_clamped() -> None:
    assert compress(torch.ones(5), 0)[0].shape == (1,)
    assert compress(torch.ones(5), 99)[0].shape == (5,)


def test_decompress_1d() -> None:
    ret = decompress(
        torch.tensor([1, 2]), torch.tensor([0.9625, 0.5487]), [8], I64_MAX, torch.float32, "cpu"
    )
    truth = torch.tensor([0.0, 0.9625, 0.5487, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert torch.allclose(truth, ret, rtol=1e-4, atol=1e-8)


def test_decompress_2d() -> None:
    idx = torch.tensor([[0, 2], [1, 2], [2, 3], [3, 1]])
    val = torch.tensor([[0.8988, 0.5175], [0.9882, 0.8945], [0.8285, 0.8163], [0.9093, 0.7600]])
    truth = torch.tensor(
        [
            [0.8988, 0.0000, 0.5175, 0.0000],
            [0.0000, 0.9882, 0.8945, 0.0000],
            [0.0000, 0.0000, 0.8285, 0.8163],
            [0.0000, 0.7600, 0.0000, 0.9093],
        ]
    )
    ret = decompress(idx, val, [4, 4], I64_MAX, torch.float32, "cpu")
    assert torch.allclose(truth, ret, rtol=1e-4, atol=1e-8)


def test_decompress_averages_colliding_indices_only() -> None:
    """Per-coefficient mean over the entries that picked it; untouched slots stay exactly 0."""
    idx = torch.tensor([[0, 1, 0, 0]], dtype=torch.uint8)
    val = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.bfloat16)
    ret = decompress(idx, val, [1, 4], 4, torch.bfloat16, "cpu")
    assert ret[0, 0].item() == 0.333984375  # bf16(1/3)
    assert ret[0, 1].item() == -1.0
    assert ret[0, 2:].tolist() == [0.0, 0.0]


def test_signed_vals_reconstructs_original_sign() -> None:
    truth = torch.tensor(TRUTH_4X4)
    sparse_idx, sparse_val, xshape, totalk = compress(truth, I64_MAX)
    decompressed = decompress(sparse_idx, sparse_val.sign(), xshape, totalk, truth.dtype, "cpu")
    assert torch.equal(decompressed, truth.sign())


@pytest.mark.parametrize(
    ("max_value", "width", "dtype"),
    [
        (1, 1, torch.uint8),
        (255, 1, torch.uint8),
        (256, 1, torch.uint8),
        (257, 2, torch.uint8),
        (4096, 2, torch.uint8),
        (65536, 2, torch.uint8),
        (65537, 4, torch.uint8),
        (2**32, 4, torch.uint8),
        (2**32 + 1, 8, torch.int64),
    ],
)
def test_index_byte_views(max_value: int, width: int, dtype: torch.dtype) -> None:
    assert index_width(max_value) == width
    idx = torch.tensor([[0, max_value - 1, max_value // 2]], dtype=torch.int64)
    packed = compress_idx(max_value, idx)
    assert packed.dtype == dtype
    assert packed.shape[-1] == 3 * width if width < 8 else 3
    assert torch.equal(decompress_idx(max_value, packed), idx)


def test_index_bytes_are_little_endian() -> None:
    packed = compress_idx(4096, torch.tensor([0x0102, 0x0FFF]))
    assert packed.tolist() == [0x02, 0x01, 0xFF, 0x0F]


def test_artifical_distro_results_roundtrip() -> None:
    """Random bit patterns (incl. NaN, inf, -0) quantize to their sign bit; indices round-trip."""
    torch.manual_seed(1337)
    ranges_k = [1, 2, 3, 4, 5, 7, 9, 16, 32, 64, 96, 128]
    for r0, r1, s0, s1, k, dtype in itertools.product(
        range(1, 10),
        range(0, 10),
        (1, 7, 512),
        (1, 4, 64),
        ranges_k,
        (torch.bfloat16, torch.float32),
    ):
        nbytes = 2 if dtype == torch.bfloat16 else 4
        size = [r0, k * nbytes] if r1 == 0 else [r0, r1, k * nbytes]
        val = torch.randint(256, size, dtype=torch.uint8).view(dtype)
        roundtripped = unpack_tensor_sign_from_boolean(
            quantize_nozeros_tensor_to_boolean_sign(val), val.dtype
        )
        expected = -2.0 * val.signbit().to(torch.float32) + 1.0
        assert torch.equal(expected.to(val.dtype), roundtripped)
        max_value = s0 * s1
        idx = torch.randint(max_value, val.shape, dtype=torch.int64)
        assert torch.equal(idx, decompress_idx(max_value, compress_idx(max_value, idx)))


def test_1bit_matches_non_quant() -> None:
    torch.manual_seed(1337)
    x = torch.rand(51, 35, 5, 13, 6, dtype=torch.bfloat16) - 0.5
    x = x + (x.sign() + 0.1)
    unquant = unpack_tensor_sign_from_boolean(quantize_nozeros_tensor_to_boolean_sign(x), x.dtype)
    assert torch.equal(x.sign(), unquant)


def test_quantize_maps_negative_zero_and_nan_by_sign_bit() -> None:
    v = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf")])
    assert quantize_nozeros_tensor_to_boolean_sign(v).tolist() == [
        False,
        True,
        False,
        True,
        False,
        True,
    ]


# ---- top-k by magnitude, against answers computed without the code under test ----------------


def _selected(idx: torch.Tensor, val: torch.Tensor, totalk: int) -> list[dict[int, float]]:
    """Per block, {index: value} of what `compress` kept (its top-k is unsorted)."""
    indices = decompress_idx(totalk, idx).reshape(-1, idx.shape[-1] // index_width(totalk))
    values = val.reshape(indices.shape)
    return [
        dict(zip(row_idx.tolist(), row_val.tolist())) for row_idx, row_val in zip(indices, values)
    ]


def test_compress_keeps_the_largest_magnitudes_of_mixed_sign_blocks_by_hand() -> None:
    x = torch.tensor(
        [
            [0.5, -3.0, 2.0, -1.0, 0.25],
            [-4.0, 1.0, -0.5, 3.5, -3.75],
        ]
    )
    idx, val, _, totalk = compress(x, 2)
    # Worked by hand: |x| ranks row 0 as -3.0 (1), 2.0 (2); row 1 as -4.0 (0), -3.75 (4).
    # Top-2 by signed value would be {2.0, 0.5} and {3.5, 1.0}: entirely different.
    assert _selected(idx, val, totalk) == [{1: -3.0, 2: 2.0}, {0: -4.0, 4: -3.75}]


@pytest.mark.parametrize("shape", [(7, 40), (3, 2, 5, 6)])
def test_compress_matches_a_numpy_magnitude_top_k(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)  # both signs, no ties
    topk = 5
    blocks = x.reshape(-1, shape[-2] * shape[-1] if len(shape) > 2 else shape[-1])
    order = np.argsort(-np.abs(blocks), axis=-1, kind="stable")[:, :topk]
    expected = [{int(i): float(row[i]) for i in top} for row, top in zip(blocks, order)]
    signed = np.argsort(-blocks, axis=-1, kind="stable")[:, :topk]
    assert any(set(a) != set(b) for a, b in zip(order, signed))  # signed top-k would differ

    idx, val, xshape, totalk = compress(torch.from_numpy(x), topk)
    assert xshape == list(shape)
    assert totalk == blocks.shape[-1]
    assert _selected(idx, val, totalk) == expected
    # and what decompresses is x with everything outside each block's top-k zeroed
    dense = decompress(idx, val, xshape, totalk, torch.float32, "cpu").numpy().reshape(blocks.shape)
    kept = np.zeros_like(blocks)
    np.put_along_axis(kept, order, np.take_along_axis(blocks, order, axis=-1), axis=-1)
    assert np.array_equal(dense, kept)
