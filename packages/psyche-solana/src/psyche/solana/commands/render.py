"""What the commands print: a run's decoded state as text or as upstream's JSON, one user's
JSON, the joinable runs table, and errors explained in one line."""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from solders.pubkey import Pubkey

from psyche.coordinator import Client, RunState
from psyche.coordinator.coordinator import Coordinator
from psyche.solana.admin import native_amount_to_ui_amount
from psyche.solana.runs import RunInfo
from psyche.solana.snapshots import RunSnapshot, UserSnapshot


def _key(raw: bytes) -> str:
    return str(Pubkey.from_bytes(raw))


def _time(unix_timestamp: int) -> str:
    if unix_timestamp == 0:
        return "never"
    moment = datetime.datetime.fromtimestamp(unix_timestamp, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def render_run(snapshot: RunSnapshot) -> str:
    from psyche.coordinator.run_config import describe_data_location

    run, account = snapshot.run, snapshot.account
    state = account.state
    c: Coordinator = state.coordinator
    llm = c.model.value
    config = c.config
    lines = [
        f"Run {run.run_id!r}",
        f"  coordinator instance  {run.instance_address}",
        f"  coordinator account   {run.account_address} (version {account.version}, "
        f"nonce {account.nonce})",
        f"  main authority        {_key(run.instance.main_authority)}",
        f"  join authority        {_key(run.instance.join_authority)}",
        f"  client version        {state.client_version or '(none)'}",
        "",
        f"  metadata  name {state.metadata.name!r}, description {state.metadata.description!r}, "
        f"{_count(state.metadata.num_parameters)} parameters, vocab {state.metadata.vocab_size}",
        f"  state     {c.run_state} since {_time(c.run_state_start_unix_timestamp)}"
        + (" (pause pending)" if c.pending_pause else ""),
        f"  progress  epoch {c.progress.epoch}, step {c.progress.step}/{config.total_steps}, "
        f"epoch start data index {c.progress.epoch_start_data_index}",
        f"  config    warmup {config.warmup_time}s, round train {config.max_round_train_time}s, "
        f"witness {config.round_witness_time}s, cooldown {config.cooldown_time}s, "
        f"epoch {config.epoch_time}s, extra wait {config.waiting_for_members_extra_time}s",
        f"            clients min {config.min_clients} (to start {config.init_min_clients}), "
        f"witness nodes {config.witness_nodes}, verification {config.verification_percent}%, "
        f"global batch {config.global_batch_size_start}->{config.global_batch_size_end} "
        f"(warmup tokens {config.global_batch_size_warmup_tokens})",
        f"  model     {llm.architecture.name}, max_seq_len {llm.max_seq_len}, "
        f"{llm.data_type.name}, cold start warmup steps {llm.cold_start_warmup_steps}",
        f"            checkpoint {llm.checkpoint!r}",
        f"            data {describe_data_location(llm.data_location)}",
        f"            lr {llm.lr_schedule!r}",
        f"            optimizer {llm.optimizer!r}",
    ]
    epoch = c.epoch_state
    round_ = c.current_round()
    if round_ is not None and c.active():
        lines.append(
            f"  round     height {round_.height}, {round_.clients_len} clients, "
            f"{len(round_.witnesses)} witnesses, data index {round_.data_index}"
        )
    lines.append(f"  epoch clients ({len(epoch.clients)}), exited ({len(epoch.exited_clients)})")
    for client in epoch.clients:
        lines.append(f"    {_key(client.id.signer)} {client.state}")
    for client in epoch.exited_clients:
        lines.append(
            f"    {_key(client.id.signer)} {client.state} (exited at height {client.exited_height})"
        )
    clients_state = state.clients_state
    rates, future = clients_state.current_epoch_rates, clients_state.future_epoch_rates
    lines.append(
        f"  known clients ({len(clients_state.clients)}), next active {clients_state.next_active}; "
        f"rates now earning {rates.earning_rate_total_shared} / slashing "
        f"{rates.slashing_rate_per_client}, next epoch {future.earning_rate_total_shared} / "
        f"{future.slashing_rate_per_client}"
    )
    for known in clients_state.clients:
        joined = "joined" if known.active == clients_state.next_active else "not joined"
        lines.append(
            f"    {_key(known.id.signer)} {joined} (active {known.active}), earned "
            f"{known.earned}, slashed {known.slashed}"
        )
    if snapshot.treasury is not None:
        treasury = snapshot.treasury
        funded = native_amount_to_ui_amount(treasury.collateral_amount, treasury.decimals)
        lines += [
            f"  treasurer index {treasury.index}, collateral mint {treasury.collateral_mint}, "
            f"funded {rust_f64(funded)}, claimed points "
            f"{treasury.run.total_claimed_earned_points}",
        ]
    if snapshot.verification is not None:
        lines += _verification_lines(snapshot)
    return "\n".join(lines)


def _verification_lines(snapshot: RunSnapshot) -> list[str]:
    """Who verified whom, what was found, who was punished (`psyche.solana.verification`)."""
    from psyche.solana.verification import entry_line

    value = snapshot.verification
    assert value is not None
    steps = ", ".join(str(r.step) for r in value.rounds) or "none"
    trains = "verifiers train too" if value.verifiers_train else "verifiers train nothing"
    threads = value.exact_verification_threads
    exact = f"followers rebuild on {threads} threads" if threads else "no followers"
    lines = [f"  verification  {trains}; {exact}; rounds kept {steps}; {len(value.bans)} banned"]
    lines += [f"    banned {_key(b.signer)} until epoch {b.ban().until_epoch}" for b in value.bans]
    lines += [f"    {entry_line(e)}" for e in value.log]
    return lines


def rust_f64(value: float) -> str:
    """An f64 as Rust's `{}` prints it: shortest round-trip digits, never an exponent, no
    fraction when integral (`10`, `1.5`, `0.0000001`, `inf`)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    text = format(Decimal(repr(float(value))), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def _json_f64(value: float) -> float | None:
    """serde_json writes a non-finite f64 as `null`."""
    return value if math.isfinite(value) else None


def run_to_json(snapshot: RunSnapshot) -> dict[str, Any]:
    """Upstream's `json-dump-run` document, key for key. Clients are keyed by their full
    signer public key: upstream keys them by `NodeIdentity`'s Display, the first 4 bytes of the
    key in hex, which two clients can share (one then hides the other)."""
    from psyche.coordinator.run_config import model_to_obj
    from psyche.core.serde import to_obj
    from psyche.solana.state import RunMetadata

    run, account = snapshot.run, snapshot.account
    state = account.state
    c = state.coordinator
    clients = state.clients_state.clients
    rates = state.clients_state
    sum_earned = sum(x.earned for x in clients)
    out: dict[str, Any] = {
        "coordinator_instance": {
            "address": str(run.instance_address),
            "join_authority": _key(run.instance.join_authority),
            "main_authority": _key(run.instance.main_authority),
        },
        "coordinator_account": {
            "address": str(run.account_address),
            "run_id": c.run_id,
            "setup": {
                "client_version": state.client_version,
                "metadata": to_obj(state.metadata, RunMetadata, json=True),
                "model": model_to_obj(c.model, json=True),
                "config": to_obj(c.config, json=True),
            },
            "status": {
                "next_active": rates.next_active,
                "state": str(c.run_state),
                "epoch": c.progress.epoch,
                "step": c.progress.step,
            },
            "epoch": {
                "clients": {
                    "alive": {_key(x.id.signer): str(x.state) for x in c.epoch_state.clients},
                    "exited": {
                        _key(x.id.signer): str(x.state) for x in c.epoch_state.exited_clients
                    },
                },
                "rates": {
                    "current": {
                        "earning": rates.current_epoch_rates.earning_rate_total_shared,
                        "slashing": rates.current_epoch_rates.slashing_rate_per_client,
                    },
                    "future": {
                        "earning": rates.future_epoch_rates.earning_rate_total_shared,
                        "slashing": rates.future_epoch_rates.slashing_rate_per_client,
                    },
                },
            },
            "clients": {
                _key(x.id.signer): {"active": x.active, "earned": x.earned, "slashed": x.slashed}
                for x in clients
            },
            "accounting": {
                "max_active": max((x.active for x in clients), default=None),
                "sum_earned": sum_earned,
                "sum_slashed": sum(x.slashed for x in clients),
            },
            "nonce": account.nonce,
        },
        "treasurer_run": None,
    }
    treasury = snapshot.treasury
    if treasury is not None:
        t = treasury.run
        ui = lambda native: native_amount_to_ui_amount(native, treasury.decimals)  # noqa: E731
        claimed = t.total_claimed_earned_points
        unclaimed = max(0, sum_earned - claimed)
        # 1:1 between earned points and collateral base units
        burn_per_epoch = rates.current_epoch_rates.earning_rate_total_shared
        missing = max(0, unclaimed - treasury.collateral_amount)
        surplus = max(0, treasury.collateral_amount - unclaimed)
        out["treasurer_run"] = {
            "address": str(treasury.address),
            "index": t.index,
            "main_authority": _key(t.main_authority),
            "join_authority": _key(t.join_authority),
            "total_claimed_earned_points": claimed,
            "total_claimable_earned_points": sum_earned,
            "total_unclaimed_earned_points": unclaimed,
            "collateral_mint": str(treasury.collateral_mint),
            "funded_collateral_amount": ui(treasury.collateral_amount),
            "total_missing_collateral_amount": ui(missing),
            "total_surplus_collateral_amount": ui(surplus),
            "burn_collateral_amount_per_epoch": ui(burn_per_epoch),
            "estimated_funded_epochs_count": (
                None if burn_per_epoch == 0 else _json_f64(surplus / burn_per_epoch)
            ),
        }
    if snapshot.verification is not None:
        from psyche.solana.verification import verification_to_json

        # Beyond upstream's document: only in a run with a verification account.
        out["verification"] = verification_to_json(snapshot.verification)
    return out


def _epoch_client(client: Client | None) -> dict[str, Any] | None:
    if client is None:
        return None
    return {"state": str(client.state), "exited_height": client.exited_height}


def user_to_json(user: UserSnapshot) -> dict[str, Any]:
    """Upstream's `json-dump-user` document, key for key."""
    client = user.client
    treasurer = None
    if user.treasurer is not None:
        decimals = user.treasurer.treasury.decimals
        participant = user.treasurer.participant
        treasurer = {
            "collateral_mint": str(user.treasurer.treasury.collateral_mint),
            "collateral_amount": native_amount_to_ui_amount(
                user.treasurer.collateral_amount, decimals
            ),
            "claimed_earned_points": None
            if participant is None
            else participant.claimed_earned_points,
            "claimed_collateral_amount": None
            if participant is None
            else native_amount_to_ui_amount(participant.claimed_collateral_amount, decimals),
        }
    return {
        "address": str(user.address),
        "lamports": user.lamports,
        "coordinator_account": {
            "client": None
            if client is None
            else {"active": client.active, "earned": client.earned, "slashed": client.slashed},
            "epoch_alive": _epoch_client(user.epoch_alive),
            "epoch_exited": _epoch_client(user.epoch_exited),
        },
        "treasurer_participant": treasurer,
    }


# ---------------------------------------------------------------------------------------------
# list-runs


def format_duration_secs(secs: int) -> str:
    """`1h 2m 3s`, leaving out zero parts (`0s` for nothing)."""
    h, m, s = secs // 3600, (secs % 3600) // 60, secs % 60
    parts = [f"{h}h"] if h else []
    if m:
        parts.append(f"{m}m")
    if s or not parts:
        parts.append(f"{s}s")
    return " ".join(parts)


def time_remaining_display(run: RunInfo, now: int) -> str:
    """Time left in the epoch at unix time `now`; `-` when the run is not in one."""
    if run.run_state in (
        RunState.WaitingForMembers,
        RunState.Finished,
        RunState.Paused,
        RunState.Uninitialized,
    ):
        return "-"
    if run.epoch_start_timestamp == 0:
        return "-"
    elapsed = max(0, now - run.epoch_start_timestamp)
    if elapsed >= run.epoch_time_secs:
        return "overrun"
    return format_duration_secs(run.epoch_time_secs - elapsed)


def clients_display(run: RunInfo) -> str:
    if run.run_state in (RunState.Paused, RunState.Uninitialized, RunState.Finished):
        return "-"
    if run.num_clients < run.min_clients:
        return f"{run.num_clients}/{run.min_clients} waiting"
    return f"{run.num_clients} training"


def format_runs_table(runs: Sequence[RunInfo], now: int) -> list[str]:
    """Upstream's `RunInfo::format_table`: a header and one row per run, columns padded."""
    rows = [
        (
            run.run_id,
            str(run.run_state),
            clients_display(run),
            format_duration_secs(run.epoch_time_secs),
            time_remaining_display(run, now),
        )
        for run in runs
    ]
    header = ("run-id", "state", "clients", "epoch time", "time left")
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(4)]

    def line(cells: tuple[str, ...]) -> str:
        padded = [cell.ljust(width) for cell, width in zip(cells, widths)]
        return "  " + "   ".join([*padded, cells[4]])

    return [line(header), *(line(row) for row in rows)]


