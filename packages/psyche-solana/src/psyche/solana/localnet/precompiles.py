"""The runtime's Ed25519 precompile, for the local endpoint (`Ledger` runs it as a program).

The real runtime verifies an `Ed25519SigVerify` instruction itself (agave's
`solana_ed25519_program::verify`, in the SVM since precompile verification moved there): every
signature it names, read where its offsets point among the transaction's instructions, must
verify, or the transaction fails with `InstructionError(index, Custom(PrecompileError))` and
pays its fee (each signature the instruction claims is paid for: `ledger.message_fee`). The
entries are checked one by one in agave's order (`verify_ed25519_instruction`). Programs do not
call it; they read it back through the instructions sysvar
(`psyche.solana.instructions.ed25519`). Each signature is checked as agave checks it, with
ed25519-dalek's `verify_strict`, the project's `verify_signature` (`psyche.core.ed25519_strict`):
a key or `R` of small order, a non-canonical `S` or `R` fails `InvalidSignature` where plain
RFC 8032 verification would pass some of them.
"""

from __future__ import annotations

from psyche.core.identity import verify_signature
from psyche.solana.instructions.ed25519 import verify_ed25519_instruction
from psyche.solana.localnet.runtime import InstructionFailure, InvokeContext


def ed25519_program(ctx: InvokeContext) -> None:
    error = verify_ed25519_instruction(
        ctx.data, ctx.ledger.running_instruction_datas(), verify_signature
    )
    if error is not None:
        raise InstructionFailure({"Custom": int(error)}, f"ed25519 precompile: {error.name}")


__all__ = ["ed25519_program"]
