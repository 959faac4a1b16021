"""A deterministic multi-epoch simulation whose full transcript hash is checked in.

Every state the coordinator passes through is postcard-encoded and fed, in order, to one sha256
(`Simulation.transcript`). Any change in behaviour (a transition, a timeout, a data index, a
checkpoint flip, an error path) or in the encoding changes the digest.

If the digest changes: find out why first. A behaviour or encoding change must be deliberate and
match upstream; then regenerate with

    .venv/bin/python tests/coordinator/test_transcript.py

and replace TRANSCRIPT_DIGEST (say in the commit message which behaviour changed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from psyche.coordinator import (
    Checkpoint,
    Coordinator,
    HubRepo,
    RunState,
)
from psyche.coordinator.testing import (
    Simulation,
    integration_test_coordinator,
    simulated_identity,
)

TRANSCRIPT_SEED = 20240521
TRANSCRIPT_DIGEST = "26e9c64499b2281b359d5e153d082a9b676c3d2bdfd9577d46227869043f8788"


@dataclass
class Outcome:
    digest: str
    coordinator: Coordinator
    states: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    seconds: int = 0


def simulate() -> Outcome:
    """Eight clients over several epochs: joins, disconnects and reconnects, silent trainers,
    health checks, a pause, batch-size warmup and checkpoint flips; all choices come from
    `random.Random(TRANSCRIPT_SEED).getrandbits` (stable across Python versions)."""
    rng = random.Random(TRANSCRIPT_SEED)
    coordinator = integration_test_coordinator(4, 8, 2, run_id="transcript")
    config = coordinator.config
    config.total_steps = 80
    config.global_batch_size_end = 24
    config.global_batch_size_warmup_tokens = 300 * 2048
    config.epoch_time = 40
    coordinator.model.value.checkpoint = Checkpoint.Hub(HubRepo("org/model", "main"))
    coordinator.progress.step = 1
    sim = Simulation(coordinator, now=1_700_000_000, rng=rng)

    members = [simulated_identity(i) for i in range(8)]
    for member in members[:6]:
        sim.join(member)
    silent: set[bytes] = set()
    warmed_up = -1
    witnessed: set[tuple[int, int]] = set()
    train_delay = 2
    outcome = Outcome("", coordinator)
    for second in range(3000):
        state = coordinator.run_state
        outcome.states[state.name] = outcome.states.get(state.name, 0) + 1
        if state is RunState.Finished:
            break
        roll = rng.getrandbits(8)
        member = members[rng.getrandbits(16) % len(members)]
        if roll < 2:
            silent.add(member.signer)
            sim.disconnect(member)
        elif roll < 8:
            silent.discard(member.signer)
            sim.join(member)  # back (kicked again while the epoch's exited list names it)
        elif roll < 9:
            silent.add(member.signer)  # connected, but neither trains nor witnesses
        elif roll < 11:
            members.append(simulated_identity(len(members)))  # a newcomer
            sim.join(members[-1])
        if second == 250:
            coordinator.pause(sim.now)
        if state is RunState.Paused and roll < 40:
            coordinator.resume(sim.now)

        started = coordinator.run_state_start_unix_timestamp
        clients = coordinator.epoch_state.clients
        if state is RunState.Warmup and warmed_up != started and sim.now - started >= 1:
            awake = [i for i, c in enumerate(clients) if c.id.signer not in silent]
            sim.send_warmup_witnesses(awake)
            warmed_up = started
        round_ = coordinator.current_round()
        assert round_ is not None
        key = (coordinator.progress.epoch, round_.height)
        if (
            state is RunState.RoundTrain
            and key not in witnessed
            and sim.now - started >= train_delay
        ):
            quiet = [c.id for c in clients if c.id.signer in silent]
            awake = [c.id for c in clients if c.id.signer not in silent]
            if round_.height >= 2 and quiet and awake:
                # a witness reports last round's silent trainers
                result = sim.send_health_checks(awake[0])
                outcome.dropped += result if isinstance(result, int) else 0
            sim.send_round_witnesses(missing=quiet, silent=quiet)
            witnessed.add(key)
            train_delay = 1 + rng.getrandbits(2)
        sim.tick()
        outcome.seconds = second
    outcome.digest = sim.transcript.hexdigest()
    return outcome


def test_transcript_is_unchanged() -> None:
    outcome = simulate()
    final = outcome.coordinator
    # the simulation covers what it claims to
    assert final.run_state is RunState.Finished
    assert final.progress.step == 80
    assert final.progress.epoch >= 3
    assert outcome.dropped >= 1
    assert outcome.states.get("Paused", 0) > 0
    assert outcome.states.get("Cooldown", 0) > 0
    assert isinstance(final.model.value.checkpoint, Checkpoint.P2P)
    assert outcome.digest == TRANSCRIPT_DIGEST, (
        f"coordinator behaviour changed: transcript {outcome.digest} (see the module docstring)"
    )


def test_transcript_is_reproducible() -> None:
    assert simulate().digest == simulate().digest


if __name__ == "__main__":
    result = simulate()
    print(result.digest)
    print(
        f"{result.seconds} s, epochs {result.coordinator.progress.epoch}, "
        f"step {result.coordinator.progress.step}, dropped {result.dropped}, {result.states}"
    )
