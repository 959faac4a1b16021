"""A witness's judgement of a round's held checks (`RoundScreen.judge`: in its very first round one
model-sized sum of the round's results) is made in a worker thread before the witness is sent
(`screening.judge_round`), not on the event loop: the loop keeps running meanwhile, the votes
cast are those of the judgement made inline on the same checks, and whatever the judgement
raises, the round is left free for another.

The real path of a downloaded payload (`payloads.check_payload` with the real checks,
`screening.screen_result`) on real int8 DiLoCo results, a blind first-round witness of five
members, one hostile (as tests/client/test_young_witness.py).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import trio

from psyche.client.round import payloads, screening, witness
from psyche.client.round.broadcast import Finished
from psyche.client.round.state import RoundState
from psyche.client.round.steps import ActiveStep, MachineSettings, StepStateMachine
from psyche.client.round.train import TrainingStep
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.testing import Simulation, simulated_identity
from psyche.core.batch_id import BatchId
from psyche.core.identity import SecretKey
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.node_identity import NodeIdentity
from psyche.modeling.screening import RoundScreen, Verdict
from psyche.modeling.serialized_distro import TransmittableDistroResult

from ..modeling.tiny_trainer import make_trainer
from ..polling import poll_until
from .machine_bus import Bus, BusIO, Node
from .result_delivery import deliver
from .round_sim import next_round, plan_for, training_sim

CLIENTS = 5


@dataclass
class Checked:
    """A blind witness's view of round R after every result was checked, and its state of R+1."""

    view: RoundState
    later: RoundState
    hostile_batch: BatchId
    sim: Simulation
    bystander: RoundState
    """Round R+1 as a member that is not its witness sees it."""


def checked_round(held_back: int = 0) -> tuple[Checked, list[tuple[BatchId, Callable[[], None]]]]:
    """Every peer's result of round R checked by the round's one witness, which had no update
    of its own (its votes held); `held_back` results are left out and returned, to deliver
    later."""
    from psyche.modeling.hostile import DilocoFormat
    from psyche.modeling.screening import DILOCO_SCREENING, ResultReader, WitnessScreen

    from ..modeling.screening_rounds import honest_results

    diloco, sent = honest_results("int8", members=CLIENTS)
    fmt = DilocoFormat(diloco.layouts())
    sim = training_sim(clients=CLIENTS, batch=CLIENTS, witness_nodes=1)
    next_round(sim)
    ids = [simulated_identity(i) for i in range(CLIENTS)]
    views = {i: plan_for(sim.coordinator, ids[i]).state for i in range(CLIENTS)}
    next_round(sim)
    later = {i: plan_for(sim.coordinator, ids[i]).state for i in range(CLIENTS)}
    me = next(i for i, v in later.items() if v.committee_info.witness_proof.witness)
    view = views[me]
    view.screen = WitnessScreen(ResultReader.of(diloco), DILOCO_SCREENING).open_round()
    view.reference_ready.set()
    hostile = ids[(me + 1) % CLIENTS]
    order = sorted(view.data_assignments.items(), key=lambda item: item[1] != hostile)
    mine = next(batch for batch, sender in order if sender == ids[me])
    own = TransmittableDistroResult(view.step, 30, mine, [])
    payloads.record_verified_payload(view, ids[me], mine, own.compute_hash())
    bound = {b: [fmt.at_bound(r, i) for i, r in enumerate(sent[0])] for b, _ in order[:1]}
    decoded = {b: bound.get(b, sent[n]) for n, (b, _) in enumerate(order)}
    deliveries: list[tuple[BatchId, Callable[[], None]]] = [
        (batch, functools.partial(
            deliver, view, sim, ids[me], batch, sender, 10 + n, screening.screen_result, True,
            lambda p: decoded[p.batch_id],
        ))
        for n, (batch, sender) in enumerate(order)
        if batch != mine
    ]  # fmt: skip
    for _, send in deliveries[: len(deliveries) - held_back]:
        send()
    hostile_batch = order[0][0]
    bystander = later[(me + 2) % CLIENTS]
    checked = Checked(view, later[me], hostile_batch, sim, bystander)
    return checked, deliveries[len(deliveries) - held_back :]


def voted(view: RoundState, batch_commitments: dict[BatchId, bytes]) -> set[BatchId]:
    assert view.blooms is not None
    _, broadcast = view.blooms
    return {b for b, c in batch_commitments.items() if broadcast.contains(c)}


def commitments(view: RoundState) -> dict[BatchId, bytes]:
    return {b: entries[0].commitment.data_hash for b, entries in view.results.items()}


