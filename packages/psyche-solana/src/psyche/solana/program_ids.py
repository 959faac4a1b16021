"""Which deployed programs a client talks to.

The defaults are the ids upstream declares (`declare_id!`). Devnet test deployments generate fresh
program keypairs, so every id can be overridden: by the CLI flags `--coordinator-program-id`,
`--authorizer-program-id` and `--treasurer-program-id`, or by the environment variables
`PSYCHE_COORDINATOR_PROGRAM_ID`, `PSYCHE_AUTHORIZER_PROGRAM_ID` and `PSYCHE_TREASURER_PROGRAM_ID`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from solders.pubkey import Pubkey

COORDINATOR_PROGRAM_ID = "4SHugWqSXwKE5fqDchkJcPEqnoZE22VYKtSTVm7axbT7"
AUTHORIZER_PROGRAM_ID = "PsyAUmhpmiUouWsnJdNGFSX8vZ6rWjXjgDPHsgqPGyw"
TREASURER_PROGRAM_ID = "EnU7DRx5az5YWxaxgqEGbXSYtudcfnjXewyBRRZCjJPw"

SYSTEM_PROGRAM_ID = "11111111111111111111111111111111"
TOKEN_PROGRAM_ID = "TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA"
ASSOCIATED_TOKEN_PROGRAM_ID = "ATokenGPvbdGVxr1b2hvZbsiqW5xWH25efTNsLJA8knL"
ED25519_PROGRAM_ID = "Ed25519SigVerify111111111111111111111111111"
"""The Ed25519 signature-verification precompile (`solana_sdk::ed25519_program`)."""
SYSVAR_INSTRUCTIONS_ID = "Sysvar1nstructions1111111111111111111111111"
"""The instructions sysvar: the running transaction's instructions (`sysvar::instructions`)."""
SYSVAR_OWNER_ID = "Sysvar1111111111111111111111111111111111111"

ENV_VARS = {
    "coordinator": "PSYCHE_COORDINATOR_PROGRAM_ID",
    "authorizer": "PSYCHE_AUTHORIZER_PROGRAM_ID",
    "treasurer": "PSYCHE_TREASURER_PROGRAM_ID",
}


@dataclass(frozen=True)
class ProgramIds:
    """Base58 ids of the three Psyche programs a client uses."""

    coordinator: str = COORDINATOR_PROGRAM_ID
    authorizer: str = AUTHORIZER_PROGRAM_ID
    treasurer: str = TREASURER_PROGRAM_ID

    def __post_init__(self) -> None:
        for name in ("coordinator", "authorizer", "treasurer"):
            value = getattr(self, name)
            try:
                Pubkey.from_string(value)
            except ValueError:
                raise ValueError(
                    f"{name} program id {value!r} is not a base58 public key"
                ) from None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: str | None) -> ProgramIds:
        """Defaults, then the environment, then explicit (non-None) overrides."""
        env = os.environ if env is None else env
        values = {}
        for name, var in ENV_VARS.items():
            value = overrides.get(name) or env.get(var) or getattr(cls, name)
            values[name] = value.strip().strip('"')
        return cls(**values)

    @property
    def coordinator_key(self) -> Pubkey:
        return Pubkey.from_string(self.coordinator)

    @property
    def authorizer_key(self) -> Pubkey:
        return Pubkey.from_string(self.authorizer)

    @property
    def treasurer_key(self) -> Pubkey:
        return Pubkey.from_string(self.treasurer)


DEFAULT_PROGRAM_IDS = ProgramIds()
