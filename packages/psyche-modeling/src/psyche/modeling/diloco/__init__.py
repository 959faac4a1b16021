"""DiLoCo as a Psyche optimizer: inner AdamW steps on each client, an outer Nesterov-SGD step
on the mean pseudo-gradient, sent dense (bf16, int8) or sparse (DisTrO's block DCT, top-k,
few-bit values, error feedback: SparseLoCo). See docs/diloco.md.

* `codec`: the three sent forms, their checks, the device-exact decode;
* `optimizer`: `Diloco` (a replica's round and the outer step), `OuterSGD`, `DilocoSettings`;
* `research`: `DilocoLoop` and `DilocoPeerSimulation` (one process, no network);
* `basis`: the DCT basis computed the same on every machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psyche.core.lazy import lazy_exports
from psyche.modeling.diloco.codec import MAX_ABS_VALUE, DilocoLayout, diloco_layouts
from psyche.modeling.diloco.optimizer import (
    Diloco,
    DilocoSettings,
    OuterSGD,
    deterministic_norm,
    inner_ranges,
    payload_digest,
)

if TYPE_CHECKING:
    from psyche.modeling.diloco.research import DilocoLoop, DilocoPeerSimulation

# The research loops load on first use: they import the witness checks
# (`psyche.modeling.screening`), which import this package's codec.
__getattr__, __dir__ = lazy_exports(
    __name__, {"DilocoLoop": ".research", "DilocoPeerSimulation": ".research"}
)

__all__ = [
    "MAX_ABS_VALUE",
    "Diloco",
    "DilocoLayout",
    "DilocoLoop",
    "DilocoPeerSimulation",
    "DilocoSettings",
    "OuterSGD",
    "deterministic_norm",
    "diloco_layouts",
    "inner_ranges",
    "payload_digest",
]
