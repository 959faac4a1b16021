"""`psyche-solana-client train` without training: its options, bootstrap peers, the client
version rules, membership decisions, and the runner's sends surviving the RPC going away (the
training itself runs end to end in test_train_e2e.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from solders.keypair import Keypair

from psyche.cli.solana_client.main import build_parser, main
from psyche.cli.solana_client.train import (
    bootstrap_peers,
    format_bootstrap_peer,
    parse_bootstrap_peer,
)
from psyche.coordinator import Client, ClientState, Coordinator, RunState
from psyche.core.cli import parse_command, user_error_message
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.network.ticket import EndpointAddr, TransportAddr
from psyche.solana import follower as follower_module
from psyche.solana.app import (
    ClientVersionMismatch,
    SolanaRun,
    check_client_version,
    check_version_unchanged,
    train_on_run,
    watch_client_version,
)
from psyche.solana.backend import Cluster, SolanaBackendError
from psyche.solana.follower import (
    LeftRun,
    Membership,
    StateReceiver,
    epoch_abandoned,
    follow_membership,
    follow_run,
)
from psyche.solana.keypair import write_keypair_file
from psyche.solana.localnet.ledger import Ledger
from psyche.solana.localnet.server import LocalnetThread
from psyche.solana.retry import RetryKind

from ..polling import poll_until
from .scripted import ScriptedClient, config, create_run, make_backend, open_localnet

PEER = SecretKey.from_bytes((7).to_bytes(32, "big")).public_key


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "RAW_WALLET_PRIVATE_KEY",
        "WALLET_PRIVATE_KEY_PATH",
        "RAW_IDENTITY_SECRET_KEY",
        "RUN_ID",
        "RPC",
        "WS_RPC",
        "AUTHORIZER",
        "BOOTSTRAP_PEERS",
        "CLIENT_VERSION",
        "MICRO_BATCH_SIZE",
        "WANDB_PROJECT",
    ):
        monkeypatch.delenv(name, raising=False)


# --------------------------------------------------------------------------------------------
# options


def parse_train(argv: list[str]) -> Any:
    return parse_command(build_parser(), ["train", *argv])


def test_train_takes_the_shared_train_options_and_the_solana_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RUN_ID", '"my-run"')
    monkeypatch.setenv("MICRO_BATCH_SIZE", "4")
    monkeypatch.setenv("RPC_2", "http://backup:8899")
    monkeypatch.setenv("WS_RPC_2", "ws://backup:8900")
    monkeypatch.setenv("AUTHORIZER", "11111111111111111111111111111111")
    args = parse_train(["-w", "wallet.json", "--rpc", "http://primary:8899", "--device", "cpu"])
    assert args.run_id == "my-run"  # quotes trimmed, as upstream
    assert args.micro_batch_size == 4
    assert args.device == "cpu"
    assert (args.logs, args.keep_steps, args.iroh_discovery) == ("console", 3, "n0")
    assert args.wallet_private_key_path == Path("wallet.json")
    assert args.authorizer == "11111111111111111111111111111111"
    from psyche.cli.solana_client.train import backup_clusters

    assert backup_clusters(args) == (Cluster("http://backup:8899", "ws://backup:8900"),)
    # a half pair is ignored, as upstream
    monkeypatch.delenv("WS_RPC_2")
    assert backup_clusters(parse_train(["--run-id", "r"])) == ()


def test_train_refuses_unbuilt_features_and_bad_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--run-id", "r", "--wandb-project", "p"]) == 2
    assert "Weights & Biases" in capsys.readouterr().err
    assert main(["train", "--run-id", "r"]) == 2
    assert "No wallet private key" in capsys.readouterr().err
    wallet = tmp_path / "w.json"
    write_keypair_file(Keypair(), wallet)
    assert main(["train", "--run-id", "r", "-w", str(wallet), "--bootstrap-peer", "nope"]) == 2
    assert "expected <endpoint id hex>@<host>:<port>" in capsys.readouterr().err
    assert main(["train", "--run-id", "r", "-w", str(wallet), "--authorizer", "x!"]) == 2
    assert "not a base58 public key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "-w", str(wallet)])
    assert "--run-id (or RUN_ID)" in capsys.readouterr().err


def test_train_fails_fast_on_a_missing_run_or_another_client_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before torch is imported: the run is looked up and CLIENT_VERSION checked (exit 10)."""
    with LocalnetThread(Ledger()) as net:
        owner = Keypair()
        net.ledger.airdrop(owner.pubkey(), 100 * 10**9)
        wallet = tmp_path / "owner.json"
        write_keypair_file(owner, wallet)
        cluster = ["--rpc", net.rpc_url, "--ws-rpc", net.ws_url, "-w", str(wallet)]
        assert main(["train", "--run-id", "nothing-here", *cluster]) == 1
        err = capsys.readouterr().err
        assert "run 'nothing-here' not found" in err

        assert (
            main(["create-run", "--run-id", "versioned", "--client-version", "v1", *cluster]) == 0
        )
        capsys.readouterr()
        monkeypatch.setenv("CLIENT_VERSION", "v2")
        assert main(["train", "--run-id", "versioned", *cluster]) == 10
        err = capsys.readouterr().err
        assert "this client is version 'v2', the run wants 'v1'" in err