class Gate:
    """`RoundScreen.judge` that records the thread it ran in and, once started, waits for a task
    on the event loop to run (`probe`, woken by the start): made on the loop itself, the judge
    blocks the loop, the probe cannot run, and the judge gives up after `wait_s` (a bound so a
    regression fails instead of hanging, not a timing threshold)."""

    def __init__(self, screen: RoundScreen, wait_s: float) -> None:
        self.judge = screen.judge
        self.started = threading.Event()
        self.loop_ran = threading.Event()
        self.threads: list[threading.Thread] = []
        self.saw_loop: list[bool] = []
        self.wait_s = wait_s

    def __call__(self) -> list[Verdict]:
        self.threads.append(threading.current_thread())
        self.started.set()
        self.saw_loop.append(self.loop_ran.wait(self.wait_s))
        return self.judge()

    async def probe(self) -> None:
        await trio.to_thread.run_sync(self.started.wait, self.wait_s)
        self.loop_ran.set()  # the loop ran this task while the judge was under way


def test_the_round_is_judged_in_a_worker_thread_while_the_loop_runs_and_votes_as_inline() -> None:
    checked, _ = checked_round()
    twin, _ = checked_round()  # the same inputs, judged inline (`settle_blind_votes` alone)
    view = checked.view
    assert view.screen is not None
    assert payloads.judgement_due(view)
    gate = Gate(view.screen, wait_s=5.0)
    view.screen.judge = gate  # type: ignore[method-assign]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(screening.judge_round, view)
            nursery.start_soon(gate.probe)

    trio.run(main)
    assert gate.saw_loop == [True]  # the loop went on while the round was judged
    assert gate.threads[0] is not threading.main_thread()
    assert not payloads.judgement_due(view)
    sent = witness.witness_to_send(view, checked.later)
    assert sent is not None
    assert len(gate.threads) == 1  # the witness took the judgement made off the loop
    sent_twin = witness.witness_to_send(twin.view, twin.later)
    assert sent_twin is not None
    assert view.judgement is not None
    # the same verdicts, in the same order, as judged inline on the same checks
    assert twin.view.screen is not None
    inline = twin.view.screen.judge()
    assert [(v.index, v.problem, v.measure.agreement, v.measure.norm) for v in view.judgement] == [
        (v.index, v.problem, v.measure.agreement, v.measure.norm) for v in inline
    ]
    votes = voted(view, commitments(view))
    assert votes == voted(twin.view, commitments(twin.view))
    assert checked.hostile_batch not in votes
    assert len(votes) == CLIENTS - 2  # every honest peer's (its own was only recorded here)
    made = commitments(view)
    assert all(sent.broadcast_bloom.contains(made[b]) for b in votes)
    assert not sent.broadcast_bloom.contains(made[checked.hostile_batch])


def test_a_check_that_came_after_the_judgement_is_judged_again_before_the_vote() -> None:
    """A held check that came in after the judgement made off the loop: judged again before
    the vote, and the round folds what one judgement of every check would."""
    checked, rest = checked_round(held_back=1)
    view = checked.view
    trio.run(screening.judge_round, view)
    first = view.judgement
    assert first is not None
    assert not payloads.judgement_due(view)
    for _, send in rest:
        send()
    assert payloads.judgement_due(view)  # the judgement no longer covers every held check
    trio.run(screening.judge_round, view)
    assert view.judgement is not None
    assert len(view.judgement) == len(first) + 1
    assert witness.witness_to_send(view, checked.later) is not None
    assert checked.hostile_batch not in voted(view, commitments(view))
    # the round took the judgement its votes follow (`RoundScreen.commit`): it folds what a
    # witness that judged once, every check in, folds: the honest results, not the hostile one
    twin, _ = checked_round()
    assert witness.witness_to_send(twin.view, twin.later) is not None
    assert view.screen is not None
    assert twin.view.screen is not None
    assert view.screen.accepted_norms == twin.view.screen.accepted_norms
    assert len(view.screen.accepted) == len(twin.view.screen.accepted) == CLIENTS - 2


def test_an_opportunistic_witness_waits_for_the_judgement() -> None:
    checked, _ = checked_round()
    view, later = checked.view, checked.later
    later.sent_finished = True  # and every client has finished (none is listed unfinished)
    assert witness.previous_round_settled(view)
    assert payloads.judgement_due(view)

    def act() -> witness.OpportunisticAction:
        return witness.opportunistic_training_action(
            later, view, training_finished=True, clients=[], judged=not payloads.judgement_due(view)
        )

    assert act() is None
    assert not view.sent_witness
    trio.run(screening.judge_round, view)
    action = act()
    assert isinstance(action, witness.SendWitness)
    assert view.sent_witness


def test_a_judgement_that_raises_leaves_the_round_free() -> None:
    checked, _ = checked_round()
    view = checked.view
    assert view.screen is not None
    real = view.screen.judge

    def broken() -> list[Verdict]:
        raise RuntimeError("judge failed")

    view.screen.judge = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="judge failed"):
        trio.run(screening.judge_round, view)
    assert not view.judging.locked()
    assert view.judgement is None
    assert payloads.judgement_due(view)
    view.screen.judge = real  # type: ignore[method-assign]
    trio.run(screening.judge_round, view)
    assert not payloads.judgement_due(view)


