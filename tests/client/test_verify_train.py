"""A verifier that also trains (`CoordinatorConfig.verifiers_train`, issue 27's cost goal): it
trains and publishes its own batches first and recomputes its checks after them, in the round's
idle time (`run_round(verify_last=True)`), from the round's weights (`train_exact` leaves them the
round's; the step's weight decay waits for the checks): its recomputes are the bits a verifier
that trains nothing computes, and its weights end the step as every other client's."""

from __future__ import annotations

import torch
import trio

from psyche.client.round.fetch import DataFetcher
from psyche.client.round.train import OwnResult, TrainingStep, run_round
from psyche.client.round.verify import Recomputations, VerifyJob, recompute_duties
from psyche.coordinator.testing import simulated_identity
from psyche.coordinator.verification import VerificationDuty
from psyche.core import BatchId
from psyche.core.token_size import TokenSize
from psyche.data_provider.dummy import DummyDataProvider
from psyche.modeling.trainer import Trainer

from ..modeling.tiny_trainer import make_trainer
from .support import train_job

STEP = 1
OWN = [BatchId(0, 1), BatchId(2, 3)]
CHECKED = BatchId(4, 5)
DECOY = BatchId(6, 7)


def verify_job() -> VerifyJob:
    duty = VerificationDuty(CHECKED, simulated_identity(2), simulated_identity(1))
    return VerifyJob(STEP, (duty,), {CHECKED: DECOY}, False, None)


def a_round(
    trainer: Trainer,
    *,
    train: bool,
    verify_last: bool,
    end_first: bool = False,
    checks: bool = True,
) -> tuple[Recomputations, list[str]]:
    """One training step of a verifier; what it recomputed, and the order things happened."""
    order: list[str] = []
    recomputed = Recomputations()

    def publish(result: OwnResult) -> None:
        order.append(f"published {result.batch_id}")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            fetcher = DataFetcher(DummyDataProvider(TokenSize.FourBytes, 16, 256), nursery)
            handle = TrainingStep()

            async def verify() -> None:
                order.append("checks")
                if end_first:
                    handle.cancel.set()  # the round ended before the checks began
                await recompute_duties(handle, trainer, verify_job(), fetcher, recomputed)

            job = train_job(STEP, OWN if train else [], [])
            await run_round(
                handle,
                trainer,
                None,
                job,
                fetcher,
                publish,
                verify if checks else None,
                verify_last=verify_last,
            )
            finished = await handle.finish()
            assert sorted(finished.trained) == (OWN if train else [])

    trio.run(main)
    return recomputed, order


def weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in trainer.model.variables()]


def test_a_verifier_that_trains_checks_after_its_results_are_out_with_the_same_bits() -> None:
    # the rule before the option: a verifier trains nothing and checks right after the apply
    idle = make_trainer(weight_decay=0.1)
    alone, _ = a_round(idle, train=False, verify_last=False)
    # a training verifier: its own results go out first, then the checks, from the same weights
    busy = make_trainer(weight_decay=0.1)
    after, order = a_round(busy, train=True, verify_last=True)
    assert order[-1] == "checks"
    assert sorted(order[:-1]) == [f"published {b}" for b in OWN]
    assert set(after.domains) == set(alone.domains) == {CHECKED, DECOY}
    for batch in (CHECKED, DECOY):
        for mine, theirs in zip(after.domains[batch].parts, alone.domains[batch].parts):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    # and it ends the step with every client's weights (the decay once, after the checks)
    trainer = make_trainer(weight_decay=0.1)
    a_round(trainer, train=True, verify_last=False, checks=False)  # a trainer
    assert all(torch.equal(a, b) for a, b in zip(weights(busy), weights(trainer), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights(busy), weights(idle), strict=True))


def test_checks_the_round_leaves_no_time_for_are_not_made() -> None:
    trainer = make_trainer()
    recomputed, order = a_round(trainer, train=True, verify_last=True, end_first=True)
    assert order[-1] == "checks"
    assert recomputed.domains == {}  # nothing half-done is reported


def test_a_centralized_client_sets_the_option_on_every_state_it_hears() -> None:
    # upstream's postcard state has no room for it: the server sends it in RunExtras
    from psyche.centralized.client import CentralizedBackend
    from psyche.centralized.protocol import RunExtras, ServerToClientMessage
    from psyche.coordinator import Coordinator
    from psyche.coordinator.testing import integration_test_coordinator
    from psyche.core.identity import SecretKey
    from psyche.core.serde import from_bytes

    state = integration_test_coordinator(4, 8, 0)
    state.config.verification_percent = 25
    state.config.verifiers_train = True

    def heard() -> Coordinator:
        return from_bytes(state.to_bytes(), Coordinator)  # what the wire carries

    for extras_first in (True, False):
        backend = CentralizedBackend("127.0.0.1:1", SecretKey.generate(), "test-run")
        extras = ServerToClientMessage.RunExtras(
            RunExtras(backup_data_locations=[], verifiers_train=True)
        )
        before = heard()
        assert before.config.verifiers_train is False
        backend._handle(extras if extras_first else ServerToClientMessage.Coordinator(before))
        backend._handle(ServerToClientMessage.Coordinator(before) if extras_first else extras)
        assert backend._latest is not None
        assert backend._latest.config.verifiers_train
        backend._handle(ServerToClientMessage.Coordinator(heard()))
        assert backend._latest.config.verifiers_train
    # a server whose run leaves it off says so, and the client keeps upstream's rule
    backend = CentralizedBackend("127.0.0.1:1", SecretKey.generate(), "test-run")
    backend._handle(ServerToClientMessage.RunExtras(RunExtras(backup_data_locations=[])))
    backend._handle(ServerToClientMessage.Coordinator(heard()))
    assert backend._latest is not None
    assert not backend._latest.config.verifiers_train
