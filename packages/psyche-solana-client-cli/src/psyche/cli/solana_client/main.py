"""`psyche-solana-client`: create, configure, pause, resume and inspect Psyche runs on Solana.

The admin commands are upstream's (they lived in `psyche-solana-client` before they moved to
`run-manager`) with the same flags and environment variables; `localnet` serves a local endpoint
for users without a validator. Every command prints what it did; failures print one clear line
on stderr (`psyche-solana-client: error: ...`) and exit 1 (2 for bad options); signals and the
rest as every command (`psyche.core.cli`).

This module only parses: each command's options and its `run_*` function are the library's
(`psyche.solana.commands`, `psyche.solana.localnet`); `train` and `predownload`, which need the
training client too, are composed here (`train.py`, `predownload.py`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from psyche.cli.solana_client.predownload import predownload
from psyche.cli.solana_client.train import add_train_arguments, train
from psyche.core.cli import Command, commands_parser, run_commands
from psyche.solana.commands import authorization, results, run, treasury, view, wallet
from psyche.solana.commands.predownload import PredownloadOptions
from psyche.solana.localnet.__main__ import LocalnetOptions, run_localnet

PROG = "psyche-solana-client"
DESCRIPTION = """\
Manage and follow Psyche training runs on Solana.

Cluster flags default to a local validator (http://127.0.0.1:8899, ws://127.0.0.1:8900); use
--rpc/--ws-rpc (or RPC/WS_RPC) for devnet. The wallet is a solana-keygen JSON keypair
(--wallet-private-key-path or WALLET_PRIVATE_KEY_PATH), or RAW_WALLET_PRIVATE_KEY (a JSON byte
array or base58), which wins when set. Errors are one line; --verbose (or PSYCHE_VERBOSE=1) adds
their traceback. SIGINT (Ctrl+C) or SIGTERM stops any command (exit 130 / 143)."""


COMMANDS = (
    Command(
        "create-run",
        "Create and initialize a run (its coordinator account and instance)",
        run.CreateRunOptions,
        run.run_create_run,
    ),
    Command(
        "close-run",
        "Close a halted run and recover the rent of its accounts",
        run.CloseRunOptions,
        run.run_close_run,
    ),
    Command(
        "update-config",
        "Update a run's config/model (from a run config TOML) and metadata",
        run.UpdateConfigOptions,
        run.run_update_config,
    ),
    Command(
        "set-paused",
        "Pause a run, or resume it with --resume",
        run.SetPausedOptions,
        run.run_set_paused,
    ),
    Command(
        "set-future-epoch-rates",
        "Set reward rates from the next epoch (treasurer runs)",
        run.SetFutureEpochRatesOptions,
        run.run_set_future_epoch_rates,
    ),
    Command("tick", "Send tick transactions to a run", run.TickOptions, run.run_tick),
    Command(
        "checkpoint",
        "Point a run's checkpoint at a Hugging Face repo",
        run.CheckpointOptions,
        run.run_checkpoint,
    ),
    Command(
        "join-authorization-create",
        "Allow a key (or everyone) to join the wallet's runs",
        authorization.JoinAuthorizationCreateOptions,
        authorization.run_join_authorization_create,
    ),
    Command(
        "join-authorization-set-delegates",
        "As an authorization's grantee, set the delegate keys that may join for it",
        authorization.JoinAuthorizationSetDelegatesOptions,
        authorization.run_join_authorization_set_delegates,
        aliases=("join-authorization-delegate",),
    ),
    Command(
        "join-authorization-read",
        "Show a join authorization",
        authorization.JoinAuthorizationReadOptions,
        authorization.run_join_authorization_read,
    ),
    Command(
        "join-authorization-delete",
        "Deactivate the wallet's join authorization",
        authorization.JoinAuthorizationDeleteOptions,
        authorization.run_join_authorization_delete,
    ),
    Command(
        "can-join",
        "Whether an address may join a run",
        authorization.CanJoinOptions,
        authorization.run_can_join,
    ),
    Command(
        "show",
        "Decode and print a run's on-chain state (as JSON with --json or as json-dump-run)",
        view.ShowOptions,
        view.run_show,
        aliases=("json-dump-run",),
        implied={"json-dump-run": {"json": True}},
    ),
    Command(
        "json-dump-user",
        "Print, as JSON, what a run knows of one address (client, epoch, rewards)",
        view.JsonDumpUserOptions,
        view.run_json_dump_user,
    ),
    Command(
        "treasurer-top-up-rewards",
        "Transfer collateral from the wallet into a treasurer run's rewards vault",
        treasury.TreasurerTopUpRewardsOptions,
        treasury.run_treasurer_top_up_rewards,
    ),
    Command(
        "treasurer-claim-rewards",
        "Claim the collateral the wallet earned in a treasurer run (as far as the vault holds)",
        treasury.TreasurerClaimRewardsOptions,
        treasury.run_treasurer_claim_rewards,
    ),
    Command(
        "list-runs",
        "List the runs the wallet may join on the coordinator program",
        view.ListRunsOptions,
        view.run_list_runs,
        description="List the runs the wallet may join on the coordinator program: not paused, "
        "finished or uninitialized, and authorized for everyone, for the wallet, or for the "
        "delegate authorizer AUTHORIZER; runs waiting for members first. The wallet is "
        "RAW_WALLET_PRIVATE_KEY or WALLET_PRIVATE_KEY_PATH (or -w), read after --env-file.",
    ),
    Command(
        "download-results",
        "Download a run's result files from the run-down service (signed with the wallet)",
        results.DownloadResultsOptions,
        results.run_download_results,
    ),
    Command(
        "upload-data",
        "Upload a file or a directory's files to a run through the run-down service",
        results.UploadDataOptions,
        results.run_upload_data,
    ),
    Command(
        "predownload",
        "Fetch a run's model (--model) and evaluation datasets (--eval-tasks) before joining",
        PredownloadOptions,
        predownload,
    ),
    Command(
        "show-identity",
        "Print the wallet's public key and the P2P identity it trains with",
        wallet.ShowIdentityOptions,
        wallet.run_show_identity,
    ),
    Command(
        "show-static-p2p-identity",
        "Print a P2P identity key file's key",
        wallet.ShowStaticP2pIdentityOptions,
        wallet.run_show_static_p2p_identity,
        described=False,
    ),
    Command(
        "create-static-p2p-identity",
        "Write a new P2P identity key",
        wallet.CreateStaticP2pIdentityOptions,
        wallet.run_create_static_p2p_identity,
        described=False,
    ),
    Command(
        "train",
        "Join a run and train (the Psyche training client on a Solana coordinator)",
        None,
        train,
        description="Join a run whose coordinator lives on Solana and train until stopped "
        "(Ctrl+C) or until the coordinator drops this client. Every train option can also be "
        "given in the environment, named in upper snake case (--micro-batch-size: "
        "MICRO_BATCH_SIZE).",
        add=add_train_arguments,
    ),
    Command(
        "airdrop",
        "Request SOL from the cluster's faucet (a local endpoint or devnet), like `solana "
        "airdrop`: to --address, else to the wallet",
        wallet.AirdropOptions,
        wallet.run_airdrop,
    ),
    Command(
        "create-wallet",
        "Write a new solana-keygen style keypair file (like `solana-keygen new`)",
        wallet.CreateWalletOptions,
        wallet.run_create_wallet,
        described=False,
    ),
    Command(
        "localnet",
        "Serve a local Solana endpoint with the Psyche programs (Python ports)",
        LocalnetOptions,
        run_localnet,
        described=False,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    return commands_parser(PROG, DESCRIPTION, COMMANDS)[0]


def main(argv: Sequence[str] | None = None) -> int:
    """The `psyche-solana-client` command (exit codes and signals: `psyche.core.cli`)."""
    return run_commands(PROG, build_parser, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
