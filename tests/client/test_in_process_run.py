"""Whole clients in one process: `InProcessServer` (the server's rules, the real clock), real
libp2p networks on 127.0.0.1, real training of a tiny Llama built from a config directory with
no weights. Two clients train an epoch and end it with identical weights; a third joins the
next epoch, takes the model from them over P2P model sharing and starts hash-identical."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio

from psyche.client.client import Client
from psyche.client.setup.model_loading import preload_modeling
from psyche.client.testing import InProcessServer
from psyche.coordinator import (
    Coordinator,
    RunState,
)

from ..polling import poll_until
from ..timing import scaled, scaled_timer
from .in_process import (
    RUN_ID,
    coordinator,
    fields,
    identities,
    run_beside_server,
    run_client,
    run_client_until_finished,
    three_client_run,
    wait_until,
    write_run,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_two_clients_train_and_a_third_joins_from_peers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")
    preload_modeling()  # as `psyche-client train` does before joining
    model_dir, data_dir = write_run(tmp_path)
    state = coordinator(model_dir, data_dir)
    # a short first epoch: its time is up after its warmup and a round or so, then the two
    # rounds the pipeline needs end it (the third applies the first's results); at 5 s it
    # trained two rounds more, which nothing here looks at
    state.config.epoch_time = scaled_timer(3)
    server = InProcessServer(state)

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            nursery.start_soon(run_client, server, 1)
            nursery.start_soon(run_client, server, 2)
            with trio.fail_after(scaled(90)):
                # the joiner waits (pending) while the first epoch trains
                await poll_until(lambda: server.coordinator.run_state is RunState.RoundTrain, 0.1)
                nursery.start_soon(run_client, server, 3)
                # until the second epoch has trained a round with three clients
                await poll_until(
                    lambda: (
                        server.coordinator.progress.epoch == 1
                        and server.coordinator.run_state is RunState.RoundTrain
                        and server.coordinator.current_round().height >= 1
                    ),
                    0.1,
                )
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    records = caplog.records
    cooldown = [f for f in fields(records, "cooldown_model") if f["epoch"] == 0]
    assert len(cooldown) == 2
    assert cooldown[0]["model_hash"] == cooldown[1]["model_hash"]
    loaded = fields(records, "loaded_model")
    assert len(loaded) == 3
    initial = {f["model_hash"] for f in loaded if f["epoch"] == 0}
    assert len(initial) == 1  # seed 1337: both first clients built the same weights
    joiner = [f for f in loaded if f["epoch"] == 1]
    assert len(joiner) == 1
    assert joiner[0]["source"] == "peers (P2P)"
    assert joiner[0]["model_hash"] == cooldown[0]["model_hash"]
    # the joiner trained in epoch 1, and everyone applied the same results
    second_epoch = [f for f in fields(records, "round_start") if f["epoch"] == 1]
    assert {f["clients"] for f in second_epoch} == {3}
    applied: dict[int, set[tuple[str, ...]]] = {}
    for f in fields(records, "applied_results"):
        applied.setdefault(f["step"], set()).add(tuple(str(b) for b in f["batches"]))
    assert applied
    assert all(len(v) == 1 for v in applied.values())
    losses = [f["loss"] for f in fields(records, "client_loss") if f["trained"]]
    assert losses
    assert all(np.isfinite(losses))


# ---- the end of a run ------------------------------------------------------------------------


def test_clients_end_by_themselves_at_finished_and_keep_the_final_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoModelForCausalLM

    caplog.set_level(logging.INFO, logger="psyche")
    preload_modeling()
    model_dir, data_dir = write_run(tmp_path)
    state = coordinator(model_dir, data_dir)
    state.config.total_steps = 4
    server = InProcessServer(state)
    checkpoints = tmp_path / "checkpoints"
    clients: dict[int, Client] = {}

    async def one(number: int, checkpoint_dir: Path | None) -> None:
        clients[number] = await run_client_until_finished(server, number, checkpoint_dir)

    run_beside_server(server, 120, partial(one, 1, checkpoints), partial(one, 2, None))
    assert server.coordinator.run_state is RunState.Finished
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    summaries = {f["client_id"]: f for f in fields(caplog.records, "run_finished")}
    assert len(summaries) == 2
    final_step = server.coordinator.progress.step - 1
    first = summaries[str(clients[1].identity)]
    assert first["checkpoint"] == str(checkpoints / f"{RUN_ID}-step{final_step}")
    assert first["trained"]
    assert first["final_loss"] is not None
    assert summaries[str(clients[2].identity)]["checkpoint"] is None
    # what the summary names is a Hugging Face checkpoint of the model the run ended with
    loaded = AutoModelForCausalLM.from_pretrained(first["checkpoint"], local_files_only=True)
    trainer = clients[1].machine.trainer  # type: ignore[union-attr]
    live = {name: p.detach() for name, p in trainer.model.variables()}
    saved = dict(loaded.named_parameters())
    assert live.keys() <= saved.keys()
    for name, tensor in live.items():
        assert torch.equal(saved[name].to(torch.bfloat16), tensor.to(torch.bfloat16)), name
    # every trained step printed one progress line, "no batch" rounds said so
    progress = [f for f in fields(caplog.records, "client_loss")]
    assert progress
    assert all(f["total_steps"] == 4 for f in progress)
    texts = [r.psyche_text for r in caplog.records if r.getMessage() == "client_loss"]
    assert all(t.startswith("step ") and "/4 (epoch " in t for t in texts), texts
    assert all(("no batch this round" in t) == (not f["trained"]) for t, f in zip(texts, progress))


def test_a_client_joining_a_finished_run_ends_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="psyche")
    model_dir, data_dir = write_run(tmp_path)
    state = coordinator(model_dir, data_dir)
    state.run_state = RunState.Finished
    server = InProcessServer(state)

    run_beside_server(
        server, 60, partial(run_client_until_finished, server, 1, tmp_path / "checkpoints")
    )
    (summary,) = fields(caplog.records, "run_finished")
    assert not summary["trained"]
    assert summary["checkpoint"] is None
    (record,) = [r for r in caplog.records if r.getMessage() == "run_finished"]
    assert record.psyche_text.endswith("this client joined after it ended: nothing to do")
    assert not fields(caplog.records, "loaded_model")  # nothing was loaded
    assert not (tmp_path / "checkpoints").exists()


# ---- a client the run went on without --------------------------------------------------------


class LateClient(Client):
    """A client whose results stop reaching the others while `late` is set (as a machine too
    slow for `max_round_train_time` would): the round's witness health-checks it out. It
    notes the epoch of each of its own `left_run`s (`rejoined`): in one interpreter the logs
    of three clients cannot tell whose a `left_run` is, and on a starved machine another
    client may be dropped too."""

    late = False
    rejoined: tuple[int, ...] = ()

    async def _publish_result(self, result) -> None:  # type: ignore[no-untyped-def]
        if not self.late:
            await super()._publish_result(result)

    async def _rejoin(self, state: Coordinator) -> None:
        self.late = False  # the machine is fast again
        self.rejoined = (*self.rejoined, state.progress.epoch)
        await super()._rejoin(state)


def in_training(server: InProcessServer, after_epoch: int) -> bool:
    """The run trains a round of an epoch after `after_epoch`."""
    return (
        server.coordinator.progress.epoch > after_epoch
        and server.coordinator.run_state is RunState.RoundTrain
    )


def epoch_ended(server: InProcessServer, caplog: pytest.LogCaptureFixture, epoch: int) -> bool:
    """All three clients logged their cooldown model of `epoch`, or (one was dropped on the
    way) the run trains a later epoch."""
    ended = [f for f in fields(caplog.records, "cooldown_model") if f["epoch"] == epoch]
    return len(ended) == 3 or in_training(server, after_epoch=epoch)


async def drop_a_late_client(
    nursery: trio.Nursery, server: InProcessServer, late: list[Client]
) -> int:
    """Start `server` and clients 1, 2 and 3 (a `LateClient`, appended to `late`); once the run
    trains its second round, make 3 late; return the epoch in which it then leaves the run."""
    nursery.start_soon(server.run)
    nursery.start_soon(run_client, server, 1)
    nursery.start_soon(run_client, server, 2)
    nursery.start_soon(run_client, server, 3, LateClient, late)
    await wait_until(
        lambda: (
            server.coordinator.run_state is RunState.RoundTrain
            and server.coordinator.current_round().height >= 1
        )
    )
    client = late[0]
    assert isinstance(client, LateClient)
    client.late = True
    await wait_until(lambda: bool(client.rejoined))
    return client.rejoined[0]


def test_a_dropped_client_joins_again_and_reloads_the_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A health check drops a client that stays connected: it says so, sends Join again, and at
    the next epoch loads the run's model from its peers (its own fell behind while the others
    trained on), trains, and ends that epoch with the others' weights. Before, it went back to
    warmup without a Join: left out for good, and a run needing it waited forever.

    What is checked is the dropped client's own record (`LateClient.rejoined`, its events by
    client id): on a starved machine a witness may drop an honest client too, which this test
    is not about (and which the failure message then shows)."""
    caplog.set_level(logging.INFO, logger="psyche")
    # room for health checks (sent from an epoch's third round)
    server = three_client_run(tmp_path, epoch_time=10)
    late: list[Client] = []

    def events(name: str, epoch: int) -> list[dict[str, Any]]:
        return [f for f in fields(caplog.records, name) if f["epoch"] == epoch]

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(scaled(150)):
                gone = await drop_a_late_client(nursery, server, late)
                # the room for health checks is spent: the epoch it is back in needs its warmup
                # (the reload) and a round, as the run's usual epoch gives (not ten seconds more)
                server.coordinator.config.epoch_time = scaled_timer(5)
                # the epoch it is back in has ended: all three cooldown models are out, or (one
                # of the others dropped on the way) the run trains the epoch after
                await wait_until(lambda: epoch_ended(server, caplog, gone + 1))
            nursery.cancel_scope.cancel()

    me = str(identities(3)[0])
    trio.run(scenario)
    records = caplog.records
    others = {
        "health_check": fields(records, "health_check"),
        "payload_refused": fields(records, "payload_refused"),
    }
    assert isinstance(late[0], LateClient)
    gone = late[0].rejoined[0]
    # the health check named it, and it was dropped, not banned (--ban-epochs 0)
    assert any(me in f["unhealthy"] for f in others["health_check"]), others
    assert "Dropped 1 clients from health check" in caplog.text, others
    assert f"{me[:8]} did not deliver" not in caplog.text, others
    back = gone + 1
    # back in the next epoch with everyone, its model loaded from the peers: what the others
    # ended the previous epoch with
    reload = [f for f in events("loaded_model", back) if f["client_id"] == me]
    assert len(reload) == 1, (reload, others)
    assert reload[0]["source"] == "peers (P2P)", (reload, others)
    cooldown = events("cooldown_model", back - 1)
    shared = {f["model_hash"] for f in cooldown}
    assert reload[0]["model_hash"] in shared, (reload, cooldown, others)
    rounds = events("round_start", back)
    assert rounds, others
    assert rounds[0]["clients"] == 3, (rounds, others)
    trained = {f["client_id"] for f in events("client_loss", back) if f["trained"]}
    assert trained == {str(c) for c in identities(1, 2, 3)}, (trained, others)
    # it ended that epoch with the weights of every client that ended it beside it
    ended = events("cooldown_model", back)
    assert me in {f["client_id"] for f in ended}, (ended, others)
    assert len(ended) >= 2, (ended, others)
    assert len({f["model_hash"] for f in ended}) == 1, (ended, others)


