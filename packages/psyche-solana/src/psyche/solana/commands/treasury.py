"""A treasurer run's rewards (upstream run-manager `commands/treasury/`): top up its vault from
the wallet, claim what the wallet earned. Each command is its options and a `run_*` function
that prints what it did and returns the exit status."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from psyche.solana.commands.args import (
    RunCommand,
    env_arg,
    non_negative_float,
    treasurer_index_arg,
)
from psyche.solana.commands.shell import run_signed


@dataclass(frozen=True, kw_only=True)
class TreasurerClaimRewardsOptions(RunCommand):
    """A treasurer run: which one, when there are several (`TREASURER_INDEX`)."""

    treasurer_index: int | None = treasurer_index_arg()


@dataclass(frozen=True, kw_only=True)
class TreasurerTopUpRewardsOptions(TreasurerClaimRewardsOptions):
    collateral_amount: float = env_arg(
        "COLLATERAL_AMOUNT",
        type=non_negative_float,
        from_env=float,
        required=True,
        help="in the collateral mint's UI units",
    )


def run_treasurer_top_up_rewards(options: TreasurerTopUpRewardsOptions) -> int:
    from psyche.solana import treasury as treasury_ops
    from psyche.solana.admin import ui_amount_to_native_amount

    async def body(backend: Any) -> None:
        treasury, ui = await _load_treasury(backend, options)
        amount = ui_amount_to_native_amount(options.collateral_amount, treasury.decimals)
        print(f"User: {backend.get_payer()}")
        plan = await treasury_ops.prepare_top_up(backend, treasury, amount)
        print(f"User collateral amount: {ui(plan.user_collateral_amount)}")
        signature = await treasury_ops.top_up(backend, treasury, plan)
        print(f"Transfered {ui(amount)} collateral to treasurer in transaction: {signature}")

    return run_signed(options, body)


def run_treasurer_claim_rewards(options: TreasurerClaimRewardsOptions) -> int:
    from psyche.solana import treasury as treasury_ops

    async def body(backend: Any) -> None:
        treasury, ui = await _load_treasury(backend, options)
        print(f"User: {backend.get_payer()}")
        plan = await treasury_ops.prepare_claim(backend, treasury)
        if plan.created_user_collateral is not None:
            print(
                "Created associated token account for user during transaction: "
                f"{plan.created_user_collateral}"
            )
        print(f"User collateral amount: {ui(plan.user_collateral_amount)}")
        if plan.created_participant is not None:
            print(f"Created the participant claim during transaction: {plan.created_participant}")
        print(f"Total earned points: {plan.earned_points}")
        print(f"Already claimed earned points: {plan.claimed_earned_points}")
        print(f"Claimable earned points: {plan.claimable_earned_points}")
        # 1:1 between earned points and collateral base units
        print(f"Claimable collateral amount: {ui(plan.claimable_earned_points)}")
        amount = plan.claim_amount(treasury.collateral_amount)
        print(f"Claim collateral amount: {ui(amount)}")
        signature = await treasury_ops.claim(backend, treasury, amount)
        print(f"Claimed {ui(amount)} collateral in transaction: {signature}")

    return run_signed(options, body)


def _ui_amount(decimals: int) -> Callable[[int], str]:
    from psyche.solana.admin import native_amount_to_ui_amount
    from psyche.solana.commands.render import rust_f64

    return lambda native: rust_f64(native_amount_to_ui_amount(native, decimals))


async def _load_treasury(
    backend: Any, options: TreasurerClaimRewardsOptions
) -> tuple[Any, Callable[[int], str]]:
    """The run's treasurer, printed, and how its amounts print."""
    from psyche.solana import treasury as treasury_ops

    treasury = await treasury_ops.load_treasury(backend, options.run_id, options.treasurer_index)
    ui = _ui_amount(treasury.decimals)
    print(f"Found treasurer at index: 0x{treasury.index:08x}")
    print(f"Treasurer collateral mint: {treasury.collateral_mint}")
    print(f"Treasurer collateral amount: {ui(treasury.collateral_amount)}")
    return treasury, ui


__all__ = [
    "TreasurerClaimRewardsOptions",
    "TreasurerTopUpRewardsOptions",
    "run_treasurer_claim_rewards",
    "run_treasurer_top_up_rewards",
]
