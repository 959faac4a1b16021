"""The authorizer program (upstream `solana-authorizer`): a grantor lets a grantee (or everyone)
act within a scope, and the grantee names delegates that may act for it; a run's join authority
authorizes who may join. Each instruction's arguments, its accounts (`SPECS`) and its builder,
named as upstream's `psyche_solana_rpc::instructions`."""

from __future__ import annotations

from typing import Any

from solders.instruction import Instruction

from psyche.core.serde import struct
from psyche.solana import pda
from psyche.solana.instructions.spec import (
    InstructionSpec,
    by_name,
    readonly,
    signer,
    writable,
    writable_signer,
)
from psyche.solana.program_ids import DEFAULT_PROGRAM_IDS, ProgramIds
from psyche.solana.pubkey import Pubkey, pubkey_bytes
from psyche.solana.state import JOIN_RUN_AUTHORIZATION_SCOPE

# ---------------------------------------------------------------------------------------------
# Arguments


@struct(frozen=True)
class AuthorizationCreateParams:
    grantee: Pubkey
    scope: bytes


@struct(frozen=True)
class AuthorizationGrantorUpdateParams:
    active: bool


@struct(frozen=True)
class AuthorizationGranteeUpdateParams:
    delegates_clear: bool
    delegates_added: list[Pubkey]


@struct(frozen=True)
class AuthorizationCloseParams:
    pass


# One struct per instruction: its fields are the instruction's arguments.


@struct(frozen=True)
class AuthorizationCreateArgs:
    params: AuthorizationCreateParams


@struct(frozen=True)
class AuthorizationGrantorUpdateArgs:
    params: AuthorizationGrantorUpdateParams


@struct(frozen=True)
class AuthorizationGranteeUpdateArgs:
    params: AuthorizationGranteeUpdateParams


@struct(frozen=True)
class AuthorizationCloseArgs:
    params: AuthorizationCloseParams = AuthorizationCloseParams()


# ---------------------------------------------------------------------------------------------
# Specs


SPECS: dict[str, InstructionSpec] = by_name(
    InstructionSpec(
        "authorizer",
        "authorization_create",
        (
            writable_signer("payer"),
            signer("grantor"),
            writable("authorization"),
            readonly("system_program"),
        ),
        AuthorizationCreateArgs,
    ),
    InstructionSpec(
        "authorizer",
        "authorization_grantor_update",
        (signer("grantor"), writable("authorization")),
        AuthorizationGrantorUpdateArgs,
    ),
    InstructionSpec(
        "authorizer",
        "authorization_grantee_update",
        (
            writable_signer("payer"),
            signer("grantee"),
            writable("authorization"),
            readonly("system_program"),
        ),
        AuthorizationGranteeUpdateArgs,
    ),
    InstructionSpec(
        "authorizer",
        "authorization_close",
        (
            signer("grantor"),
            writable("spill"),
            writable("authorization"),
            readonly("system_program"),
        ),
        AuthorizationCloseArgs,
    ),
)


# ---------------------------------------------------------------------------------------------
# Builders


def _on_authorization(
    name: str,
    key: tuple[Any, Any, bytes],
    accounts: dict[str, Any],
    args: Any,
    ids: ProgramIds,
) -> Instruction:
    """`name` on the authorization `key` (grantor, grantee, scope) names, with `accounts` (the
    others than the authorization's and the programs')."""
    authorization = pda.find_authorization(*key, ids=ids)
    return SPECS[name].call(ids, {**accounts, "authorization": authorization}, args)


def authorizer_authorization_create(
    payer: Any,
    grantor: Any,
    grantee: Any,
    scope: bytes = JOIN_RUN_AUTHORIZATION_SCOPE,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _on_authorization(
        "authorization_create",
        (grantor, grantee, scope),
        {"payer": payer, "grantor": grantor},
        AuthorizationCreateArgs(AuthorizationCreateParams(pubkey_bytes(grantee), bytes(scope))),
        ids,
    )


def authorizer_authorization_grantor_update(
    grantor: Any,
    grantee: Any,
    scope: bytes,
    active: bool,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _on_authorization(
        "authorization_grantor_update",
        (grantor, grantee, scope),
        {"grantor": grantor},
        AuthorizationGrantorUpdateArgs(AuthorizationGrantorUpdateParams(active)),
        ids,
    )


def authorizer_authorization_grantee_update(
    payer: Any,
    grantor: Any,
    grantee: Any,
    scope: bytes,
    delegates_clear: bool,
    delegates_added: list[Any],
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    params = AuthorizationGranteeUpdateParams(
        delegates_clear, [pubkey_bytes(d) for d in delegates_added]
    )
    return _on_authorization(
        "authorization_grantee_update",
        (grantor, grantee, scope),
        {"payer": payer, "grantee": grantee},
        AuthorizationGranteeUpdateArgs(params),
        ids,
    )


def authorizer_authorization_close(
    grantor: Any,
    grantee: Any,
    scope: bytes,
    spill: Any,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _on_authorization(
        "authorization_close",
        (grantor, grantee, scope),
        {"grantor": grantor, "spill": spill},
        AuthorizationCloseArgs(),
        ids,
    )
