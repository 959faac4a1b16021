"""Chunk sizes and the DCT transform: upstream's distro.rs unit tests with their vectors."""

from __future__ import annotations

import math

import pytest
import torch

from psyche.modeling.dct import (
    TransformDCT,
    dct,
    get_divisors,
    get_prime_divisors,
    get_smaller_split,
    idct,
)


def _transform_for(t: torch.Tensor, chunk: int = 64) -> TransformDCT:
    return TransformDCT([(t.shape, t.dtype, t.device)], chunk)


def test_get_prime_divisors() -> None:
    assert get_prime_divisors(1) == []
    assert get_prime_divisors(2) == [2]
    assert get_prime_divisors(12) == [2, 2, 3]
    assert get_prime_divisors(15) == [3, 5]
    assert get_prime_divisors(100) == [2, 2, 5, 5]
    assert get_prime_divisors(2310) == [2, 3, 5, 7, 11]


def test_get_divisors() -> None:
    assert get_divisors(1) == [1]
    assert get_divisors(2) == [1, 2]
    assert get_divisors(12) == [1, 2, 3, 4, 6, 12]
    assert get_divisors(15) == [1, 3, 5, 15]
    assert get_divisors(100) == [1, 2, 4, 5, 10, 20, 25, 50, 100]


def test_get_smaller_split() -> None:
    assert get_smaller_split(12, 3) == 3
    assert get_smaller_split(12, 4) == 4
    assert get_smaller_split(12, 5) == 4
    assert get_smaller_split(100, 7) == 5
    assert get_smaller_split(100, 26) == 25
    assert get_smaller_split(100, 101) == 100
    assert get_smaller_split(1, 1) == 1


def test_edge_cases() -> None:
    assert get_prime_divisors(0) == []
    assert get_divisors(0) == []
    assert get_smaller_split(0, 1) == 0


def test_large_numbers() -> None:
    assert get_prime_divisors(1000000007) == [1000000007]
    assert get_divisors(1000000007) == [1, 1000000007]
    assert get_smaller_split(1000000007, 500000000) == 1


@pytest.mark.parametrize(
    ("n", "chunk"), [(4096, 64), (11008, 64), (32000, 64), (128256, 64), (50257, 29), (2048, 64)]
)
def test_model_dimension_chunks(n: int, chunk: int) -> None:
    assert get_smaller_split(n, 64) == chunk


def test_smaller_split_is_largest_divisor_at_most_target() -> None:
    for n in range(1, 300):
        for target in (1, 7, 16, 64):
            expected = max(d for d in range(1, n + 1) if n % d == 0 and d <= target)
            assert get_smaller_split(n, target) == expected, (n, target)


def test_dct() -> None:
    truth = torch.tensor(
        [
            [0.5000, 0.6533, 0.5000, 0.2706],
            [0.5000, 0.2706, -0.5000, -0.6533],
            [0.5000, -0.2706, -0.5000, 0.6533],
            [0.5000, -0.6533, 0.5000, -0.2706],
        ]
    )
    assert torch.allclose(dct(torch.eye(4), True), truth, rtol=1e-4, atol=1e-8)


def test_idct() -> None:
    truth = torch.tensor(
        [
            [0.5000, 0.5000, 0.5000, 0.5000],
            [0.6533, 0.2706, -0.2706, -0.6533],
            [0.5000, -0.5000, -0.5000, 0.5000],
            [0.2706, -0.6533, 0.6533, -0.2706],
        ]
    )
    assert torch.allclose(idct(torch.eye(4), True), truth, rtol=1e-4, atol=1e-8)


def test_fft_basis_is_not_the_analytic_formula() -> None:
    """The bases must be built through the FFT: the analytic cosines differ in the last bits."""
    n = 12
    i = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    k = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    scale = torch.where(k == 0, math.sqrt(1 / n), math.sqrt(2 / n))
    analytic = (scale * torch.cos(math.pi * (2 * i + 1) * k / (2 * n))).float()
    built = dct(torch.eye(n), True)
    assert torch.allclose(built, analytic, atol=1e-6)
    assert not torch.equal(built, analytic)


