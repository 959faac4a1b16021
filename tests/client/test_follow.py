"""A follower's round in the client (`psyche.client.round.follow`, exact verification): a trainer
and its follower, each a real tiny-Llama `Trainer` driven through the client's own training step
(`run_round`, the follower's rebuild in its `follow` hook after its own training), the follower
comparing the trainer's announced commitment with its rebuild (`compare_and_report`). An honest
trainer's commitment is rebuilt bit for bit every round; one that adds 1 % of its update's norm
in a fixed direction (`Attack.Bias`) is found from its first lying round; a shadow whose trainer
announced nothing is dropped (a stale shadow would accuse an honest trainer)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from psyche.client.round.broadcast import TrainingResult
from psyche.client.round.fetch import DataFetcher
from psyche.client.round.follow import (
    Following,
    FollowJob,
    OutsideExactClass,
    check_exact_class,
    compare_and_report,
    follow_round,
)
from psyche.client.round.state import ResultEntry, RoundState
from psyche.client.round.train import OwnResult, TrainingStep, run_round
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.following import FOLLOW_DRAW, exact_class_problem
from psyche.coordinator.testing import simulated_identity
from psyche.coordinator.verification import VerificationDuty, VerificationReport
from psyche.core import BatchId
from psyche.core.sha256 import sha256
from psyche.core.token_size import TokenSize
from psyche.data_provider.dummy import DummyDataProvider
from psyche.modeling.hostile import Attack, HostileMember, make_hostile
from psyche.modeling.verification import Shadow
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr

from ..modeling.tiny_trainer import make_trainer
from .support import train_job

TRAINER, FOLLOWER = simulated_identity(2), simulated_identity(1)


def followed_rounds(
    attack: Attack | None, steps: int, silent: int | None = None
) -> tuple[list[list[bool]], Following]:
    """`steps` rounds of a trainer (lying with `attack` from its second round) and its follower;
    each round's findings (matches), and the follower's state after them. In round `silent` the
    trainer's result is never announced."""
    trainer, follower = make_trainer(weight_decay=0.1), make_trainer(weight_decay=0.1)
    if attack is not None:
        make_hostile(trainer, HostileMember(attack, seed=7, start=1))
    following = Following(epoch=0, shadows={TRAINER: Shadow.fresh(follower)})
    found: list[list[bool]] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            fetcher = DataFetcher(DummyDataProvider(TokenSize.FourBytes, 16, 256), nursery)
            owed: list[list[object]] = []
            for step in range(1, steps + 1):
                batch = BatchId(2 * step, 2 * step + 1)
                sent: list[OwnResult] = []
                trained = train_job(step, [batch], owed)
                await run_round(TrainingStep(), trainer, None, trained, fetcher, sent.append)
                (own,) = sent
                owed = [own.original]
                job = following.plan_duties(step, [VerificationDuty(batch, TRAINER, FOLLOWER)])
                if job is None:
                    found.append([])
                    continue
                handle = TrainingStep()
                rebuilt: dict[BatchId, bytes] = {}

                async def rebuild(
                    job: FollowJob = job,
                    handle: TrainingStep = handle,
                    rebuilt: dict[BatchId, bytes] = rebuilt,
                ) -> None:
                    rebuilt.update(await follow_round(handle, follower, job, following, fetcher))

                # the follower trains nothing of its own this round; the step's decay as everyone
                idle = train_job(step, [], [])
                await run_round(handle, follower, None, idle, fetcher, sent.append, follow=rebuild)
                state = RoundState(step=step)
                if step != silent:
                    ticket = BlobTicket(EndpointAddr(bytes(32), []), BlobFormat.Raw, sha256(b""), 1)
                    entry = ResultEntry(
                        TRAINER,
                        Commitment(own.commitment_data_hash, bytes(64)),
                        TrainingResult(batch, ticket),
                    )
                    state.results[batch] = [entry]
                reports: list[VerificationReport] = []
                deadline = trio.current_time() + 0.5
                await compare_and_report(job, rebuilt, following, state, deadline, reports.append)
                assert all(r.draw == FOLLOW_DRAW and r.step == step for r in reports)
                found.append([bool(f.matches) for r in reports for f in r.findings])
            nursery.cancel_scope.cancel()

    trio.run(main)
    return found, following


def test_an_honest_trainer_is_rebuilt_bit_for_bit_every_round() -> None:
    found, following = followed_rounds(None, steps=4)
    assert found == [[True]] * 4
    assert TRAINER in following.shadows
    assert not following.unconfirmed


def test_a_one_percent_bias_is_found_from_its_first_lie() -> None:
    found, _ = followed_rounds(Attack.Bias, steps=3)
    assert found == [[True], [False], [False]]


def test_a_trainer_that_announced_nothing_is_no_longer_followed() -> None:
    # round 2's result never announced: the trainer may or may not have moved its state
    found, following = followed_rounds(None, steps=3, silent=2)
    assert found == [[True], [], []]
    assert TRAINER not in following.shadows


def test_a_centralized_client_hears_the_runs_thread_count_beside_its_state() -> None:
    # upstream's postcard state has no room for it: the server sends it in RunExtras
    from psyche.centralized.client import CentralizedBackend
    from psyche.centralized.protocol import RunExtras, ServerToClientMessage
    from psyche.coordinator import Coordinator
    from psyche.coordinator.testing import integration_test_coordinator
    from psyche.core.identity import SecretKey
    from psyche.core.serde import from_bytes

    state = integration_test_coordinator(4, 8, 0)
    state.config.verification_percent = 25
    for extras_first in (True, False):
        backend = CentralizedBackend("127.0.0.1:1", SecretKey.generate(), "test-run")
        extras = RunExtras(backup_data_locations=[], exact_verification_threads=3)
        heard = from_bytes(state.to_bytes(), Coordinator)  # what the wire carries
        assert heard.config.exact_verification_threads == 0
        messages = [
            ServerToClientMessage.RunExtras(extras),
            ServerToClientMessage.Coordinator(heard),
        ]
        for message in messages if extras_first else reversed(messages):
            backend._handle(message)
        assert backend._latest is not None
        assert backend._latest.config.exact_verification_threads == 3


