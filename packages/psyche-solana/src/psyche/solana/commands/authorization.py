"""Who may join a run (upstream run-manager `commands/authorization/` and `can_join.rs`): create,
delegate, read and delete join authorizations, and check whether an address may join. Each
command is its options and a `run_*` function that prints what it did and returns the exit
status."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psyche.solana.commands.args import (
    ClusterCommand,
    RunQuery,
    SignedCommand,
    address_arg,
    arg,
    env_arg,
    env_flag,
)
from psyche.solana.commands.shell import pubkey, run_read, run_signed

EVERYONE = "11111111111111111111111111111111"
"""The grantee that means everyone (the system program's id)."""


def _print_authorization(result: Any) -> None:
    print(f"Authorization Grantor: {result.grantor}")
    print(f"Authorization Grantee: {result.grantee}")
    print(f"Authorization Address: {result.address}")


def _active(authorization: Any) -> str:
    return f"Authorization Active: {'true' if authorization.active else 'false'}"


def _print_changed(result: Any, changed: str) -> None:
    """What create and delete did: the transactions they sent (`changed` names the change) and
    whether the authorization is active now."""
    _print_authorization(result)
    if result.created is not None:
        print(f"Created authorization in transaction: {result.created}")
    if result.changed is not None:
        print(f"{changed} authorization in transaction: {result.changed}")
    print(_active(result.authorization))


@dataclass(frozen=True, kw_only=True)
class JoinAuthorizationCreateOptions(SignedCommand):
    authorizer: str = arg(
        env="AUTHORIZER",
        required=True,
        help=f"grantee; {EVERYONE} means everyone",
    )


def run_join_authorization_create(options: JoinAuthorizationCreateOptions) -> int:
    return _set_join_authorization(options, active=True)


@dataclass(frozen=True, kw_only=True)
class JoinAuthorizationSetDelegatesOptions(SignedCommand):
    join_authority: str = arg(env="JOIN_AUTHORITY", required=True)
    delegates_clear: bool = arg(
        action="store_true", env="DELEGATES_CLEAR", from_env=env_flag, default=False
    )
    delegates_added: Sequence[str] = arg(
        "--delegates-added",
        "--delegate-added",
        nargs="*",
        env="DELEGATES_ADDED",
        from_env=str.split,
        default_factory=list,
        metavar="PUBKEY",
        help="[env: DELEGATES_ADDED (separated by spaces)]",
    )


def run_join_authorization_set_delegates(options: JoinAuthorizationSetDelegatesOptions) -> int:
    from psyche.solana import admin

    delegates = [pubkey(d) for d in options.delegates_added]

    async def body(backend: Any) -> None:
        result = await admin.join_authorization_set_delegates(
            backend,
            pubkey(options.join_authority),
            delegates_clear=options.delegates_clear,
            delegates_added=delegates,
        )
        _print_authorization(result)
        print(f"Delegates cleared: {'true' if options.delegates_clear else 'false'}")
        print(f"Delegates added count: {len(delegates)}")
        for delegate in delegates:
            print(f"- Delegate added: {delegate}")
        print(f"Updated authorization delegates in transaction: {result.changed}")

    return run_signed(options, body)


@dataclass(frozen=True, kw_only=True)
class JoinAuthorizationReadOptions(ClusterCommand):
    join_authority: str = arg(env="JOIN_AUTHORITY", required=True)
    authorizer: str | None = env_arg("AUTHORIZER", default=None)


def run_join_authorization_read(options: JoinAuthorizationReadOptions) -> int:
    from solders.pubkey import Pubkey

    from psyche.solana import admin

    async def body(backend: Any) -> None:
        result = await admin.join_authorization_read(
            backend, pubkey(options.join_authority), pubkey(options.authorizer)
        )
        _print_authorization(result)
        authorization = result.authorization
        print(_active(authorization))
        print(f"Authorization Delegate Count: {len(authorization.delegates)}")
        for i, delegate in enumerate(authorization.delegates, start=1):
            print(f" - Authorization delegate #{i}: {Pubkey.from_bytes(delegate)}")

    return run_read(options.cluster, body)


@dataclass(frozen=True, kw_only=True)
class JoinAuthorizationDeleteOptions(SignedCommand):
    authorizer: str = env_arg("AUTHORIZER", required=True)


def run_join_authorization_delete(options: JoinAuthorizationDeleteOptions) -> int:
    return _set_join_authorization(options, active=False)


def _set_join_authorization(
    options: JoinAuthorizationCreateOptions | JoinAuthorizationDeleteOptions, *, active: bool
) -> int:
    """Activate (creating it if needed) or deactivate the wallet's authorization for
    `authorizer`, and say which transactions did it."""
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        change = admin.join_authorization_create if active else admin.join_authorization_delete
        result = await change(backend, pubkey(options.authorizer))
        _print_changed(result, "Activated" if active else "Deactivated")

    return run_signed(options, body)


@dataclass(frozen=True, kw_only=True)
class CanJoinOptions(RunQuery):
    authorizer: str | None = env_arg("AUTHORIZER", default=None)
    address: str = address_arg()


def run_can_join(options: CanJoinOptions) -> int:
    """Upstream's `can-join`: exit 0 when the address may join, 1 (one line) when not."""
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        address = pubkey(options.address)
        run_id = options.run_id
        check = await admin.can_join(backend, run_id, address, pubkey(options.authorizer))
        print(f"authorization valid for run id {run_id} using pubkey {address}")
        print(f"Coordinator: run_state: {check.run_state}")
        print(f"Coordinator: is_paused: {'true' if check.is_paused else 'false'}")
        if not check.can_join:
            raise admin.AdminError(
                f"A client with our pubkey {address} is in the current epoch, you can't join "
                "with this key!"
            )
        print(f"✓ Can join run {run_id} with pubkey {address}")

    return run_read(options.cluster, body)


__all__ = [
    "EVERYONE",
    "CanJoinOptions",
    "JoinAuthorizationCreateOptions",
    "JoinAuthorizationDeleteOptions",
    "JoinAuthorizationReadOptions",
    "JoinAuthorizationSetDelegatesOptions",
    "run_can_join",
    "run_join_authorization_create",
    "run_join_authorization_delete",
    "run_join_authorization_read",
    "run_join_authorization_set_delegates",
]