def test_train_help_is_fast_and_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from psyche.cli.solana_client.main import build_parser\n"
        "build_parser().format_help()\n"
        "heavy = [m for m in ('torch', 'transformers', 'libp2p') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    help_text = subprocess.run(
        [sys.executable, "-m", "psyche.cli.solana_client.main", "train", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    help_text = " ".join(help_text.split())
    for flag in (
        "--rpc-2",
        "--authorizer",
        "--bootstrap-peer",
        "--checkpoint-dir",
        "[env: MICRO_BATCH_SIZE]",
        "derived from the run id and the wallet",
    ):
        assert flag in help_text, flag


# --------------------------------------------------------------------------------------------
# bootstrap peers


def test_bootstrap_peers_parse_and_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    addr = parse_bootstrap_peer(f" {PEER.hex()}@127.0.0.1:4001 ")
    assert addr == EndpointAddr(PEER, [TransportAddr.Libp2p("/ip4/127.0.0.1/tcp/4001")])
    assert format_bootstrap_peer(addr) == f"{PEER.hex()}@127.0.0.1:4001"
    assert parse_bootstrap_peer(f"{PEER.hex()}@localhost:9").libp2p_addrs() == [
        "/ip4/127.0.0.1/tcp/9"
    ]
    # the command line wins; else BOOTSTRAP_PEERS, comma-separated
    one, two = f"{PEER.hex()}@127.0.0.1:1", f"{PEER.hex()}@127.0.0.2:2"
    environ = {"BOOTSTRAP_PEERS": f"{one}, {two}"}
    assert [a.libp2p_addrs()[0] for a in bootstrap_peers(None, environ)] == [
        "/ip4/127.0.0.1/tcp/1",
        "/ip4/127.0.0.2/tcp/2",
    ]
    assert len(bootstrap_peers([two], environ)) == 1
    assert bootstrap_peers(None, {}) == []
    blob_only = EndpointAddr(PEER, [TransportAddr.BlobTcp("127.0.0.1:5")])
    assert format_bootstrap_peer(blob_only) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("127.0.0.1:4001", "expected <endpoint id hex>@<host>:<port>"),
        ("zz@127.0.0.1:4001", "not hexadecimal"),
        ("abcd@127.0.0.1:4001", "must be 64 hex digits (32 bytes), got 4"),
        (f"{PEER.hex()}@127.0.0.1", "expected host:port"),
        (f"{PEER.hex()}@127.0.0.1:99999", "99999"),
        # refused before any lookup (an empty label): no DNS query leaves the machine
        (f"{PEER.hex()}@no-such-host..invalid:1", "cannot resolve"),
    ],
)
def test_bad_bootstrap_peers_are_refused_clearly(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="bootstrap peer") as info:
        parse_bootstrap_peer(text)
    assert message in str(info.value)


# --------------------------------------------------------------------------------------------
# client version


def test_client_version_rules() -> None:
    assert check_client_version(None, "v1") is False  # nothing to check: warn and go on
    assert check_client_version("v1", "v1") is True
    assert check_client_version("v9", "test") is True  # a "test" run takes any version
    with pytest.raises(ClientVersionMismatch) as info:
        check_client_version("v2", "v1")
    assert info.value.exit_code == 10
    check_version_unchanged("v1", "v1")
    with pytest.raises(ClientVersionMismatch, match="changed from 'v1' to 'v2'"):
        check_version_unchanged("v1", "v2")


# --------------------------------------------------------------------------------------------
# membership decisions (a scripted stream of states)


def identity(n: int) -> NodeIdentity:
    return NodeIdentity(bytes([n]) * 32, bytes([n + 100]) * 32)


ME, OTHER = identity(1), identity(2)


def state(
    run_state: RunState, clients: dict[NodeIdentity, ClientState] | None = None, epoch: int = 0
) -> Coordinator:
    coordinator = Coordinator.zeroed()
    coordinator.run_state = run_state
    coordinator.progress.epoch = epoch
    coordinator.epoch_state.clients = [Client(i, s) for i, s in (clients or {}).items()]
    return coordinator


