"""The authorizer program (`psyche_solana_authorizer`), ported to Python for the local endpoint.

An `Authorization` PDA says that a grantor lets a grantee (or everyone, for the zero key) and the
grantee's delegates act within a scope; the coordinator's `join_run` checks one.
"""

from __future__ import annotations

from psyche.solana.anchor import AUTHORIZER_ERRORS
from psyche.solana.instructions import authorizer as authorizer_ix
from psyche.solana.localnet.runtime import (
    SYSTEM_PROGRAM,
    Accounts,
    Handler,
    InvokeContext,
    close_account,
    dispatch_anchor_instruction,
    init_pda,
    load_borsh_account,
    program_error,
    realloc,
    require,
    require_payer,
    require_program,
    require_system_account,
    store_borsh_account,
    write_data,
)
from psyche.solana.state import Authorization, encode_anchor_account

# Delegates keep an authorization open this long after the grantor's last update.
CLOSE_DELAY_SECONDS = 30 * 24 * 60 * 60


def process(ctx: InvokeContext) -> None:
    dispatch_anchor_instruction(ctx, "authorizer", _HANDLERS)


def _load(ctx: InvokeContext, accounts: Accounts) -> Authorization:
    meta = accounts.mutable("authorization")
    return load_borsh_account(ctx, meta, Authorization, ctx.program_id, "authorization")


def _create(
    ctx: InvokeContext,
    accounts: Accounts,
    args: authorizer_ix.AuthorizationCreateArgs,
) -> None:
    params = args.params
    payer, grantor = require_payer(accounts), accounts.signer("grantor")
    meta = accounts["authorization"]
    bump = init_pda(
        ctx,
        payer.pubkey,
        meta,
        [Authorization.SEEDS_PREFIX, bytes(grantor.pubkey), params.grantee, params.scope],
        Authorization.space_with_discriminator(len(params.scope), 0),
        "authorization",
    )
    require_program(accounts["system_program"], SYSTEM_PROGRAM, "system_program")
    authorization = Authorization(
        bump=bump,
        grantor=bytes(grantor.pubkey),
        grantee=params.grantee,
        scope=params.scope,
        active=False,
        delegates=[],
        grantor_update_unix_timestamp=0,
    )
    account = ctx.get(meta.pubkey)
    assert account is not None
    write_data(ctx, meta.pubkey, encode_anchor_account(authorization, space=len(account.data)))


def _grantor_update(
    ctx: InvokeContext,
    accounts: Accounts,
    args: authorizer_ix.AuthorizationGrantorUpdateArgs,
) -> None:
    grantor = accounts.signer("grantor")
    authorization = _load(ctx, accounts)
    require(authorization.grantor == bytes(grantor.pubkey), "authorization")
    authorization.active = args.params.active
    authorization.grantor_update_unix_timestamp = ctx.unix_timestamp()
    store_borsh_account(ctx, accounts.key("authorization"), authorization)


def _grantee_update(
    ctx: InvokeContext,
    accounts: Accounts,
    args: authorizer_ix.AuthorizationGranteeUpdateArgs,
) -> None:
    params = args.params
    payer, grantee = require_payer(accounts), accounts.signer("grantee")
    authorization = _load(ctx, accounts)
    require(authorization.grantee == bytes(grantee.pubkey), "authorization")
    kept = 0 if params.delegates_clear else len(authorization.delegates)
    new_space = Authorization.space_with_discriminator(
        len(authorization.scope), kept + len(params.delegates_added)
    )
    realloc(ctx, accounts.key("authorization"), new_space, payer.pubkey)
    require_program(accounts["system_program"], SYSTEM_PROGRAM, "system_program")
    if params.delegates_clear:
        authorization.delegates.clear()
    authorization.delegates.extend(params.delegates_added)
    store_borsh_account(ctx, accounts.key("authorization"), authorization)


def _close(
    ctx: InvokeContext,
    accounts: Accounts,
    args: authorizer_ix.AuthorizationCloseArgs,
) -> None:
    grantor, spill = accounts.signer("grantor"), accounts.mutable("spill")
    require_system_account(ctx, spill, "spill")
    authorization = _load(ctx, accounts)
    require(authorization.grantor == bytes(grantor.pubkey), "authorization")
    require_program(accounts["system_program"], SYSTEM_PROGRAM, "system_program")
    if authorization.active:
        raise program_error(AUTHORIZER_ERRORS, "AuthorizationActiveIsTrue")
    if authorization.delegates and ctx.unix_timestamp() < (
        authorization.grantor_update_unix_timestamp + CLOSE_DELAY_SECONDS
    ):
        raise program_error(AUTHORIZER_ERRORS, "AuthorizationClosingConditionsNotReachedYet")
    close_account(ctx, accounts.key("authorization"), spill.pubkey)


_HANDLERS: dict[str, Handler] = {
    "authorization_create": _create,
    "authorization_grantor_update": _grantor_update,
    "authorization_grantee_update": _grantee_update,
    "authorization_close": _close,
}
