"""Every instruction of the coordinator, authorizer and treasurer programs, one module per
program (`coordinator`, `authorizer`, `treasurer`: arguments, accounts and builders of solders
`Instruction`s) over the shell they share (`spec`: `InstructionSpec`). This module is their
registry: `INSTRUCTIONS[program][name]`, and the instruction a program's data calls.
"""

from __future__ import annotations

from psyche.solana.anchor import DISCRIMINATOR_LEN
from psyche.solana.instructions import authorizer, coordinator, treasurer
from psyche.solana.instructions.spec import InstructionSpec

INSTRUCTIONS: dict[str, dict[str, InstructionSpec]] = {
    "coordinator": coordinator.SPECS,
    "authorizer": authorizer.SPECS,
    "treasurer": treasurer.SPECS,
}


def spec_for_data(program: str, data: bytes) -> InstructionSpec | None:
    """The instruction of `program` whose discriminator starts `data`."""
    head = bytes(data[:DISCRIMINATOR_LEN])
    for spec in INSTRUCTIONS[program].values():
        if spec.discriminator == head:
            return spec
    return None