class SentWitnesses(BusIO):
    """The machine's IO, keeping the witnesses it sends."""

    sent: list[OpportunisticData]

    def send_witness(self, data: OpportunisticData) -> None:
        self.sent.append(data)


def witness_machine(
    checked: Checked, nursery: trio.Nursery
) -> tuple[StepStateMachine, SentWitnesses]:
    """A real `StepStateMachine` of a member of `checked`'s run, its previous round the checked
    one, and its IO keeping the witnesses it sends."""
    key = SecretKey.from_bytes(bytes(31) + bytes([7]))
    identity = NodeIdentity.from_single_key(key.public_key)
    io = SentWitnesses(Bus(checked.sim), Node(key, identity))
    io.sent = []
    machine = StepStateMachine(
        MachineSettings(identity=identity), make_trainer(), None,
        checked.sim.coordinator.copy(), io, nursery,
    )  # fmt: skip
    machine.previous = checked.view
    return machine, io


def assert_votes_honest(checked: Checked) -> None:
    """The checked round's votes: every honest peer's result (its own was only recorded), not
    the hostile one."""
    votes = voted(checked.view, commitments(checked.view))
    assert checked.hostile_batch not in votes
    assert len(votes) == CLIENTS - 2


@pytest.mark.parametrize("is_witness", [True, False], ids=["witness", "not-a-witness"])
def test_the_machine_judges_off_the_loop_only_the_round_it_witnesses(is_witness: bool) -> None:
    """The real `StepStateMachine` entering the witness phase (`_start_witness`): a witness of
    the round judges its held checks in a worker thread, once, and sends the witness voted by
    that judgement; a member that is no witness of it judges nothing (it used to judge only
    inside `witness_to_send`, which it never reached: no cost added to it)."""
    checked, _ = checked_round()
    assert checked.view.screen is not None
    gate = Gate(checked.view.screen, wait_s=30.0)
    checked.view.screen.judge = gate  # type: ignore[method-assign]

    async def main() -> list[OpportunisticData]:
        async with trio.open_nursery() as nursery:
            machine, io = witness_machine(checked, nursery)
            machine.current = checked.later if is_witness else checked.bystander
            nursery.start_soon(gate.probe)
            await machine._start_witness(checked.sim.coordinator)
            if not is_witness:
                gate.started.set()  # the probe waits no longer
            nursery.cancel_scope.cancel()
        return io.sent

    sent = trio.run(main)
    if not is_witness:
        assert gate.threads == []
        assert sent == []
        return
    assert gate.saw_loop == [True]
    assert gate.threads[0] is not threading.main_thread()
    assert len(sent) == 1
    assert_votes_honest(checked)


def test_the_machine_sends_its_opportunistic_witness_once_its_judgement_is_done() -> None:
    """The real `StepStateMachine` during training, every payload of the previous round in
    and every client finished (`try_send_opportunistic_witness`, upstream's 500 ms check): the
    witness waits for the held votes' judgement (`_judged_for_witness`), which is started in a
    worker thread, once; when it is done the check runs again (`judge_then_check`) and sends
    the witness voted by that judgement, with no further periodic check."""
    checked, _ = checked_round()
    view, later = checked.view, checked.later
    later.sent_finished = True  # this client said it finished
    assert view.screen is not None
    gate = Gate(view.screen, wait_s=30.0)
    view.screen.judge = gate  # type: ignore[method-assign]

    async def main() -> tuple[list[OpportunisticData], list[OpportunisticData]]:
        async with trio.open_nursery() as nursery:
            machine, io = witness_machine(checked, nursery)
            machine.current = later
            for client in machine.coordinator_state.epoch_state.clients:
                later.clients_finished.setdefault(client.id, Finished(MerkleRoot(), False))
            machine.active = ActiveStep.Training
            machine.training = TrainingStep()
            machine.training.finished = True
            nursery.start_soon(gate.probe)
            machine.try_send_opportunistic_witness()
            machine.try_send_opportunistic_witness()  # before it is done: no second judgement
            before = list(io.sent)
            with trio.fail_after(60):  # a bound so a regression fails instead of hanging
                await poll_until(lambda: io.sent)
            nursery.cancel_scope.cancel()
        return before, io.sent

    before, sent = trio.run(main)
    assert before == []  # the witness waited for the judgement
    assert len(gate.threads) == 1
    assert gate.threads[0] is not threading.main_thread()
    assert gate.saw_loop == [True]
    assert len(sent) == 1
    assert view.sent_witness
    assert_votes_honest(checked)
