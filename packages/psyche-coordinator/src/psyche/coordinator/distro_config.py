"""Checks of a run's DisTrO apply route against the rest of its configuration (a port extension).

A run names its route with its optimizer's variant: `Distro` is upstream's dense route (the
decoded mean of the results through a dense inverse DCT, upstream's bits), `DistroSparse` the
sparse route (`psyche.modeling.dct.SparseSynthesis`: the sign of an exact integer synthesis from
the kept coefficients). Being the optimizer's variant, the route is the run's, the same for every
client, and cannot be named for another optimizer.

The sparse route's exactness holds for 1-bit results whose entries per DCT block (results of a
round x kept coefficients per block) stay under `SPARSE_APPLY_MAX_ENTRIES`: every partial sum of
the synthesis is then an integer below 2^53 in float64. A config outside that is refused here,
before any client would refuse the round's apply at run time.
"""

from __future__ import annotations

from psyche.coordinator.config import SOLANA_MAX_NUM_CLIENTS, CoordinatorConfig
from psyche.core.definitions import Distro

SPARSE_APPLY_MAX_ENTRIES = 262_109
"""The most entries one block of the sparse route's synthesis can hold: `(2^53 - 1) //
(2^10 x 5793^2)` (an entry's largest integer weight, 2^10, times the largest entry of the
13-bit integer basis, squared: 5793 from block size 246 up, a little less below). `tests/modeling/test_distro_route.py` checks it against
`psyche.modeling.dct`."""


def distro_sparse_problems(
    config: CoordinatorConfig,
    definition: Distro,
    where: str = "model.LLM.optimizer.DistroSparse",
) -> list[tuple[str, str]]:
    """Every reason the sparse route cannot run `definition` with `config`, as (TOML path,
    message) pairs."""
    d = definition
    problems: list[tuple[str, str]] = []
    if not d.quantize_1bit:
        problems.append(
            (
                f"{where}.quantize_1bit",
                "the sparse apply route decodes 1-bit results (their exact integer synthesis); "
                "without quantize_1bit its apply would be upstream's dense decode: set "
                "quantize_1bit = true, or use [model.LLM.optimizer.Distro] (upstream's route)",
            )
        )
    if d.compression_chunk < 1:
        problems.append((f"{where}.compression_chunk", "must be at least 1"))
    if d.compression_topk < 1:
        problems.append((f"{where}.compression_topk", "must be at least 1"))
    # A round applies at most one result per trainer (at most the run's clients) and per batch
    # (at most the global batch size); each keeps at most `topk` of a block's chunk^2 entries.
    results = min(config.global_batch_size_end, SOLANA_MAX_NUM_CLIENTS)
    per_block = min(d.compression_topk, d.compression_chunk**2)
    if results * per_block > SPARSE_APPLY_MAX_ENTRIES:
        problems.append(
            (
                f"{where}.compression_topk",
                f"compression_topk ({d.compression_topk}) x the results a round can apply "
                f"({results}) = {results * per_block} entries per DCT block, more than the "
                f"sparse route's exact synthesis holds ({SPARSE_APPLY_MAX_ENTRIES}): lower "
                "compression_topk, or use [model.LLM.optimizer.Distro] (upstream's route)",
            )
        )
    return problems
