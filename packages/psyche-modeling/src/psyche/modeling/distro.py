"""The DisTrO optimizer: momentum in the DCT domain, top-k of each block sent, sign-SGD on the mean.

Split in two the way Psyche uses it:

* `generate` (after this node's backward pass) folds the gradient into the momentum `delta`,
  removes what this node already transmitted last round, and compresses `delta` into one
  `DistroResult` per parameter;
* `apply` (at the start of the next round) averages every accepted peer's results per
  coefficient, decodes them, and takes a sign-SGD step.

`error_correction` applies a lookahead (`sign(delta) * prev_lr`) before the forward pass that
stands in for this node's own still-unapplied contribution; `generate` undoes it.

Every in-place op below is written in the same form as upstream (`add_(g * lr)` rather than
`add_(g, alpha=lr)`, for instance): the two forms round differently in bf16, and all clients
must end with the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import nn

from psyche.modeling.compression import clamp_topk, compress, decompress, index_width
from psyche.modeling.dct import TransformDCT, decode_reads_transposed, get_smaller_split
from psyche.modeling.sharding import full_tensor, shard_like

if TYPE_CHECKING:
    from psyche.core import definitions


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


@overload
def sorted_variables(source: nn.Module) -> list[tuple[str, nn.Parameter]]: ...
@overload
def sorted_variables(
    source: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]: ...
def sorted_variables(
    source: nn.Module | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, Any]]:
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
        self.keep_encoded = False
        """Keep the momentum's DCT (`encoded`) at each `generate`: a witness's reference
        (`psyche.modeling.screening`); off by default (it holds a copy of the model)."""
        self.encoded: list[torch.Tensor] | None = None
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
        cls,
        variables: nn.Module | Iterable[tuple[str, torch.Tensor]],
        definition: definitions.Distro,
    ) -> Distro:
        """Build from `psyche.core.definitions.Distro` (its f32 fields are already f32 values)."""
        d = definition
        return cls(
            variables,
            compression_decay=float(d.compression_decay),
            compression_chunk=int(d.compression_chunk),
            compression_topk=int(d.compression_topk),
            weight_decay=float(d.weight_decay or 0.0),
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
        encoded: list[torch.Tensor] = []
        for index, ((name, p), delta) in enumerate(zip(self.variables, self.deltas)):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            grad_energy = (
                torch.linalg.vector_norm(full_tensor(grad), 1, dtype=torch.float32).item()
                if stats
                else None
            )

            p.add_(delta.sign().mul_(prev_lr))

            if prev_self_results:
                decoded = self._decode_results(prev_self_results, index, p)
                delta.sub_(shard_like(decoded, delta))

            if self.weight_decay != 0.0:
                p.mul_(1.0 - lr * self.weight_decay)

            if self.compression_decay != 1.0:
                delta.mul_(self.compression_decay)

            delta.add_(grad * lr)

            # A sharded momentum is gathered first (upstream `gather_full_tensor`): the payload
            # is computed on the full tensor, the same bits as on a one-device client.
            full = full_tensor(delta)
            coefficients = self.transform.encode(full)
            sparse_idx, sparse_val, xshape, totalk = compress(coefficients, self.compression_topk)
            if self.keep_encoded:
                encoded.append(coefficients)
            result_stats = None
            if stats:
                delta_energy = torch.linalg.vector_norm(full, 1, dtype=torch.float32).item()
                result_stats = {
                    f"{name}.delta_energy": delta_energy,
                    f"{name}.grad_energy": float(grad_energy),  # type: ignore[arg-type]
                }
            out.append(DistroResult(sparse_idx, sparse_val, xshape, totalk, result_stats))
        self.encoded = encoded if self.keep_encoded else None
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
            # A sharded parameter takes its slice of the decoded aggregate (upstream `set_grad`).
            p.add_(shard_like(self._decode_results(results, index, p), p).sign_(), alpha=-lr)
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
        The dense coefficients are built in the layout `decode` reads without a copy, from the
        touched coefficients alone where that gives the same bits (see `decompress`).
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
        dense = decompress(
            idx,
            val,
            first.xshape,
            first.totalk,
            p.dtype,
            device,
            transposed=decode_reads_transposed(first.xshape),
        )
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