def test_shadows_start_at_the_epochs_first_round_only_and_plan_the_followed_batches() -> None:
    from psyche.coordinator.backend import OpportunisticData
    from psyche.coordinator.following import followers_for_state
    from psyche.coordinator.server_core import ServerCore
    from psyche.coordinator.testing import keyed_identity, quick_coordinator, warmup_witness_for

    now = 1_000_000
    coordinator = quick_coordinator(init_min_clients=4, global_batch_size=8, epoch_time=60)
    coordinator.config.verification_percent = 25
    coordinator.config.exact_verification_threads = 1
    core = ServerCore.start(coordinator, now=now)
    for i in range(4):
        core.on_join(keyed_identity(i), core.run_id)
    core.on_tick(now + 2, 1)
    for index, client in enumerate(core.coordinator.epoch_state.clients):
        core.on_witness(
            client.id, OpportunisticData.WarmupStep(warmup_witness_for(index)), now + 2, 7
        )
    core.on_tick(now + 3, 9)  # the round's duties recorded
    state = core.coordinator
    round_ = state.current_round()
    assert round_ is not None
    assert round_.height == 0
    assigned = dict(core.verification[state.progress.step].duties.assigned)
    me = followers_for_state(state)[next(iter(assigned.values()))][0]  # follows a trainer
    trainer = make_trainer()
    following = Following()
    following.start_epoch(state, me, trainer)
    mine = {t for t, followers in followers_for_state(state).items() if me in followers}
    assert set(following.shadows) == mine
    assert len(mine) == 3  # four members: each follows the three others
    job = following.plan(state, me)
    expected = {b for b, t in assigned.items() if t in mine}
    assert expected  # this seed: a trainer it follows trains in the round
    planned = {d.batch_id for d in job.duties} if job is not None else set()
    assert planned == expected
    # a client first here after the epoch's first round cannot know the trainers' states
    later = Following()
    round_.height = 1
    later.start_epoch(state, me, trainer)
    assert later.shadows == {}
    assert later.plan(state, me) is None


def _exact_run() -> Any:
    from psyche.coordinator.testing import quick_coordinator

    coordinator = quick_coordinator(init_min_clients=4, global_batch_size=8, epoch_time=60)
    coordinator.config.verification_percent = 25
    coordinator.config.exact_verification_threads = 2
    return coordinator


def test_a_client_outside_the_exact_class_refuses_the_run_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member its CPU followers cannot rebuild bit for bit (on CUDA, several ranks, casting to
    bf16) would be convicted though honest: it refuses the run before loading anything, naming
    the run's setting. Before, it joined, trained on CUDA, and its followers' words convicted
    it."""
    import torch

    from psyche.client.setup import init
    from psyche.core.identity import SecretKey
    from psyche.core.node_identity import NodeIdentity

    state = _exact_run()
    problem = exact_class_problem(state, "cuda")
    assert problem is not None
    assert "\n" not in problem
    assert "config.exact_verification_threads = 2" in problem
    assert "cuda" in problem
    assert "--param-dtype bf16" in str(exact_class_problem(state, "cpu", ["--param-dtype bf16"]))
    assert exact_class_problem(state, "cpu") is None
    state.config.exact_verification_threads = 0  # a run that does not verify exactly: anyone
    assert exact_class_problem(state, "cuda") is None
    state.config.exact_verification_threads = 2

    monkeypatch.setattr(init, "check_device", lambda device: torch.device("cuda"))
    key = SecretKey.from_bytes((7).to_bytes(32, "big"))

    async def fetch(*_: Any) -> Any:
        raise AssertionError("nothing is fetched by a client that refuses the run")

    config = init.RunInitConfig(NodeIdentity.from_single_key(key.public_key), key, state.run_id)
    with pytest.raises(init.InitRunError) as refused:
        trio.run(init.init_run, config, None, state, fetch)
    assert str(refused.value) == problem
    # on the CPU with two ranks (each its own thread count, split reductions): refused too
    from dataclasses import replace
    from types import SimpleNamespace

    from psyche.client.setup.ranks import RankLayout

    monkeypatch.setattr(init, "check_device", lambda device: torch.device("cpu"))
    workers = SimpleNamespace(layout=RankLayout(dp=2, device="cpu"))
    with pytest.raises(init.InitRunError, match=r"2 ranks \(--dp 2 --tp 1\)"):
        trio.run(init.init_run, replace(config, workers=workers), None, state, fetch)


def test_a_trainer_off_the_cpu_stops_instead_of_being_followed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same rule in the round (`check_exact_class`): a run's setting heard after the init
    still keeps a member off the CPU out (here its parameters on the meta device)."""
    import torch

    state = _exact_run()
    trainer = make_trainer()
    check_exact_class(state, trainer)  # on the CPU: fine
    off_cpu = [("w", torch.nn.Parameter(torch.empty(1, device="meta")))]
    monkeypatch.setattr(trainer.model, "variables", lambda: off_cpu)
    with pytest.raises(OutsideExactClass, match="exact_verification_threads = 2"):
        check_exact_class(state, trainer)
