"""A frozen copy of DisTrO's generate/apply path as it was before the fast paths (commit dd9db0b).

The fast-path tests compare the live `psyche.modeling.distro.Distro` against this copy bit for bit.
It is a verbatim copy of `dct.py`, `compression.py` and `distro.py` at that commit (imports merged,
the three modules concatenated); do not "fix" or speed it up: its only job is to stay what the
port computed, op for op, before the optimisation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

# ============================================================================================
# dct.py
# --------------------------------------------------------------------------------------------
# Chunk sizes


def get_prime_divisors(n: int) -> list[int]:
    """Prime factors of `n` in ascending order, with multiplicity (empty for 0 and 1)."""
    if n == 0:
        return []
    divisors: list[int] = []
    while n % 2 == 0:
        divisors.append(2)
        n //= 2
    while n % 3 == 0:
        divisors.append(3)
        n //= 3
    i = 5
    while i * i <= n:
        for k in (i, i + 2):
            while n % k == 0:
                divisors.append(k)
                n //= k
        i += 6
    if n > 1:
        divisors.append(n)
    return divisors


def get_divisors(n: int) -> list[int]:
    """All divisors of `n`, ascending (empty for n < 1)."""
    if n < 1:
        return []
    if n == 1:
        return [1]
    divisors = [1]
    last_prime = 0
    factor = 0
    slice_len = 0
    for prime in get_prime_divisors(n):
        if last_prime != prime:
            slice_len = len(divisors)
            factor = prime
        else:
            factor *= prime
        for i in range(slice_len):
            divisors.append(divisors[i] * factor)
        last_prime = prime
    divisors.sort()
    return divisors


def get_smaller_split(n: int, close_to: int) -> int:
    """The largest divisor of `n` that is at most `close_to` (`n` itself when n <= close_to)."""
    divisors = get_divisors(n)
    for ix, val in enumerate(divisors):
        if val == close_to:
            return val
        if val > close_to:
            return val if ix == 0 else divisors[ix - 1]
    return n


# --------------------------------------------------------------------------------------------
# DCT-II / DCT-III through the FFT (Makhoul), float32


def dct(x: torch.Tensor, ortho: bool = True) -> torch.Tensor:
    """Orthonormal DCT-II along the last dimension, computed exactly as upstream does."""
    x_shape = x.shape
    n = x_shape[-1]
    x = x.contiguous().view(-1, n)
    v = torch.cat([x[:, 0::2], x[:, 1::2].flip([1])], 1)
    vc = torch.view_as_real(torch.fft.fft(v, dim=1, norm="backward"))
    k = -(
        torch.arange(n, dtype=torch.float32, device=x.device).unsqueeze(0) * (math.pi / (2.0 * n))
    )
    w_r = k.cos()
    w_i = k.sin()
    out = vc[:, :, 0] * w_r - vc[:, :, 1] * w_i
    if ortho:
        out[:, 0].div_(math.sqrt(n) * 2.0)
        out[:, 1:].div_(math.sqrt(n / 2.0) * 2.0)
    return out.mul_(2.0).view(x_shape)


def idct(x: torch.Tensor, ortho: bool = True) -> torch.Tensor:
    """Inverse of `dct` (orthonormal DCT-III along the last dimension), as upstream computes it."""
    x_shape = x.shape
    n = x_shape[-1]
    x_v = x.contiguous().view(-1, n) / 2.0
    if ortho:
        x_v[:, 0:1].mul_(math.sqrt(n) * 2.0)
        x_v[:, 1:n].mul_(math.sqrt(n / 2.0) * 2.0)
    k = (torch.arange(n, dtype=torch.float32, device=x.device) * (math.pi / (2.0 * n))).unsqueeze(0)
    w_r = k.cos()
    w_i = k.sin()
    v_t_r = x_v
    v_t_i = torch.cat([x_v[:, 0:1] * 0.0, -(x_v.flip([1])[:, 0 : n - 1])], 1)
    v_r = v_t_r * w_r - v_t_i * w_i
    v_i = v_t_r * w_i + v_t_i * w_r
    v = torch.cat([v_r.unsqueeze(2), v_i.unsqueeze(2)], 2)
    v = torch.fft.irfft(torch.view_as_complex(v), n=v.shape[1], dim=1, norm="backward")
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    out[:, 0::2].add_(v[:, 0 : n - n // 2])
    out[:, 1::2].add_(v.flip([1])[:, 0 : n // 2])
    return out.view(x_shape)


def _einsum(equation: str, operands: list[torch.Tensor]) -> torch.Tensor:
    # No path argument: libtorch contracts left to right, as upstream's tch call does.
    return torch._VF.einsum(equation, operands)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# The transform


class TransformDCT:
    """Per-dimension chunk sizes and cached DCT bases for a set of parameter shapes.

    `shapes` gives, in the optimizer's variable order, each parameter's full shape, dtype and
    device: a basis is built once per chunk size, on the device and in the dtype of the first
    parameter that needs it (as upstream does). Copies for other devices or dtypes are cached.
    """

    def __init__(
        self,
        shapes: Iterable[tuple[Sequence[int], torch.dtype, torch.device]],
        target_chunk: int,
    ) -> None:
        self.target_chunk = target_chunk
        self.shape_dict: dict[int, int] = {}
        self._f: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._b: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._home: dict[int, tuple[torch.dtype, torch.device]] = {}
        with torch.no_grad():
            for shape, dtype, device in shapes:
                for s in shape:
                    sc = self.shape_dict.get(s)
                    if sc is None:
                        sc = get_smaller_split(s, target_chunk)
                        self.shape_dict[s] = sc
                    if sc in self._home:
                        continue
                    eye = torch.eye(sc, dtype=torch.float32, device=device)
                    self._home[sc] = (dtype, torch.device(device))
                    key = (sc, dtype, torch.device(device))
                    self._f[key] = dct(eye, True).to(dtype).to(device)
                    self._b[key] = idct(eye, True).to(dtype).to(device)

    def chunk_size(self, dim: int) -> int:
        return self.shape_dict[dim]

    def _basis(
        self,
        table: dict[tuple[int, torch.dtype, torch.device], torch.Tensor],
        sc: int,
        like: torch.Tensor,
    ) -> torch.Tensor:
        key = (sc, like.dtype, like.device)
        basis = table.get(key)
        if basis is None:
            home = self._home.get(sc)
            if home is None:
                raise KeyError(f"no DCT basis of size {sc}: that size was not in the model")
            # Upstream builds each basis once in the first user's dtype and moves it to the
            # tensor's device; a different dtype (mixed-precision models) is cast from it.
            basis = table[(sc, *home)].to(like.device).to(like.dtype)
            table[key] = basis
        return basis

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., R, C]` -> `[..., R/n1, C/n2, n1, n2]`; a 1-D `[N]` -> `[N/n1, n1]`."""
        shape = list(x.shape)
        if len(shape) > 1:
            n1 = self.shape_dict[shape[-2]]
            n2 = self.shape_dict[shape[-1]]
            f1 = self._basis(self._f, n1, x)
            f2 = self._basis(self._f, n2, x)
            x = x.view(*shape[:-2], shape[-2] // n1, n1, shape[-1] // n2, n2)
            return _einsum("...ijkl, jb, ld -> ...ikbd", [x, f1, f2])
        n1 = self.shape_dict[shape[0]]
        f1 = self._basis(self._f, n1, x)
        return _einsum("...ij, jb -> ...ib", [x.view(-1, n1), f1])

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of `encode` (given the encoded layout)."""
        shape = list(x.shape)
        if len(shape) > 2:
            n1, n2 = shape[-2], shape[-1]
            b1 = self._basis(self._b, n1, x)
            b2 = self._basis(self._b, n2, x)
            y = _einsum("...ijkl, kb, ld -> ...ibjd", [x, b1, b2])
            ys = list(y.shape)
            return y.reshape(*ys[:-4], ys[-4] * ys[-3], ys[-2] * ys[-1])
        n1 = shape[1]
        b1 = self._basis(self._b, n1, x)
        y = _einsum("...ij, jb -> ...ib", [x, b1])
        return y.reshape(y.shape[0] * y.shape[1])

    def encoded_shape(self, shape: Sequence[int]) -> tuple[list[int], int]:
        """`(xshape, totalk)` that `encode` + `compress` produce for a parameter of `shape`."""
        shape = list(shape)
        if len(shape) > 1:
            n1 = self.shape_dict[shape[-2]]
            n2 = self.shape_dict[shape[-1]]
            return [*shape[:-2], shape[-2] // n1, shape[-1] // n2, n1, n2], n1 * n2
        n1 = self.shape_dict[shape[0]]
        return [shape[0] // n1, n1], n1


# ============================================================================================
# compression.py
U8_LIMIT = 256
U16_LIMIT = 65536
U32_LIMIT = 4294967296


def index_width(max_value: int) -> int:
    """Bytes per transmitted index for blocks of `max_value` coefficients (8 = raw int64)."""
    if max_value <= U8_LIMIT:
        return 1
    if max_value <= U16_LIMIT:
        return 2
    if max_value <= U32_LIMIT:
        return 4
    return 8


def compress_idx(max_value: int, idx: torch.Tensor) -> torch.Tensor:
    """int64 indices -> byte view (last dim grows by the index width)."""
    if max_value <= U8_LIMIT:
        return idx.to(torch.uint8)
    if max_value <= U16_LIMIT:
        return idx.to(torch.uint16).view(torch.uint8)
    if max_value <= U32_LIMIT:
        return idx.to(torch.uint32).view(torch.uint8)
    return idx


def decompress_idx(max_value: int, idx: torch.Tensor) -> torch.Tensor:
    """Byte view from `compress_idx` -> int64 indices."""
    if max_value <= U8_LIMIT:
        viewed = idx.view(torch.uint8)
    elif max_value <= U16_LIMIT:
        viewed = idx.view(torch.uint16)
    elif max_value <= U32_LIMIT:
        viewed = idx.view(torch.uint32)
    else:
        viewed = idx
    return viewed.to(torch.int64)


def clamp_topk(last_dim: int, topk: int) -> int:
    if topk > last_dim:
        return last_dim
    if topk < 1:
        return 1
    return topk


def compress(x: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """Keep the `topk` largest-magnitude coefficients of each block.

    Returns `(idx bytes, signed values, xshape, totalk)`; blocks are the last dimension, or the
    last two flattened for encoded 2-D parameters. The top-k is unsorted, as upstream's.
    """
    xshape = list(x.shape)
    if len(xshape) > 2:
        x = x.view(*xshape[:-2], xshape[-2] * xshape[-1])
    totalk = x.shape[-1]
    k = clamp_topk(totalk, topk)
    idx = x.abs().topk(k, dim=-1, largest=True, sorted=False).indices
    val = x.gather(-1, idx)
    return compress_idx(totalk, idx), val, xshape, totalk


def decompress(
    idx: torch.Tensor,
    val: torch.Tensor,
    xshape: Sequence[int],
    totalk: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Scatter values back into dense blocks; colliding indices average (untouched stay 0)."""
    totalk = abs(totalk)
    idx = decompress_idx(totalk, idx)
    val = val.to(dtype)
    xshape = list(xshape)
    x = torch.zeros(xshape, dtype=dtype, device=device)
    if len(xshape) > 2:
        x = x.view(*xshape[:-2], xshape[-2] * xshape[-1])
    x.scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
    return x.reshape(xshape)


def batch_decompress(
    idx: Sequence[torch.Tensor],
    val: Sequence[torch.Tensor],
    xshape: Sequence[int],
    totalk: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Decompress many peers' results for one parameter at once: per-coefficient mean over the
    peers that selected it."""
    idx_concat = torch.cat(list(idx), -1).to(device)
    val_concat = torch.cat(list(val), -1).to(device)
    return decompress(idx_concat, val_concat, xshape, totalk, dtype, device)


class CompressDCT:
    """Upstream's name for the compress/decompress pair."""

    compress = staticmethod(compress)
    decompress = staticmethod(decompress)
    batch_decompress = staticmethod(batch_decompress)


# ============================================================================================
# distro.py
@dataclass
class DistroResult:
    """One parameter's compressed momentum: index bytes, values, encoded shape, block size."""

    sparse_idx: torch.Tensor
    sparse_val: torch.Tensor
    xshape: list[int]
    totalk: int
    stats: dict[str, float] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ResultLayout:
    """What a valid result for one parameter must look like (used to vet incoming payloads)."""

    name: str
    xshape: tuple[int, ...]
    totalk: int
    topk: int
    index_bytes: int
    dtype: torch.dtype

    @property
    def idx_shape(self) -> tuple[int, ...]:
        return (*self.block_shape, self.topk * self.index_bytes)

    @property
    def val_shape(self) -> tuple[int, ...]:
        return (*self.block_shape, self.topk)

    @property
    def block_shape(self) -> tuple[int, ...]:
        # 2-D+ parameters: blocks are [..., y, x]; 1-D: [N/n1].
        return self.xshape[:-2] if len(self.xshape) > 2 else self.xshape[:-1]


def result_layouts(
    variables: Iterable[tuple[str, Sequence[int], torch.dtype]], chunk: int, topk: int
) -> list[ResultLayout]:
    """Result layouts from parameter shapes alone (no tensors needed), in the given order."""
    out = []
    for name, shape, dtype in variables:
        shape = list(shape)
        if len(shape) > 1:
            n1 = get_smaller_split(shape[-2], chunk)
            n2 = get_smaller_split(shape[-1], chunk)
            xshape = (*shape[:-2], shape[-2] // n1, shape[-1] // n2, n1, n2)
            totalk = n1 * n2
        else:
            n1 = get_smaller_split(shape[0], chunk)
            xshape, totalk = (shape[0] // n1, n1), n1
        out.append(
            ResultLayout(
                name=name,
                xshape=xshape,
                totalk=totalk,
                topk=clamp_topk(totalk, topk),
                index_bytes=index_width(totalk),
                dtype=dtype,
            )
        )
    return out


def sorted_variables(
    source: nn.Module | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """Named parameters in upstream's variable order: ascending byte-wise by name.

    Wrapper prefixes from activation checkpointing and `torch.compile` are stripped so that the
    names (and so the order) are those of the plain model.
    """
    items = source.named_parameters() if isinstance(source, nn.Module) else source
    cleaned = [(_clean_name(name), p) for name, p in items]
    names = [n for n, _ in cleaned]
    if len(set(names)) != len(names):
        raise ValueError("parameter names are not unique after stripping wrapper prefixes")
    return sorted(cleaned, key=lambda item: item[0].encode("utf-8"))


def _clean_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def quantize_nozeros_tensor_to_boolean_sign(tensor: torch.Tensor) -> torch.Tensor:
    """1-bit quantization: True where the sign bit is set (so -0.0 and negative NaN map to -1)."""
    return tensor.signbit()


def unpack_tensor_sign_from_boolean(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """True -> -1, False -> +1, in `dtype`."""
    return tensor.to(dtype) * -2 + 1


def _cat_to(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if all(t.device == tensors[0].device for t in tensors):
        return torch.cat(list(tensors), -1).to(device, non_blocking=True)
    return torch.cat([t.to(device, non_blocking=True) for t in tensors], -1)


def _values_for(sparse_val: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    val = sparse_val.to(device, non_blocking=True)
    if val.dtype == torch.bool:
        return unpack_tensor_sign_from_boolean(val, dtype)
    return val


class Distro:
    """DisTrO state for one model replica: one momentum tensor per parameter, and the DCT bases.

    `variables` are `(name, parameter)` pairs or a module; they are put in upstream's order
    (sorted by name), and every result list is indexed in that order.
    """

    def __init__(
        self,
        variables: nn.Module | Iterable[tuple[str, torch.Tensor]],
        compression_decay: float,
        compression_chunk: int,
        compression_topk: int,
        weight_decay: float = 0.0,
    ) -> None:
        self.variables = sorted_variables(variables)
        if not self.variables:
            raise ValueError("DisTrO needs at least one parameter")
        for name, p in self.variables:
            if p.dim() == 0:
                raise ValueError(f"parameter {name!r} is a scalar; DisTrO needs 1-D or larger")
        if compression_chunk < 1:
            raise ValueError(f"compression_chunk must be >= 1, got {compression_chunk}")
        self.compression_decay = float(compression_decay)
        self.compression_chunk = int(compression_chunk)
        self.compression_topk = int(compression_topk)
        self.weight_decay = float(weight_decay)
        with torch.no_grad():
            # Upstream's native models get uninitialised memory here; real zeros are what its
            # Python models (and every test) use, and what a fresh joiner must agree on.
            self.deltas = [torch.zeros_like(p) for _, p in self.variables]
            for _, p in self.variables:
                if p.grad is not None:
                    p.grad.zero_()
        self.transform = TransformDCT(
            ((tuple(p.shape), p.dtype, p.device) for _, p in self.variables), compression_chunk
        )

    @classmethod
    def from_definition(
        cls, variables: nn.Module | Iterable[tuple[str, torch.Tensor]], definition: object
    ) -> Distro:
        """Build from `psyche.core.definitions.Distro` (its f32 fields are already f32 values)."""
        d = definition
        return cls(
            variables,
            compression_decay=float(d.compression_decay),  # type: ignore[attr-defined]
            compression_chunk=int(d.compression_chunk),  # type: ignore[attr-defined]
            compression_topk=int(d.compression_topk),  # type: ignore[attr-defined]
            weight_decay=float(d.weight_decay or 0.0),  # type: ignore[attr-defined]
        )

    # ----------------------------------------------------------------------------------------

    def layouts(self) -> list[ResultLayout]:
        """Expected shape of every parameter's result, in variable order."""
        return result_layouts(
            ((name, tuple(p.shape), p.dtype) for name, p in self.variables),
            self.compression_chunk,
            self.compression_topk,
        )

    def zero_optim(self) -> None:
        for delta in self.deltas:
            delta.zero_()

    @torch.no_grad()
    def error_correction(self, prev_lr: float) -> None:
        """Lookahead before the forward pass: `p -= sign(delta) * prev_lr`."""
        for (_, p), delta in zip(self.variables, self.deltas):
            p.sub_(delta.sign().mul_(prev_lr))

    @torch.no_grad()
    def generate(
        self,
        prev_self_results: Sequence[Sequence[DistroResult]],
        prev_lr: float,
        lr: float,
        stats: bool = False,
    ) -> list[DistroResult]:
        """Fold the current gradients into the momentum and compress it (one result per var).

        `prev_self_results` are this node's own *unquantized* results of the previous round (all
        of them, if it trained more than one batch); their decoded sum leaves the momentum.
        """
        self._check_results(prev_self_results)
        out: list[DistroResult] = []
        for index, ((name, p), delta) in enumerate(zip(self.variables, self.deltas)):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            grad_energy = (
                torch.linalg.vector_norm(grad, 1, dtype=torch.float32).item() if stats else None
            )

            p.add_(delta.sign().mul_(prev_lr))

            if prev_self_results:
                decoded = self._decode_results(prev_self_results, index, p)
                delta.sub_(decoded)

            if self.weight_decay != 0.0:
                p.mul_(1.0 - lr * self.weight_decay)

            if self.compression_decay != 1.0:
                delta.mul_(self.compression_decay)

            delta.add_(grad * lr)

            sparse_idx, sparse_val, xshape, totalk = compress(
                self.transform.encode(delta), self.compression_topk
            )
            result_stats = None
            if stats:
                delta_energy = torch.linalg.vector_norm(delta, 1, dtype=torch.float32).item()
                result_stats = {
                    f"{name}.delta_energy": delta_energy,
                    f"{name}.grad_energy": float(grad_energy),  # type: ignore[arg-type]
                }
            out.append(DistroResult(sparse_idx, sparse_val, xshape, totalk, result_stats))
        return out

    @torch.no_grad()
    def apply(self, results: Sequence[Sequence[DistroResult]], lr: float) -> None:
        """Sign-SGD step on the per-coefficient mean of every result list in `results`.

        An empty `results` is a no-op (no step, no weight decay), as upstream.
        """
        if not results:
            return
        self._check_results(results)
        # Upstream copies the decoded update into `.grad`, takes its sign and lets SGD do
        # `p.add_(grad, alpha=-lr)`; the decoded tensor already has the parameter's dtype, so
        # stepping with it directly gives the same bits without the copy.
        for index, (_, p) in enumerate(self.variables):
            p.add_(self._decode_results(results, index, p).sign_(), alpha=-lr)
        for _, p in self.variables:
            if p.grad is not None:
                p.grad.zero_()

    # ----------------------------------------------------------------------------------------

    def _decode_results(
        self, results: Sequence[Sequence[DistroResult]], index: int, p: torch.Tensor
    ) -> torch.Tensor:
        """Concatenate every result's entry for parameter `index`, mean-scatter and decode.

        Equivalent to upstream's per-result device copy, unpack and `cat`, but concatenates on
        the source device first so that P peers cost one host-to-device copy (and 1-bit values
        travel as bytes, unpacked on the device); the values are the same, so are the bits.
        """
        device = p.device
        entries = [r[index] for r in results]
        idx = _cat_to([e.sparse_idx for e in entries], device)
        vals = [e.sparse_val for e in entries]
        if all(v.dtype == torch.bool for v in vals):
            val = unpack_tensor_sign_from_boolean(_cat_to(vals, device), p.dtype)
        else:
            val = torch.cat([_values_for(v, p.dtype, device) for v in vals], -1)
        first = entries[0]
        dense = decompress(idx, val, first.xshape, first.totalk, p.dtype, device)
        return self.transform.decode(dense)

    def _check_results(self, results: Sequence[Sequence[DistroResult]]) -> None:
        for i, r in enumerate(results):
            if isinstance(r, DistroResult):
                raise TypeError("expected a list of result lists (one list per peer or batch)")
            if len(r) != len(self.variables):
                raise ValueError(
                    f"result list {i} has {len(r)} entries; the model has "
                    f"{len(self.variables)} parameters"
                )


def quantize_results(results: Sequence[DistroResult]) -> list[DistroResult]:
    """The 1-bit copy of a result list that is transmitted when `quantize_1bit` is set."""
    return [
        DistroResult(
            sparse_idx=r.sparse_idx.clone(),
            sparse_val=quantize_nozeros_tensor_to_boolean_sign(r.sparse_val),
            xshape=list(r.xshape),
            totalk=r.totalk,
            stats=r.stats,
        )
        for r in results
    ]