class FakeRunner:
    """What `follow_membership` uses of a `SolanaBackendRunner`, with scripted join results."""

    run_id = "fake"

    def __init__(self, first: Coordinator, join_errors: list[SolanaBackendError] = ()) -> None:  # type: ignore[assignment]
        self.latest = SimpleNamespace(state=SimpleNamespace(coordinator=first, client_version="v1"))
        self.receivers: list[StateReceiver] = []
        self.join_errors = list(join_errors)
        self.join_attempts = 0

    def subscribe(self) -> StateReceiver:
        receiver = StateReceiver()
        self.receivers.append(receiver)
        return receiver

    def push(self, coordinator: Coordinator) -> None:
        self.latest.state.coordinator = coordinator
        for receiver in self.receivers:
            receiver.push(coordinator)

    async def join_run(self, client_id: NodeIdentity, authorizer: Any = None) -> str:
        self.join_attempts += 1
        if self.join_errors:
            raise self.join_errors.pop(0)
        return f"join-{self.join_attempts}"

    async def auto_tick(self, *, interval: float) -> None:
        await trio.sleep_forever()


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


def test_membership_joins_each_epoch_and_stays_through_an_abandoned_one() -> None:
    async def scenario() -> None:
        runner = FakeRunner(state(RunState.WaitingForMembers))
        membership = Membership()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow_membership, runner, ME, None, membership)
            await settle()
            assert membership.joins == 1
            assert membership.ever_joined
            healthy = {ME: ClientState.Healthy, OTHER: ClientState.Healthy}
            runner.push(state(RunState.Warmup, healthy))
            runner.push(state(RunState.RoundTrain, healthy))
            # a round without witnesses: the coordinator withdrew everyone and ended the epoch
            withdrawn = {ME: ClientState.Withdrawn, OTHER: ClientState.Withdrawn}
            runner.push(state(RunState.Cooldown, withdrawn))
            assert epoch_abandoned(state(RunState.Cooldown, withdrawn))
            await settle()
            runner.push(state(RunState.WaitingForMembers, withdrawn, epoch=1))
            await settle()
            assert membership.joins == 2  # joined the next epoch instead of leaving
            nursery.cancel_scope.cancel()

    trio.run(scenario)


@pytest.mark.parametrize(
    ("last", "reason"),
    [
        (state(RunState.RoundTrain, {OTHER: ClientState.Healthy}), "Not a participant"),
        (
            state(RunState.RoundTrain, {ME: ClientState.Dropped, OTHER: ClientState.Healthy}),
            "this client is Dropped",
        ),
        (
            # withdrawn alone (the others still healthy): out, as upstream
            state(RunState.Cooldown, {ME: ClientState.Withdrawn, OTHER: ClientState.Healthy}),
            "this client is Withdrawn",
        ),
        (state(RunState.Paused, {ME: ClientState.Healthy}), "the run is Paused"),
    ],
)
def test_membership_leaves_when_the_coordinator_is_done_with_us(
    last: Coordinator, reason: str
) -> None:
    async def scenario() -> None:
        runner = FakeRunner(state(RunState.WaitingForMembers))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow_membership, runner, ME)
            await settle()
            runner.push(last)
            await trio.sleep_forever()

    with pytest.raises(BaseExceptionGroup) as info:
        trio.run(scenario)
    (error,) = info.value.exceptions
    assert isinstance(error, LeftRun)
    assert reason in str(error)
    # the command ends on one line saying why, not on a traceback calling it a bug
    message = user_error_message(error)
    assert message is not None
    assert message.startswith("this client is out of the run: ")


def test_a_join_failing_for_a_passing_reason_is_retried_a_refused_one_raises() -> None:
    outage = SolanaBackendError("all RPCs exhausted", None, None)
    refused = SolanaBackendError("cannot join: not authorized", RetryKind.NonRetryable, None)

    async def retried() -> None:
        runner = FakeRunner(state(RunState.WaitingForMembers), [outage, outage])
        membership = Membership()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: follow_membership(runner, ME, None, membership, join_retry_delay=0.01)
            )
            with trio.fail_after(5):
                await poll_until(lambda: membership.joins != 0, 0.01)
            assert (runner.join_attempts, membership.failed_joins) == (3, 2)
            nursery.cancel_scope.cancel()

    trio.run(retried)

    async def refusal() -> None:
        await follow_membership(FakeRunner(state(RunState.WaitingForMembers), [refused]), ME)

    with pytest.raises(SolanaBackendError, match="not authorized"):
        trio.run(refusal)