class WitnessDroppingServer(InProcessServer):
    """Loses every witness while `drop_witnesses` is set: a round with no witness at all makes
    the coordinator withdraw every client and end the epoch (upstream's rule)."""

    drop_witnesses = False

    def witness(self, identity, data) -> None:  # type: ignore[no-untyped-def]
        if not self.drop_witnesses:
            super().witness(identity, data)


def test_a_run_that_goes_back_to_its_stored_checkpoint_restarts_from_the_trained_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 24, item 9. Client 3 is health-checked out of epoch 0 and joins again (its model
    fell behind: it needs the run's). Then a round of epoch 0 gets no witness, so the
    coordinator withdraws everyone and ends it; no client of epoch 0 is back as one of its
    clients, so epoch 1 names the run's stored checkpoint (Hub: the initial weights) again,
    while clients 1 and 2 still hold the trained model. Client 3 asks the epoch's peers first
    and takes the trained model from them: the run restarts from it, never from the initial
    weights, and the three end epoch 1 with identical models. Before, client 3 loaded the
    initial weights and trained on them beside the others (two models in one run)."""
    caplog.set_level(logging.INFO, logger="psyche")
    # epoch 0 ends when its witnesses are lost, not before
    server = three_client_run(tmp_path, epoch_time=60, server=WitnessDroppingServer)
    late: list[Client] = []

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(scaled(240)):
                assert await drop_a_late_client(nursery, server, late) == 0
                assert server.coordinator.progress.epoch == 0
                server.drop_witnesses = True
                await wait_until(lambda: server.coordinator.run_state is RunState.Cooldown)
                server.drop_witnesses = False
                # the run's usual epoch: the reload (in warmup) and rounds of three clients
                server.coordinator.config.epoch_time = scaled_timer(5)
                await wait_until(lambda: epoch_ended(server, caplog, 1))
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    records = caplog.records
    initial = {f["model_hash"] for f in fields(records, "loaded_model") if f["epoch"] == 0}
    assert len(initial) == 1  # the seeded initial weights, on all three
    trained = {f["model_hash"] for f in fields(records, "cooldown_model") if f["epoch"] == 0}
    assert len(trained) == 1
    assert trained != initial
    # epoch 1 names the stored checkpoint; client 3 took the trained model from its peers
    reload = [f for f in fields(records, "loaded_model") if f["epoch"] == 1]
    assert len(reload) == 1, reload
    assert reload[0]["client_id"] == str(late[0].identity), reload
    assert not reload[0]["checkpoint"].startswith("P2P"), reload  # the stored one (Hub)
    assert reload[0]["source"] == "peers (P2P)", reload
    assert reload[0]["model_hash"] in trained, reload
    assert not fields(records, "stored_checkpoint_loaded")
    # all three trained epoch 1 and ended it with one model
    rounds = [f for f in fields(records, "round_start") if f["epoch"] == 1]
    assert rounds
    assert {f["clients"] for f in rounds} == {3}
    ended = [f for f in fields(records, "cooldown_model") if f["epoch"] == 1]
    assert len(ended) == 3, ended
    assert len({f["model_hash"] for f in ended}) == 1, ended
