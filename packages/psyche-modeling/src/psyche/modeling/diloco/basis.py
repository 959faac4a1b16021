"""The orthonormal DCT-II basis, the same float32 bits on every machine.

DisTrO builds its bases through torch's FFT on the parameter's device; DiLoCo's aggregation must
give the same bits on any device, so its basis is computed here from the cosine formula in
Python's `decimal` arithmetic (pure software, 40 digits), rounded once to float64 and then to
float32: no libm, FFT or BLAS takes part. A basis is at most 255 x 255 (`compression_chunk` is a
u8) and is built once per size.
"""

from __future__ import annotations

import functools
from decimal import Decimal, localcontext

import numpy as np
import torch

_DIGITS = 40


def _pi() -> Decimal:
    """pi to the context's precision (Python's `decimal` recipe)."""
    with localcontext() as ctx:
        ctx.prec += 2
        three = Decimal(3)
        lasts, t, s, n, na, d, da = Decimal(0), three, Decimal(3), 1, 0, 0, 24
        while s != lasts:
            lasts = s
            n, na = n + na, na + 8
            d, da = d + da, da + 32
            t = (t * n) / d
            s += t
    return +s


def _cos(x: Decimal) -> Decimal:
    """cos(x) by its Taylor series (|x| <= pi here), to the context's precision."""
    with localcontext() as ctx:
        ctx.prec += 2
        i, lasts, s, fact, num, sign = 0, Decimal(0), Decimal(1), 1, Decimal(1), 1
        while s != lasts:
            lasts = s
            i += 2
            fact *= i * (i - 1)
            num *= x * x
            sign *= -1
            s += num / fact * sign
    return +s


@functools.lru_cache(maxsize=64)
def _basis_numpy(n: int) -> np.ndarray:
    """`F[j, k] = a_k cos(pi (2j + 1) k / (2n))`, `a_0 = sqrt(1/n)`, `a_k = sqrt(2/n)`."""
    if n < 1:
        raise ValueError(f"a DCT basis needs n >= 1, got {n}")
    with localcontext() as ctx:
        ctx.prec = _DIGITS
        pi = _pi()
        # cos(pi m / (2n)) depends on m mod 4n only: 4n distinct angles
        cosines = []
        for m in range(4 * n):
            r = m % (4 * n)
            # fold into [0, pi] so the series converges fast: cos(x) = cos(2 pi - x)
            if r > 2 * n:
                r = 4 * n - r
            cosines.append(_cos(pi * r / (2 * n)))
        a0 = (Decimal(1) / n).sqrt()
        ak = (Decimal(2) / n).sqrt()
        out = np.empty((n, n), dtype=np.float64)
        for j in range(n):
            for k in range(n):
                scale = a0 if k == 0 else ak
                out[j, k] = float(scale * cosines[((2 * j + 1) * k) % (4 * n)])
    return out.astype(np.float32)


def dct_basis(n: int) -> torch.Tensor:
    """The `n x n` orthonormal DCT-II basis `F` (float32, CPU): coefficients are `x @ F`, and
    `F[:, k]` is the signal of coefficient `k`."""
    return torch.from_numpy(_basis_numpy(n).copy())
