"""The committed IDL files as anchorpy reads them (anchorpy is a test-only dependency: an
independent borsh/IDL codec that checks psyche.solana's encoders from outside)."""

from __future__ import annotations

import json
from typing import Any

from anchorpy_core.idl import Idl

from psyche.solana.idl import load_idl_text
from psyche.solana.program_ids import DEFAULT_PROGRAM_IDS, ProgramIds


def load_anchorpy_idl(program: str, ids: ProgramIds = DEFAULT_PROGRAM_IDS) -> Any:
    """The committed IDL parsed by anchorpy, with the program address set to `ids`."""
    doc = json.loads(load_idl_text(program))
    doc["metadata"]["address"] = getattr(ids, program)
    return Idl.from_json(json.dumps(doc))