# ---------------------------------------------------------------------------------------------
# Errors


def _unwrap(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def user_error(error: BaseException, rpc_url: str | None, *, exit_code: int | None = None) -> Any:
    """`error` as a `UserError` carrying `explain_error`'s line (and the error's own
    `exit_code`, if it has one), when it is a failure a user meets (the cluster, a run, a
    wallet, a value they gave); None when it is a bug, which keeps its traceback."""
    import trio

    from psyche.core.cli import UserError
    from psyche.solana.admin import AdminError
    from psyche.solana.app import ClientVersionMismatch, RunNotFound
    from psyche.solana.backend import SolanaBackendError
    from psyche.solana.retry import RetryFailed
    from psyche.solana.rpc import RpcError
    from psyche.solana.subscription import SubscriptionError

    cause = _unwrap(error)
    expected = (
        UserError,
        AdminError,
        SolanaBackendError,
        RpcError,
        RetryFailed,
        SubscriptionError,
        RunNotFound,
        ClientVersionMismatch,
        ValueError,  # KeypairError, bad arguments, decoding what the cluster sent
        OSError,
        trio.TooSlowError,
    )
    if not isinstance(cause, expected):
        return None
    code = exit_code if exit_code is not None else getattr(cause, "exit_code", None)
    return UserError(explain_error(error, rpc_url), exit_code=code)


def explain_error(error: BaseException, rpc_url: str | None) -> str:
    """One line saying what went wrong and, where it helps, what to do."""
    from psyche.solana.admin import AdminError
    from psyche.solana.anchor import find_anchor_error
    from psyche.solana.backend import SolanaBackendError
    from psyche.solana.keypair import KeypairError
    from psyche.solana.rpc import RpcResponseError, RpcTransportError, TransactionError

    error = _unwrap(error)
    if isinstance(error, AdminError | KeypairError):
        return str(error)
    if isinstance(error, SolanaBackendError):
        cause = error.cause
        if isinstance(cause, RpcTransportError):
            return (
                f"cannot reach the Solana RPC at {cause.url} ({cause.kind}: {cause}); "
                "is the validator or local endpoint running, and are --rpc/--ws-rpc right?"
            )
        if isinstance(cause, RpcResponseError | TransactionError):
            logs = cause.logs
            anchor = find_anchor_error(logs)
            if anchor is not None:
                detail = f"{anchor.name} ({anchor.number}): {anchor.message}"
            else:
                detail = _describe_custom(cause)
            hint = _hint(anchor.name if anchor else "")
            tail = f" Last log lines: {' | '.join(logs[-3:])}" if logs else ""
            return f"transaction rejected: {detail}.{hint}{tail}"
        return str(error)
    if isinstance(error, ValueError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _describe_custom(cause: Any) -> str:
    from psyche.solana.transaction_errors import describe_transaction_error

    err = getattr(cause, "simulation_err", None) or getattr(cause, "err", None)
    if err is not None:
        return describe_transaction_error(err)
    return str(getattr(cause, "message", cause))


_HINTS = {
    "ConstraintRaw": " A constraint on the accounts failed: wrong authority, wrong account or "
    "an authorization that does not cover this wallet.",
    "ConfigSanityCheckFailed": " The config does not pass the coordinator's checks.",
    "ModelSanityCheckFailed": " The model does not pass the coordinator's checks.",
    "UpdateConfigNotHalted": " Pause the run first (set-paused).",
    "CloseCoordinatorNotHalted": " Pause the run first (set-paused).",
    "AccountNotInitialized": " An account the instruction needs does not exist.",
}


def _hint(name: str) -> str:
    return _HINTS.get(name, "")
