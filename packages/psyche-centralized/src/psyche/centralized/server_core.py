"""The server's rules, without sockets or clocks (upstream `centralized/server/src/app.rs`).

`ServerCore` owns the coordinator and the set of clients waiting to join, and applies upstream's
rules for every event: a Join with the run's id makes a client pending; witnesses, health checks
and checkpoints go to the coordinator; a disconnect removes the client from the pending set and,
with `withdraw_on_disconnect`, withdraws it from the run (not once the run is Finished, when
every client leaves); every tick first drops exited clients
from the pending set, then ticks the coordinator. Each handler returns whether the new state must
be broadcast (upstream's broadcast rules). The trio shell (`server.py`) supplies time, randomness
and I/O.

Coordinator errors are logged and the event ignored, as upstream. Where upstream would panic
(and crash the server), the coordinator raises `CoordinatorPanic` before changing anything; it
is logged as an error and the server carries on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from psyche.centralized.save_state import resume_snapshot
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.coordinator import (
    ClientState,
    Coordinator,
    HealthChecks,
    RunState,
    TickResult,
)
from psyche.coordinator.errors import CoordinatorError, CoordinatorErrorKind, CoordinatorPanic
from psyche.coordinator.model import Checkpoint
from psyche.core.node_identity import NodeIdentity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TickOutcome:
    """What a tick did: `epoch_end` is None, or the success flag of the epoch that ended."""

    epoch_end: bool | None = None


def prepare_for_start(coordinator: Coordinator, now: int) -> Coordinator:
    """The state a server starts from (upstream `reset_ephemeral`, adapted for resuming).

    A running epoch in the file is closed, exited clients are forgotten and the run waits for
    members (a finished run stays finished). A saved state (one with a state timestamp) counts
    its waiting time from now, so every returning client has `waiting_for_members_extra_time` to
    reconnect before the next epoch starts.
    """
    state = resume_snapshot(coordinator, coordinator.config.warmup_time)
    if state.run_state_start_unix_timestamp != 0:
        state.run_state_start_unix_timestamp = now
    return state


@dataclass
class ServerCore:
    coordinator: Coordinator
    original_warmup_time: int
    withdraw_on_disconnect: bool = True
    # Insertion-ordered set (upstream's HashSet order is arbitrary).
    pending_clients: dict[NodeIdentity, None] = field(default_factory=dict)
    # Exited clients the per-tick kick must leave in the pending set (see kick_unhealthy_clients).
    rejoinable: set[NodeIdentity] = field(default_factory=set)
    # The loss in the newest witness's metadata (for the run summary; the coordinator ignores it).
    last_reported_loss: float | None = None

    @classmethod
    def start(
        cls,
        coordinator: Coordinator,
        *,
        now: int,
        init_warmup_time: int | None = None,
        withdraw_on_disconnect: bool = True,
    ) -> ServerCore:
        state = prepare_for_start(coordinator, now)
        original = state.config.warmup_time
        if init_warmup_time is not None:
            state.config.warmup_time = init_warmup_time
        return cls(state, original, withdraw_on_disconnect)

    @property
    def run_id(self) -> str:
        return self.coordinator.run_id

    def client_index(self, identity: NodeIdentity) -> int | None:
        for index, client in enumerate(self.coordinator.epoch_state.clients):
            if client.id == identity:
                return index
        return None

    # -- events ---------------------------------------------------------------------------------

    def on_join(self, sender: NodeIdentity, run_id: str) -> bool:
        if run_id == self.coordinator.run_id:
            log.info("added pending client %s", sender)
            self.pending_clients[sender] = None
        else:
            log.info("%r tried to join unknown run %r", sender, run_id)
        return False

    def on_witness(
        self, sender: NodeIdentity, data: OpportunisticData, now: int, random_seed: int
    ) -> bool:
        before = self.coordinator.run_state
        try:
            match data:
                case OpportunisticData.WitnessStep((witness, metadata)):
                    self.coordinator.witness(sender, witness, now)
                    if math.isfinite(metadata.loss):
                        self.last_reported_loss = float(metadata.loss)
                case OpportunisticData.WarmupStep(witness):
                    self.coordinator.warmup_witness(sender, witness, now, random_seed)
        except CoordinatorError as e:
            log.warning("Error when processing witness from %s: %s", sender, e)
        except CoordinatorPanic as e:
            log.error("witness from %s would crash upstream's server; ignored: %s", sender, e)
        return self.coordinator.run_state is not before

    def on_health_check(self, sender: NodeIdentity, checks: HealthChecks) -> bool:
        # An honest sender names each unhealthy client once; a longer list can only be repeats,
        # which cost the coordinator work and change nothing (hardening, not upstream).
        limit = max(len(self.coordinator.epoch_state.clients), 1)
        if len(checks) > limit:
            log.warning(
                "health check from %s names %d clients, more than the %d in the run; ignored",
                sender,
                len(checks),
                limit,
            )
            return False
        try:
            dropped = self.coordinator.health_check(sender, checks)
        except CoordinatorError as e:
            log.warning("Error when processing health check from %s: %s", sender, e)
            return False
        except CoordinatorPanic as e:
            log.error("health check from %s would crash upstream's server; ignored: %s", sender, e)
            return False
        log.info("Dropped %d clients from health check", dropped)
        return dropped > 0

    def on_checkpoint(self, sender: NodeIdentity, checkpoint: Checkpoint) -> bool:
        index = self.client_index(sender)
        if index is None:
            log.warning("Got checkpoint but could not find %s in client list", sender)
        else:
            try:
                self.coordinator.checkpoint(sender, index, checkpoint)
            except CoordinatorError as e:
                log.warning("Error when processing checkpoint from %s: %s", sender, e)
        return True

    def on_disconnect(self, sender: NodeIdentity) -> None:
        self.pending_clients.pop(sender, None)
        if self.client_index(sender) is not None or any(
            c.id == sender for c in self.coordinator.epoch_state.exited_clients
        ):
            self.rejoinable.add(sender)
        if not self.withdraw_on_disconnect or self.coordinator.run_state is RunState.Finished:
            return  # a finished run's clients leave by design: nothing to withdraw them from
        index = self.client_index(sender)
        if index is not None:
            try:
                self.coordinator.withdraw(index)
                log.info("Withdrew %s", sender)
            except CoordinatorError as e:
                log.warning("Coordinator withdraw error: %s", e)

    def on_tick(self, now: int, random_seed: int) -> TickOutcome:
        self.kick_unhealthy_clients()
        try:
            result = self.coordinator.tick(list(self.pending_clients), now, random_seed)
            self._forgive_mass_withdrawal()
        except CoordinatorError as e:
            if e.kind is not CoordinatorErrorKind.Halted:
                log.warning("Coordinator tick error: %s", e)
            return TickOutcome()
        except CoordinatorPanic as e:
            log.error("tick would crash upstream's server; state unchanged: %s", e)
            return TickOutcome()
        match result:
            case TickResult.EpochEnd(success):
                if not success:
                    log.warning("Epoch abandoned")
                return TickOutcome(epoch_end=success)
        return TickOutcome()

    def kick_unhealthy_clients(self) -> None:
        """Exited clients leave the pending set: they must reconnect and Join again.

        Upstream kicks them on every tick until the next epoch clears `exited_clients`. Two
        cases it gets wrong are exempt here (`rejoinable`): a client that reconnected (a
        restarted process with the same key: its one Join was undone and it never trained
        again), and clients the coordinator withdrew all at once because a round had no witness
        (still connected and blameless, they were all kicked and the run never started again).
        A client dropped by a health check that stays connected is still kicked, as upstream.
        """
        epoch_state = self.coordinator.epoch_state
        # Forget the exemption once the client is a healthy member of an epoch again.
        leaving = {c.id for c in epoch_state.exited_clients} | {
            c.id for c in epoch_state.clients if c.state is not ClientState.Healthy
        }
        self.rejoinable &= leaving
        for client in epoch_state.exited_clients:
            if client.state is not ClientState.Healthy and client.id not in self.rejoinable:
                self.pending_clients.pop(client.id, None)

    def _forgive_mass_withdrawal(self) -> None:
        """A round without witnesses ends the epoch by withdrawing every client (upstream)."""
        coordinator = self.coordinator
        clients = coordinator.epoch_state.clients
        if (
            coordinator.run_state is RunState.Cooldown
            and clients
            and all(c.state is ClientState.Withdrawn for c in clients)
        ):
            self.rejoinable |= {c.id for c in clients if c.id in self.pending_clients}

    def toggle_pause(self, now: int) -> None:
        try:
            if self.coordinator.run_state is RunState.Paused:
                self.coordinator.resume(now)
            else:
                self.coordinator.pause(now)
        except CoordinatorError as e:
            log.warning("Error pausing: %s", e)

    def after_change(self) -> None:
        """The `--init-warmup-time` override lasts until the run is first active."""
        if self.coordinator.active():
            self.coordinator.config.warmup_time = self.original_warmup_time

    def snapshot(self) -> Coordinator:
        """The state to save (see `save_state.resume_snapshot`)."""
        return resume_snapshot(self.coordinator, self.original_warmup_time)


__all__ = ["ServerCore", "TickOutcome", "prepare_for_start"]
