"""Scripted Solana clients and a clock driver for the backend end-to-end tests.

A `ScriptedClient` does what a training client does with its backend, minus the training: it
joins when the run waits for members, sends its warmup witness, witnesses rounds it is selected
for (listing the trainers it "saw"), and, when told to, health-checks a lazy peer and reports a
checkpoint. Everything goes through `SolanaBackendRunner` (the `Backend` protocol) over the
local endpoint. The `Driver` stands in for wall-clock time: it advances the endpoint's manual
clock when the run waits on a timeout, and sends the ticks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import trio
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from psyche.coordinator import (
    ClientState,
    Coordinator,
    RunState,
    Witness,
    WitnessMetadata,
)
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.committee_selection import CommitteeSelection, WitnessProof
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.model import LLM, Checkpoint, HubRepo, LLMTrainingDataLocation, Model
from psyche.core.bloom import WitnessBloom
from psyche.core.definitions import Distro, OptimizerDefinition
from psyche.core.identity import SecretKey
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.node_identity import NodeIdentity
from psyche.core.sha256 import sha256
from psyche.solana import admin
from psyche.solana.backend import Cluster, SolanaBackend
from psyche.solana.follower import (
    LeftRun,
    SolanaBackendRunner,
    follow_membership,
    follow_run,
)
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.keypair import derive_p2p_secret_key
from psyche.solana.localnet.ledger import Ledger, ManualClock
from psyche.solana.localnet.server import LocalnetHandle, start_localnet
from psyche.solana.retry import RetryPolicy

RUN_ID = "e2e"
START = 1_700_000_000  # the ledgers' clock at the start of a test
FAST_RETRY = RetryPolicy(initial_delay=0.05, factor=1.5, max_retries=3, max_delay=0.2)
WAIT = 10.0  # generous: how long the driver waits for an expected transaction


def fast_reconnect(retries: int) -> float:
    return min(0.5, 0.1 * retries)


def tiny_model() -> Model:
    return Model.LLM(
        dataclasses.replace(
            LLM.dummy(),
            max_seq_len=128,
            checkpoint=Checkpoint.Hub(HubRepo("psyche/tiny-init")),
            data_location=LLMTrainingDataLocation.Server("127.0.0.1:20001"),
            optimizer=OptimizerDefinition.Distro(
                Distro(
                    clip_grad_norm=1.0,
                    compression_decay=0.999,
                    compression_topk=8,
                    compression_chunk=16,
                    quantize_1bit=True,
                )
            ),
        )
    )


def config(**changes: int) -> CoordinatorConfig:
    base = CoordinatorConfig(
        warmup_time=2,
        cooldown_time=2,
        max_round_train_time=3,
        round_witness_time=1,
        global_batch_size_warmup_tokens=0,
        epoch_time=8,
        total_steps=100,
        init_min_clients=3,
        min_clients=2,
        witness_nodes=1,
        global_batch_size_start=4,
        global_batch_size_end=4,
        verification_percent=0,
        waiting_for_members_extra_time=1,
    )
    return dataclasses.replace(base, **changes)


def make_backend(
    ledger: Ledger, clusters: list[Cluster], keypair: Keypair | None = None
) -> SolanaBackend:
    keypair = keypair or Keypair()
    ledger.airdrop(keypair.pubkey(), 100 * 10**9)
    return SolanaBackend(
        clusters[0],
        keypair,
        clusters[1:],
        retry_policy=FAST_RETRY,
        reconnect_delay=fast_reconnect,
        confirm_timeout=5.0,
        rpc_timeout=5.0,
    )


async def open_localnet(
    nursery: trio.Nursery, clock: ManualClock | None = None
) -> tuple[Ledger, LocalnetHandle, list[Cluster]]:
    """A ledger on `clock` (a manual clock at `START` by default) served on loopback in
    `nursery`: the ledger, the endpoint (to stop and restart it) and its cluster."""
    ledger = Ledger(clock=clock or ManualClock(START))
    net = await start_localnet(nursery, ledger)
    return ledger, net, [Cluster(net.rpc_url, net.ws_url)]


async def create_run(owner: SolanaBackend, run_config: CoordinatorConfig) -> Pubkey:
    """The admin sequence of `create-permissionless-run.sh`, plus reward rates (and, for a
    config that verifies exactly, the verification account and its
    `exact_verification_threads`, which the coordinator account cannot hold)."""
    await admin.join_authorization_create(owner, Pubkey.default())
    created = await admin.create_run(owner, RUN_ID, "test")
    account = created.account_address
    payer = owner.get_payer()
    exact = []
    if run_config.verification_percent and run_config.exact_verification_threads:
        threads = run_config.exact_verification_threads
        exact = [
            coordinator_ix.coordinator_init_verification(
                payer, created.instance_address, account, owner.ids
            ),
            coordinator_ix.coordinator_set_exact_verification_threads(
                RUN_ID, account, payer, threads, owner.ids
            ),
        ]
    await owner.send_and_retry(
        "Update",
        [
            coordinator_ix.coordinator_update(
                RUN_ID, account, payer, config=run_config, model=tiny_model()
            ),
            coordinator_ix.coordinator_set_future_epoch_rates(RUN_ID, account, payer, 1000, 10),
            *exact,
        ],
    )
    await admin.set_paused(owner, RUN_ID, False)
    return account


@dataclass
class ScriptedClient:
    name: str
    backend: SolanaBackend
    lazy_signers: set[bytes] = field(default_factory=set)
    health_checker: bool = False
    checkpointer: bool = False
    states_seen: int = 0
    runner: SolanaBackendRunner | None = None
    left: str | None = None

    @property
    def identity(self) -> NodeIdentity:
        p2p = SecretKey.from_bytes(derive_p2p_secret_key(RUN_ID, self.backend.payer))
        return NodeIdentity(bytes(self.backend.get_payer()), p2p.public_key)

    async def run(self, account: Pubkey, *, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
        """Follow the run until the client leaves it (`self.left` says why)."""
        async with follow_run(self.backend, RUN_ID, account) as runner:
            self.runner = runner
            task_status.started()
            try:
                async with trio.open_nursery() as nursery:
                    # joining and leaving: the Solana client's own rules
                    nursery.start_soon(follow_membership, runner, self.identity)
                    await self._loop(runner)
            except BaseExceptionGroup as group:
                matched, rest = group.split(LeftRun)
                if rest is not None:
                    raise rest from None
                assert matched is not None
                left = matched.exceptions[0]
                assert isinstance(left, LeftRun)
                self.left = left.reason

    async def _loop(self, runner: SolanaBackendRunner) -> None:
        me = self.identity
        warmup_epoch = None
        witnessed: set[tuple[int, int]] = set()
        health_checked = checkpointed = False
        while True:
            state = await runner.wait_for_new_state()
            self.states_seen += 1
            epoch = state.progress.epoch
            if state.run_state is RunState.WaitingForMembers:
                continue
            signers = [c.id.signer for c in state.epoch_state.clients]
            if me.signer not in signers:
                continue
            index = signers.index(me.signer)
            if state.run_state is RunState.Warmup and warmup_epoch != epoch:
                warmup_epoch = epoch
                await runner.send_witness(
                    OpportunisticData.WarmupStep(Witness(WitnessProof(index, index, False)))
                )
            if state.run_state is not RunState.RoundTrain:
                continue
            round_ = state.current_round()
            assert round_ is not None
            if (epoch, round_.height) not in witnessed:
                witnessed.add((epoch, round_.height))
                proof = CommitteeSelection.from_coordinator(state, 0).get_witness(index)
                if proof.witness:
                    await runner.send_witness(self._witness(state, proof))
            if self.health_checker and not health_checked and round_.height >= 2:
                previous = CommitteeSelection.from_coordinator(state, -1)
                lazy = [
                    (c.id, previous.get_committee(i))
                    for i, c in enumerate(state.epoch_state.clients)
                    if c.id.signer in self.lazy_signers and c.state is ClientState.Healthy
                ]
                if lazy:
                    await runner.send_health_check(lazy)
                    health_checked = True
            if self.checkpointer and not checkpointed and round_.height >= 1:
                await runner.send_checkpoint(Checkpoint.Hub(HubRepo("psyche/tiny", "step-1")))
                checkpointed = True

    def _witness(self, state: Coordinator, proof: WitnessProof) -> OpportunisticData:
        participants = WitnessBloom.random(64, 0.01)
        for client in state.epoch_state.clients:
            if client.id.signer not in self.lazy_signers:
                participants.add(sha256(client.id.signer))
        witness = Witness(proof, participants, WitnessBloom(), MerkleRoot())
        metadata = WitnessMetadata(step=state.progress.step, loss=2.0)
        return OpportunisticData.WitnessStep((witness, metadata))


class Driver:
    """Moves the manual clock when the run is waiting on a timeout, and ticks."""

    def __init__(self, ledger: Ledger, owner: SolanaBackend, observer: SolanaBackendRunner) -> None:
        self.ledger = ledger
        self.owner = owner
        self.observer = observer
        self.state: Coordinator | None = None
        self.history: list[RunState] = []
        self._run: admin.RunRef | None = None

    async def next_state(self) -> Coordinator:
        self.state = await self.observer.wait_for_new_state()
        if not self.history or self.history[-1] is not self.state.run_state:
            self.history.append(self.state.run_state)
        return self.state

    async def wait_for(self, predicate, what: str) -> Coordinator:  # type: ignore[no-untyped-def]
        with trio.fail_after(WAIT):
            while self.state is None or not predicate(self.state):
                await self.next_state()
        assert self.state is not None, what
        return self.state

    async def tick_after(self, seconds: int) -> None:
        self.ledger.advance_clock(seconds)
        if self._run is None:
            self._run = await admin.load_run(self.owner, RUN_ID)
        await admin.tick(self.owner, self._run)

    async def run_epoch(self, expected_clients: int, *, between_rounds=None) -> Coordinator:  # type: ignore[no-untyped-def]
        """Drive one epoch, from waiting for members to the next wait; returns the last state."""
        cfg: CoordinatorConfig | None = None
        start_epoch = None
        while True:
            state = await self.next_state() if self.state is None else self.state
            cfg = state.config
            if start_epoch is None:
                start_epoch = state.progress.epoch
            match state.run_state:
                case RunState.WaitingForMembers:
                    if state.progress.epoch > start_epoch:
                        return state
                    await self._wait_for_joins(expected_clients)
                    await self.tick_after(cfg.waiting_for_members_extra_time)
                    await self.wait_for(
                        lambda s: s.run_state is not RunState.WaitingForMembers, "warmup"
                    )
                case RunState.Warmup:
                    # the first warmup witness starts training
                    await self.wait_for(
                        lambda s: s.run_state is not RunState.Warmup, "warmup witness"
                    )
                case RunState.RoundTrain:
                    # the selected witness moves the round to its witness phase
                    await self.wait_for(lambda s: s.run_state is not RunState.RoundTrain, "witness")
                case RunState.RoundWitness:
                    if between_rounds is not None:
                        await between_rounds(self)
                    await self.tick_after(cfg.round_witness_time)
                    await self.wait_for(
                        lambda s: s.run_state is not RunState.RoundWitness, "next round"
                    )
                case RunState.Cooldown:
                    await self.tick_after(cfg.cooldown_time)
                    await self.wait_for(lambda s: s.run_state is not RunState.Cooldown, "epoch end")
                case other:
                    raise AssertionError(f"unexpected run state {other}")

    async def _wait_for_joins(self, expected: int) -> None:
        with trio.fail_after(WAIT):
            while True:
                clients_state = self.observer.latest.state.clients_state
                if len(clients_state.get_active_clients_ids()) >= expected:
                    return
                await self.next_state()