ENCODED_ARANGE8 = [
    9.8995e00,
    -6.4423e00,
    -4.7684e-07,
    -6.7345e-01,
    2.3842e-07,
    -2.0090e-01,
    -1.1921e-07,
    -5.0702e-02,
]


def test_encode_1d() -> None:
    a = torch.arange(8, dtype=torch.float32)
    ret = _transform_for(a).encode(a).squeeze()
    assert torch.allclose(torch.tensor(ENCODED_ARANGE8), ret, rtol=1e-4, atol=1e-4)
    # The residues upstream's vector shows are reproduced exactly (same FFT route, same ops).
    assert ret[2].item() == -4.76837158203125e-07
    assert ret[4].item() == 2.384185791015625e-07
    assert ret[6].item() == -1.1920928955078125e-07


def test_encode_2d() -> None:
    b = torch.eye(4)
    truth = torch.eye(4)
    truth[1, 3] = truth[3, 1] = -5.9605e-08
    ret = _transform_for(b).encode(b).squeeze()
    assert torch.allclose(truth, ret, rtol=1e-4, atol=1e-4)
    assert ret[1, 3].item() == -5.960464477539063e-08
    assert ret[3, 1].item() == -5.960464477539063e-08


def test_decode_1d() -> None:
    a = torch.arange(8, dtype=torch.float32)
    encoded = torch.tensor([ENCODED_ARANGE8])
    truth = torch.tensor([-2.2352e-07, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    ret = _transform_for(a).decode(encoded)
    assert torch.allclose(truth, ret, rtol=1e-4, atol=1e-4)


def test_decode_2d() -> None:
    b = torch.eye(4)
    encoded = torch.eye(4)
    encoded[1, 3] = encoded[3, 1] = -5.9605e-08
    truth = torch.tensor(
        [
            [1.0000e00, 1.4901e-08, 4.4703e-08, 4.4703e-08],
            [2.9802e-08, 1.0000e00, -2.9802e-08, 4.4703e-08],
            [4.4703e-08, -2.9802e-08, 1.0000e00, 2.9802e-08],
            [4.4703e-08, 4.4703e-08, 1.4901e-08, 1.0000e00],
        ]
    )
    ret = _transform_for(b).decode(encoded.unsqueeze(0).unsqueeze(0))
    assert torch.allclose(truth, ret, rtol=1e-4, atol=1e-4)


def test_encode_decode_round_trip_blocks() -> None:
    """A 2-D parameter is cut into n1 x n2 blocks laid out [R/n1, C/n2, n1, n2]."""
    x = torch.randn(96, 40, dtype=torch.float64)
    t = TransformDCT([(x.shape, x.dtype, x.device)], 16)
    assert (t.chunk_size(96), t.chunk_size(40)) == (16, 10)
    encoded = t.encode(x)
    assert list(encoded.shape) == [6, 4, 16, 10]
    assert t.encoded_shape(x.shape) == ([6, 4, 16, 10], 160)
    torch.testing.assert_close(t.decode(encoded), x, atol=1e-5, rtol=0)  # f32-built bases
    # block (1, 2) is the 2-D DCT of rows 16..32, columns 20..30
    block = x[16:32, 20:30]
    f16 = dct(torch.eye(16)).double()
    f10 = dct(torch.eye(10)).double()
    torch.testing.assert_close(encoded[1, 2], f16.T @ block @ f10)


def test_bases_follow_first_parameter_dtype_and_are_cached() -> None:
    w = torch.zeros(64, 128, dtype=torch.bfloat16)
    t = TransformDCT([(w.shape, w.dtype, w.device)], 64)
    assert t.encode(torch.ones(64, 128, dtype=torch.bfloat16)).dtype == torch.bfloat16
    basis = t._f[(64, torch.bfloat16, torch.device("cpu"))]
    assert torch.equal(basis, dct(torch.eye(64)).to(torch.bfloat16))