RUN = SolanaRun("fake", Keypair().pubkey(), Keypair().pubkey(), "v1")


def test_a_new_client_version_on_a_paused_run_ends_a_client_that_never_joined() -> None:
    async def scenario(membership: Membership) -> None:
        runner = FakeRunner(state(RunState.Paused))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: watch_client_version(runner, "v1", membership, interval=0.01)
            )
            await trio.sleep(0.05)  # unchanged: nothing happens
            runner.latest.state.client_version = "v2"
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    with pytest.raises(BaseExceptionGroup) as info:
        trio.run(scenario, Membership())
    (error,) = info.value.exceptions
    assert isinstance(error, ClientVersionMismatch)
    assert error.exit_code == 10
    trio.run(scenario, Membership(ever_joined=True))  # a member leaves through LeftRun instead


def test_train_on_run_ends_with_the_client_or_with_the_membership() -> None:
    async def client_returns() -> None:
        runner = FakeRunner(state(RunState.WaitingForMembers))
        membership = Membership()

        async def client() -> None:
            await settle()

        with trio.fail_after(5):
            await train_on_run(runner, ME, RUN, client, membership=membership)
        assert membership.joins == 1  # joined meanwhile; the follower was cancelled after

    trio.run(client_returns)

    async def dropped() -> None:
        runner = FakeRunner(state(RunState.WaitingForMembers))

        async def client() -> None:
            await settle()
            runner.push(state(RunState.RoundTrain, {ME: ClientState.Dropped}))
            await trio.sleep_forever()  # cancelled when the membership raises

        with trio.fail_after(5):
            await train_on_run(runner, ME, RUN, client)

    with pytest.raises(BaseExceptionGroup) as info:
        trio.run(dropped)
    assert "this client is Dropped" in str(info.value.exceptions[0].exceptions[0])


# --------------------------------------------------------------------------------------------
# the runner's sends while the RPC endpoint is away (real endpoint, stopped and restarted)


def test_sends_wait_out_an_rpc_outage_and_ticks_do_not_pile_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(follower_module, "SEND_RETRY_DELAY", 0.1)

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            ledger, net, cluster = await open_localnet(nursery)
            owner = make_backend(ledger, cluster)
            account = await create_run(owner, config(init_min_clients=1, min_clients=1))
            client = make_backend(ledger, cluster)
            async with follow_run(client, "e2e", account) as runner:
                await net.stop()
                # a join while the endpoint is away is retried until it is back
                membership = Membership()
                me = ScriptedClient("x", client).identity
                nursery.start_soon(
                    lambda: follow_membership(runner, me, None, membership, join_retry_delay=0.1)
                )
                # a scheduled send (as a witness) keeps trying while the run has not moved on
                runner.spawn_scheduled_send(
                    "Tick", [client.tick_instruction(runner.instance, account)]
                )
                # ticks: one in flight at a time, and not retried past the backend's retries
                runner.send_tick()
                runner.send_tick()
                with trio.fail_after(10):
                    await poll_until(
                        lambda: runner.failed_sends >= 1 and membership.failed_joins >= 1, 0.02
                    )
                assert runner.failed_sends == 1  # the one tick that was sent
                assert runner.resent_after_outage >= 1
                await net.start()
                with trio.fail_after(10):
                    await poll_until(
                        lambda: runner.completed_sends >= 1 and membership.joins >= 1, 0.02
                    )
                assert runner.failed_sends == 1
                state_ = (await owner.get_coordinator_account(account)).state
                assert [c.id.signer for c in state_.clients_state.clients] == [me.signer]
            nursery.cancel_scope.cancel()

    trio.run(scenario)


def test_admin_helpers_used_by_the_recipes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`create-wallet` and `airdrop` (the justfile's training recipe: an ephemeral funded wallet)."""
    wallet = tmp_path / "keys" / "wallet.json"
    assert main(["create-wallet", str(wallet)]) == 0
    pubkey = capsys.readouterr().out.split("pubkey: ")[1].strip()
    assert main(["create-wallet", str(wallet)]) == 1
    assert "exists" in capsys.readouterr().err
    with LocalnetThread(Ledger()) as net:
        cluster = ["--rpc", net.rpc_url, "--ws-rpc", net.ws_url]
        assert main(["airdrop", "-w", str(wallet), "--sol", "2.5", *cluster]) == 0
        out = capsys.readouterr().out
        assert f"to {pubkey}" in out
        assert "Balance: 2.500000000 SOL" in out
        other = str(Keypair().pubkey())
        assert main(["airdrop", "--address", other, *cluster]) == 0
        assert "Balance: 10.000000000 SOL" in capsys.readouterr().out
