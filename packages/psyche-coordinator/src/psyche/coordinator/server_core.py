"""The server's rules, without sockets or clocks (upstream `centralized/server/src/app.rs`).

`ServerCore` owns the coordinator and the set of clients waiting to join, and applies upstream's
rules for every event: a Join with the run's id makes a client pending; witnesses, health checks
and checkpoints go to the coordinator; a disconnect removes the client from the pending set and,
with `withdraw_on_disconnect`, withdraws it from the run (not once the run is Finished, when
every client leaves); every tick first drops exited clients from the pending set, then ticks
the coordinator. Each handler returns whether the new state must be broadcast (upstream's
broadcast rules). This is the only copy of these rules: the TCP server
(`psyche.centralized.server`), the in-process server for client tests (`psyche.client.testing`)
and the simulation (`psyche.coordinator.testing`) all drive a `ServerCore`, supplying time,
randomness and I/O.

Coordinator errors are logged and the event ignored, as upstream. Where upstream would panic
(and crash the server), the coordinator raises `CoordinatorPanic` before changing anything; it
is logged as an error and the server carries on.

Beyond upstream (docs/centralized.md, "Members, strangers and non-delivering members"):

* only members are heard: a Witness, HealthCheck or Checkpoint from a key that is not a client
  of the current epoch is dropped before the coordinator sees it and never broadcast; a member's
  Checkpoint is broadcast only when it changed the run's checkpoint. Ignored and rejected
  messages are logged through a `DropLog` (one line per kind, then one summary per interval);
* a private run (`authorized` keys) refuses every other key's Join;
* a Join for another run is refused (`unknown_run`: the server tells the client and closes);
* a member dropped for not delivering (by a health check, or elected witness of a round that
  ended without any witness while it stayed connected and silent) is barred from the next
  `ban_epochs` epochs, twice as many as its last ban when it offends again soon after one (up to
  `MAX_BAN_EPOCHS`): its Join is kept, but it is left out of the clients the coordinator
  starts an epoch with, and it is back after the ban without doing anything. A client that
  disconnected during the epoch is never barred (a crash or a restart is not a refusal to
  deliver), nor one the coordinator withdrew with the others. A witness cannot say when it was
  sent (upstream's message carries no time), so one that arrives after its round ended, before
  the next epoch starts (the cooldown and the wait for members: a loaded machine or network
  delays messages, it does not lose them), lifts the ban its silence earned;
* a client that left the epoch and sends Join again is pending again (upstream undid that Join
  on every tick, so a dropped client that stayed connected never came back);
* what a member reports with its witness (loss, throughput: `accepted_witness`) counts only
  for a witness the coordinator accepted, reported for the current step;
* verification (`psyche.coordinator.verification`, with `verification_percent > 0`): the duties of
  each round are recorded when it starts (the last `VERIFIED_ROUNDS`); a member's
  `VerificationReport` is heard once per round and only about its own duties; a dispute the
  tie-breakers decide drops the loser (the trainer, or the verifier that accused falsely) and
  bans it as a member that did not deliver (`_ban`). What was verified, found and punished is
  kept for the status page (`verification_log`);
* every log line a peer's message causes goes through a `DropLog` (at most a few lines per kind
  and interval), so no flood of logins or messages floods the log.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.committee_selection import CommitteeSelection
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.data_selection import verification_duties_for_state
from psyche.coordinator.errors import CoordinatorError, CoordinatorErrorKind, CoordinatorPanic
from psyche.coordinator.following import (
    RoundFollowing,
    is_follow_report,
    round_following,
)
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.resume import prepare_for_start, resume_snapshot
from psyche.coordinator.run_state import (
    ClientState,
    HealthChecks,
    RunState,
    TickResult,
    WitnessMetadata,
)
from psyche.coordinator.verification import Resolution, RoundVerification, VerificationReport
from psyche.core.batch_id import BatchId
from psyche.core.drop_log import DropLog
from psyche.core.node_identity import NodeIdentity

log = logging.getLogger(__name__)

# Epochs a member dropped for not delivering sits out (`--ban-epochs`; 0: upstream's rules).
DEFAULT_BAN_EPOCHS = 1
_ROUND_STATES = (RunState.RoundTrain, RunState.RoundWitness)
# Joins logged in detail per interval; more are summed up (a run's clients joining together fit).
JOIN_LOG_BURST = 8


@dataclass(frozen=True)
class TickOutcome:
    """What a tick did: `epoch_end` is None, or the success flag of the epoch that ended;
    `result` is what the coordinator's tick returned (None when it refused to tick)."""

    epoch_end: bool | None = None
    result: TickResult | None = None


MAX_BAN_EPOCHS = 64
"""The longest a ban grows (`ServerCore._ban`)."""
VERIFIED_ROUNDS = 3
"""Rounds whose verification reports are still heard: a verifier recomputes while the round
trains, and its report may arrive during the next two (a loaded machine is slow, not wrong); a
tie-breaker recomputes a round's disputes in the next round and reports during it or after."""
VERIFICATION_LOG_LEN = 64
"""Verification events the server keeps for the status page."""


@dataclass(frozen=True)
class VerificationEvent:
    """One thing verification did, for people: `kind` "verified" or "followed" (a verifier's or
    a follower's finding: `matches`, `score`), or "punished" (`reason`)."""

    step: int
    kind: str
    subject: NodeIdentity
    by: NodeIdentity | None = None
    batch: str = ""
    matches: bool | None = None
    score: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class Ban:
    """A member dropped for not delivering in epoch `epoch`: left out of the `epochs` epochs
    after it, every epoch before `until_epoch`."""

    epoch: int
    epochs: int
    reason: str

    @property
    def until_epoch(self) -> int:
        return self.epoch + 1 + self.epochs

    @property
    def remembered_until(self) -> int:
        """A member that offends again before this epoch (as long after its ban as the ban
        lasted) gets twice the ban."""
        return self.until_epoch + self.epochs


@dataclass
class ServerCore:
    coordinator: Coordinator
    original_warmup_time: int
    withdraw_on_disconnect: bool = True
    # The public keys that may join (a private run); None: anyone with the run id (upstream).
    authorized: frozenset[bytes] | None = None
    # Epochs a member dropped for not delivering sits out; 0 restores upstream's rules.
    ban_epochs: int = DEFAULT_BAN_EPOCHS
    # Insertion-ordered set (upstream's HashSet order is arbitrary).
    pending_clients: dict[NodeIdentity, None] = field(default_factory=dict)
    # Exited clients the per-tick kick must leave in the pending set (see kick_unhealthy_clients).
    rejoinable: set[NodeIdentity] = field(default_factory=set)
    # Clients whose Join asking to come back (after leaving the epoch, or while banned) was
    # logged: one line per come-back, however many Joins (see on_join).
    _returning: set[NodeIdentity] = field(default_factory=set)
    # Members dropped for not delivering, and until when they sit out.
    banned: dict[NodeIdentity, Ban] = field(default_factory=dict)
    # The last ban of each member banned lately (kept until `Ban.remembered_until`).
    ban_record: dict[NodeIdentity, Ban] = field(default_factory=dict)
    # The loss in the newest witness's metadata (for the run summary; the coordinator ignores it).
    last_reported_loss: float | None = None
    # Messages dropped unheard (non-members, other runs, unauthorized keys), by kind.
    ignored: DropLog = field(default_factory=lambda: DropLog(log, "messages ignored"))
    # Messages the coordinator refused (late or invalid witnesses, ...), by kind.
    rejected: DropLog = field(default_factory=lambda: DropLog(log, "messages rejected"))
    # Joins (any key that logs in may send one).
    joins: DropLog = field(default_factory=lambda: DropLog(log, "joins", burst=JOIN_LOG_BURST))
    # The witness the latest `on_witness` had the coordinator accept, reported for the step it
    # was accepted in: (sender, step, metadata); None when it accepted none (for the status
    # page: nothing else a member sends reaches it).
    accepted_witness: tuple[NodeIdentity, int, WitnessMetadata] | None = None
    # The verification report `on_verification` accepted last (None: it refused it), which the
    # server relays to the run's clients: a round's tie-breaker learns its disputes from them.
    accepted_verification: tuple[NodeIdentity, VerificationReport] | None = None
    # The coordinator's refusal of the latest event (None: it accepted, or the event never
    # reached it). The server only logs refusals; a driver that reports them to its caller (the
    # simulation in `psyche.coordinator.testing`) reads them here.
    refusal: CoordinatorError | CoordinatorPanic | None = None
    # Who sent a witness in the current round, and who disconnected in the current epoch.
    _round: tuple[int, int] | None = None
    _witness_senders: set[NodeIdentity] = field(default_factory=set)
    _epoch: tuple[int, int] | None = None
    _disconnected: set[NodeIdentity] = field(default_factory=set)
    # Banned as silent witnesses of the round that just ended, until the next epoch starts:
    # the step, and the ban record each had before (restored if its witness arrives late).
    _unheard: dict[NodeIdentity, tuple[int, Ban | None]] = field(default_factory=dict)
    # The verification reports of the latest rounds (by step) and what verification did.
    verification: dict[int, RoundVerification] = field(default_factory=dict)
    # The follower reports of the latest rounds (`psyche.coordinator.following`), by step.
    following: dict[int, RoundFollowing] = field(default_factory=dict)
    verification_log: deque[VerificationEvent] = field(
        default_factory=lambda: deque(maxlen=VERIFICATION_LOG_LEN)
    )

    @classmethod
    def start(
        cls,
        coordinator: Coordinator,
        *,
        now: int,
        init_warmup_time: int | None = None,
        withdraw_on_disconnect: bool = True,
        authorized: frozenset[bytes] | None = None,
        ban_epochs: int = DEFAULT_BAN_EPOCHS,
    ) -> ServerCore:
        state = prepare_for_start(coordinator, now)
        original = state.config.warmup_time
        if init_warmup_time is not None:
            state.config.warmup_time = init_warmup_time
        return cls(state, original, withdraw_on_disconnect, authorized, ban_epochs)

    @property
    def run_id(self) -> str:
        return self.coordinator.run_id

    def client_index(self, identity: NodeIdentity) -> int | None:
        for index, client in enumerate(self.coordinator.epoch_state.clients):
            if client.id == identity:
                return index
        return None

    def is_authorized(self, key: bytes) -> bool:
        """Whether `key` may join: anyone in an open run, the listed keys in a private one."""
        return self.authorized is None or bytes(key) in self.authorized

    def unknown_run(self, run_id: str) -> str | None:
        """Why a Join naming `run_id` is refused (this server serves another run), or None."""
        if run_id == self.coordinator.run_id:
            return None
        shown = run_id if len(run_id) <= 64 else run_id[:64] + "..."
        return f"unknown run id {shown!r}: this server runs {self.coordinator.run_id!r}"

    @property
    def drop_logs(self) -> tuple[DropLog, ...]:
        """The rate-limited logs whose `run` a shell keeps running (their summary lines)."""
        return (self.ignored, self.rejected, self.joins)

    def hears(self, sender: NodeIdentity) -> bool:
        """Whether a Witness, HealthCheck or Checkpoint from `sender` reaches these rules: a
        client of the current epoch, or a witness banned as silent whose late witness would
        lift its ban (`_heard_late`). A shell may drop the others' messages unread."""
        return sender in self._unheard or self.client_index(sender) is not None

    def ignore_non_member(self, sender: NodeIdentity, what: str) -> None:
        """Count (and log, rate-limited) a `what` message from a key that is no client of the
        current epoch, dropped unheard (here, or unread by the server: `protocol`)."""
        self.ignored.note(
            f"{what} from non-members",
            f"ignoring a {what} from {sender}: not a client of the run's current epoch "
            "(more are counted and summed up once per interval)",
        )

    def _member(self, sender: NodeIdentity, what: str) -> int | None:
        """`sender`'s index among the epoch's clients; None (and counted) for a non-member,
        whose message is then dropped unheard."""
        index = self.client_index(sender)
        if index is None:
            self.ignore_non_member(sender, what)
        return index

    # -- events ---------------------------------------------------------------------------------

    def on_join(self, sender: NodeIdentity, run_id: str) -> bool:
        """A Join for this run makes `sender` pending (a private run only accepts its authorized
        keys). Never a broadcast; a repeated Join changes nothing and logs nothing, except from a
        client that left the epoch unhealthy (dropped, withdrawn) or is banned: it asks to come
        back, so its Join is kept (`rejoinable`) instead of being kicked with its old one, and
        the first such Join is logged like a new one. Its old Join may still be pending: a
        client that reconnects has its new connection's Join handled before its old
        connection's disconnect (which the server then ignores), so whether the old Join was
        still there must not decide whether the come-back is logged."""
        self.refusal = None
        unknown = self.unknown_run(run_id)
        if unknown is not None:
            self.ignored.note(
                "Join for another run", f"refusing the Join of {sender}: {unknown}", logging.INFO
            )
            return False
        if not self.is_authorized(sender.signer):
            self.ignored.note(
                "Join from unauthorized keys",
                f"refusing the Join of {sender}: its key is not among the run's authorized keys",
            )
            return False
        left = any(
            c.id == sender and c.state is not ClientState.Healthy
            for c in self.coordinator.epoch_state.exited_clients
        )
        if left:
            self.rejoinable.add(sender)
        returning = (left or sender in self.banned) and sender not in self._returning
        if returning:
            self._returning.add(sender)
        if sender not in self.pending_clients or returning:
            self.pending_clients[sender] = None
            ban = self.banned.get(sender)
            sits_out = (
                ""
                if ban is None
                else f"; it sits out the epochs before {ban.until_epoch} ({ban.reason})"
            )
            self.joins.note(
                "added pending client", f"added pending client {sender}{sits_out}", logging.INFO
            )
        return False

    def on_witness(
        self, sender: NodeIdentity, data: OpportunisticData, now: int, random_seed: int
    ) -> bool:
        self.refusal = None
        self.accepted_witness = None
        if sender in self._unheard:
            self._heard_late(sender)
        if self._member(sender, "Witness") is None:
            return False
        before = self.coordinator.run_state
        self._track_round()
        if before in _ROUND_STATES:
            self._witness_senders.add(sender)
        try:
            match data:
                case OpportunisticData.WitnessStep((witness, metadata)):
                    self.coordinator.witness(sender, witness, now)
                    step = self.coordinator.progress.step
                    # What it reports counts for the step it witnessed, and only that one.
                    if metadata.step == step:
                        self.accepted_witness = (sender, step, metadata)
                        if math.isfinite(metadata.loss):
                            self.last_reported_loss = float(metadata.loss)
                case OpportunisticData.WarmupStep(witness):
                    self.coordinator.warmup_witness(sender, witness, now, random_seed)
        except CoordinatorError as e:
            self.refusal = e
            self.rejected.note(
                f"Witness ({e.kind.name})", f"Error when processing witness from {sender}: {e}"
            )
        except CoordinatorPanic as e:
            self.refusal = e
            log.error("witness from %s would crash upstream's server; ignored: %s", sender, e)
        return self.coordinator.run_state is not before

    def on_health_check(self, sender: NodeIdentity, checks: HealthChecks) -> bool:
        self.refusal = None
        if self._member(sender, "HealthCheck") is None:
            return False
        # An honest sender names each unhealthy client once; a longer list can only be repeats,
        # which cost the coordinator work and change nothing (hardening, not upstream).
        clients = self.coordinator.epoch_state.clients
        limit = max(len(clients), 1)
        if len(checks) > limit:
            self.rejected.note(
                "HealthCheck (too long)",
                f"health check from {sender} names {len(checks)} clients, more than the "
                f"{limit} in the run; ignored",
            )
            return False
        healthy = {c.id for c in clients if c.state is ClientState.Healthy}
        try:
            dropped = self.coordinator.health_check(sender, checks)
        except CoordinatorError as e:
            self.refusal = e
            self.rejected.note(
                f"HealthCheck ({e.kind.name})",
                f"Error when processing health check from {sender}: {e}",
            )
            return False
        except CoordinatorPanic as e:
            self.refusal = e
            log.error("health check from %s would crash upstream's server; ignored: %s", sender, e)
            return False
        if dropped:  # at most once per client and epoch: an empty check logs nothing
            log.info("Dropped %d clients from health check", dropped)
        for client in clients:
            if client.id in healthy and client.state is ClientState.Dropped:
                self._ban(client.id, f"dropped by a health check from {sender}")
        return dropped > 0

    def on_verification(self, sender: NodeIdentity, report: VerificationReport) -> bool:
        """A verifier's or tie-breaker's findings for a recent round: kept once per sender and
        round, and only about its own duties; the disputes it lets the tie-breakers decide drop
        and ban their losers. Whether the state changed (someone was dropped)."""
        self.refusal = None
        self.accepted_verification = None
        if self._member(sender, "Verification") is None:
            return False
        self._record_duties()  # a round that started since the last tick (by a witness)
        if is_follow_report(report):
            return self._on_following(sender, report)
        record = self.verification.get(report.step)
        problem = (
            f"step {report.step} is not a recent verified round"
            if record is None
            else record.add(sender, report)
        )
        if problem is not None or record is None:
            self.rejected.note(
                "Verification", f"verification report from {sender} refused: {problem}"
            )
            return False
        self.accepted_verification = (sender, report)
        self._log_findings(sender, report, record.duties.trainers(), "verified")
        dropped = False
        for resolution in record.resolve():
            dropped |= self._punish(resolution)
        return dropped

    def _log_findings(
        self,
        sender: NodeIdentity,
        report: VerificationReport,
        trainers: Mapping[BatchId, NodeIdentity],
        kind: str,
    ) -> None:
        """Keep each finding of an accepted report in `verification_log` (`kind`: "verified" or
        "followed") and warn of each mismatch."""
        for finding in report.findings:
            trainer = trainers[finding.batch_id]
            self.verification_log.append(
                VerificationEvent(
                    report.step,
                    kind,
                    trainer,
                    sender,
                    str(finding.batch_id),
                    bool(finding.matches),
                    float(finding.score),
                )
            )
            if not finding.matches:
                log.warning(
                    "%s finds %s's result for %s at step %d wrong (%s; score %.3g)",
                    sender,
                    trainer,
                    finding.batch_id,
                    report.step,
                    "not its exact rebuild" if kind == "followed" else "by its recompute",
                    finding.score,
                )

    def _on_following(self, sender: NodeIdentity, report: VerificationReport) -> bool:
        """A follower's exact findings (`psyche.coordinator.following`): kept once per sender and
        round, only about trainers it follows; what two followers' words decide drops and bans
        its loser. Not relayed (nobody arbitrates them later). Whether someone was dropped."""
        record = self.following.get(report.step)
        problem = (
            f"step {report.step} is not a recent followed round"
            if record is None
            else record.add(sender, report)
        )
        if problem is not None or record is None:
            self.rejected.note("Following", f"follower report from {sender} refused: {problem}")
            return False
        trainers = {d.batch_id: d.trainer for d in record.duties}
        self._log_findings(sender, report, trainers, "followed")
        dropped = False
        for resolution in record.resolve():
            dropped |= self._punish(resolution)
        return dropped

    def _punish(self, resolution: Resolution) -> bool:
        """Drop the loser of a decided dispute (if still a healthy member) and ban it; whether
        it was dropped."""
        loser = resolution.loser
        self.verification_log.append(
            VerificationEvent(
                resolution.step,
                "punished",
                loser,
                batch=str(resolution.batch_id),
                reason=f"{resolution.role}: {resolution.reason}",
            )
        )
        log.warning("verification: %s loses (%s): %s", loser, resolution.role, resolution.reason)
        dropped = False
        for client in self.coordinator.epoch_state.clients:
            if client.id == loser and client.state is ClientState.Healthy:
                client.state = ClientState.Dropped
                dropped = True
        self._ban(loser, f"verification, as {resolution.role}: {resolution.reason}")
        return dropped

    def _record_duties(self) -> None:
        """Record who verifies what in the current round, once (the last `VERIFIED_ROUNDS`
        rounds are kept): on every tick and before every report, so a round that started and
        moved on to its witness phase between two ticks is recorded too."""
        coordinator = self.coordinator
        if (
            coordinator.config.verification_percent == 0
            or coordinator.run_state not in _ROUND_STATES
        ):
            return
        step = coordinator.progress.step
        if step in self.verification:
            return
        try:
            duties = verification_duties_for_state(coordinator)
        except (CoordinatorError, CoordinatorPanic) as e:
            log.error("cannot derive the verification duties of step %d: %s", step, e)
            return
        self.verification[step] = RoundVerification(duties)
        for old in sorted(self.verification)[:-VERIFIED_ROUNDS]:
            del self.verification[old]
        following = round_following(coordinator, duties)
        if following is not None:
            self.following[step] = following
            for old in sorted(self.following)[:-VERIFIED_ROUNDS]:
                del self.following[old]

    def on_checkpoint(self, sender: NodeIdentity, checkpoint: Checkpoint) -> bool:
        """A member's new checkpoint; broadcast only when it changed the run's (upstream always
        broadcasts, which let anyone make the server send its state to everyone)."""
        self.refusal = None
        index = self._member(sender, "Checkpoint")
        if index is None:
            return False
        llm = self.coordinator.model.value
        before = llm.checkpoint
        try:
            self.coordinator.checkpoint(sender, index, checkpoint)
        except CoordinatorError as e:
            self.refusal = e
            self.rejected.note(
                f"Checkpoint ({e.kind.name})",
                f"Error when processing checkpoint from {sender}: {e}",
            )
        return bool(llm.checkpoint != before)

    def on_disconnect(self, sender: NodeIdentity) -> None:
        self.refusal = None
        self._disconnected.add(sender)
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
                self.refusal = e
                log.warning("Coordinator withdraw error: %s", e)

    def on_tick(self, now: int, random_seed: int) -> TickOutcome:
        self.refusal = None
        self.kick_unhealthy_clients()
        self._track_round()
        silent = self.silent_witnesses()
        try:
            result = self.coordinator.tick(self.admissible_pending(), now, random_seed)
        except CoordinatorError as e:
            self.refusal = e
            if e.kind is not CoordinatorErrorKind.Halted:
                log.warning("Coordinator tick error: %s", e)
            return TickOutcome()
        except CoordinatorPanic as e:
            self.refusal = e
            log.error("tick would crash upstream's server; state unchanged: %s", e)
            return TickOutcome()
        finally:
            self._track_round()
        self._record_duties()
        self._forgive_mass_withdrawal(silent)
        if self.coordinator.run_state not in (RunState.Cooldown, RunState.WaitingForMembers):
            self._unheard.clear()  # the next epoch started: too late to be heard
        match result:
            case TickResult.EpochEnd(success):
                if not success:
                    log.warning("Epoch abandoned")
                return TickOutcome(epoch_end=success, result=result)
        return TickOutcome(result=result)

    def kick_unhealthy_clients(self) -> None:
        """Exited clients leave the pending set: they must reconnect and Join again.

        Upstream kicks them on every tick until the next epoch clears `exited_clients`. Three
        cases it gets wrong are exempt here (`rejoinable`): a client that reconnected (a
        restarted process with the same key: its one Join was undone and it never trained
        again), one that sent Join again after it left (a dropped client asking to come back:
        upstream kicked that Join too, so only a restart brought it back), and clients the
        coordinator withdrew all at once because a round had no witness (still connected and
        blameless, they were all kicked and the run never started again). A banned member is
        exempt too (`_ban`: its Join is kept while it sits out). Without bans (`ban_epochs` 0),
        a client dropped by a health check that stays connected and says nothing is still
        kicked, as upstream.
        """
        epoch_state = self.coordinator.epoch_state
        # Forget the exemption once the client is a healthy member of an epoch again.
        leaving = {c.id for c in epoch_state.exited_clients} | {
            c.id for c in epoch_state.clients if c.state is not ClientState.Healthy
        }
        self.rejoinable &= leaving
        self._returning &= leaving | self.banned.keys()
        for client in epoch_state.exited_clients:
            if client.state is not ClientState.Healthy and client.id not in self.rejoinable:
                self.pending_clients.pop(client.id, None)

    def _forgive_mass_withdrawal(self, silent: list[NodeIdentity]) -> None:
        """A round without witnesses ends the epoch by withdrawing every client (upstream).
        The others are forgiven; the witnesses that kept silent (`silent`, taken before the
        tick) are banned instead, unless their witness arrives before the next epoch starts
        (`_heard_late`). Everyone's Join is kept."""
        coordinator = self.coordinator
        clients = coordinator.epoch_state.clients
        if (
            coordinator.run_state is RunState.Cooldown
            and clients
            and all(c.state is ClientState.Withdrawn for c in clients)
        ):
            step = coordinator.progress.step - 1
            for identity in silent:
                before = self.ban_record.get(identity)
                if self._ban(identity, f"elected witness of step {step}, it sent no witness"):
                    self._unheard[identity] = (step, before)
            self.rejoinable |= {c.id for c in clients if c.id in self.pending_clients}

    def _heard_late(self, identity: NodeIdentity) -> None:
        """A witness from a member banned as silent, arriving after its round ended but before
        the next epoch: it was late, not silent (a loaded machine, a slow link), so the ban is
        lifted and its earlier ban record restored."""
        step, before = self._unheard.pop(identity)
        self.banned.pop(identity, None)
        if before is None:
            self.ban_record.pop(identity, None)
        else:
            self.ban_record[identity] = before
        log.info(
            "%s's witness of step %d arrived after its round ended: it was late, not silent; "
            "its ban is lifted",
            identity,
            step,
        )

    # -- members that do not deliver ------------------------------------------------------------

    def silent_witnesses(self) -> list[NodeIdentity]:
        """The elected witnesses of a round in its witness phase that no witness has reached yet
        and that are healthy, connected all epoch and sent no witness message at all: if the
        round ends so, they alone are why (empty when bans are off)."""
        coordinator = self.coordinator
        if self.ban_epochs == 0 or coordinator.run_state is not RunState.RoundWitness:
            return []
        round_ = coordinator.current_round()
        if round_ is None or round_.witnesses:
            return []
        try:
            selection = CommitteeSelection.from_coordinator(coordinator, 0)
        except CoordinatorError:
            return []
        # Clients only leave the list at a round's end, so indices are the round's own.
        clients = coordinator.epoch_state.clients[: round_.clients_len]
        return [
            client.id
            for index, client in enumerate(clients)
            if client.state is ClientState.Healthy
            and client.id not in self._witness_senders
            and client.id not in self._disconnected
            and selection.get_witness(index).witness
        ]

    def _ban(self, identity: NodeIdentity, reason: str) -> bool:
        """Bar `identity` from the next `ban_epochs` epochs, or from twice as many as its last
        ban when it offends again soon after that one (`Ban.remembered_until`), up to
        `MAX_BAN_EPOCHS`: a member that keeps failing to deliver costs the run an epoch now
        and then, less and less often, instead of every other epoch. One ban per epoch. Its
        Join is kept (it is back after the ban by itself). Whether it was banned now."""
        if self.ban_epochs == 0 or identity in self._disconnected:
            return False  # upstream's rules; or a client that left (a crash is no refusal)
        epoch = self.coordinator.progress.epoch
        last = self.ban_record.get(identity)
        if last is not None and last.epoch == epoch:
            return False  # banned already for what it did in this epoch
        again = last is not None and epoch < last.remembered_until
        epochs = self.ban_epochs
        if last is not None and again:
            epochs = min(max(last.epochs * 2, epochs), MAX_BAN_EPOCHS)
        ban = Ban(epoch, epochs, reason)
        self.banned[identity] = self.ban_record[identity] = ban
        if identity in self.pending_clients:
            self.rejoinable.add(identity)
        log.warning(
            "%s did not deliver (%s): left out of the run's epochs before %d (%d epoch%s%s)",
            identity,
            reason,
            ban.until_epoch,
            epochs,
            "" if epochs == 1 else "s",
            "; it did so again soon after its last ban" if again else "",
        )
        return True

    def admissible_pending(self) -> list[NodeIdentity]:
        """The pending clients an epoch may start with: banned ones are left out, unless the
        run could not start without them (fewer than `init_min_clients` others): a ban never
        keeps a run waiting that upstream would start."""
        epoch = self.coordinator.progress.epoch
        for identity, ban in list(self.banned.items()):
            if ban.until_epoch <= epoch:
                del self.banned[identity]
                log.info("%s may join the run again (its ban ended)", identity)
        for identity, ban in list(self.ban_record.items()):
            if ban.remembered_until <= epoch:
                del self.ban_record[identity]
        pending = list(self.pending_clients)
        if not self.banned or self.coordinator.run_state is not RunState.WaitingForMembers:
            return pending
        admitted = [c for c in pending if c not in self.banned]
        if len(admitted) < self.coordinator.config.init_min_clients:
            return pending
        return admitted

    def _track_round(self) -> None:
        """Start afresh the witness senders of each round and the disconnects of each epoch."""
        coordinator = self.coordinator
        epoch_key = (coordinator.progress.epoch, coordinator.epoch_state.start_timestamp)
        if epoch_key != self._epoch:
            self._epoch = epoch_key
            self._disconnected.clear()
        round_key = (coordinator.progress.epoch, coordinator.progress.step)
        if coordinator.run_state in _ROUND_STATES and round_key != self._round:
            self._round = round_key
            self._witness_senders.clear()

    def toggle_pause(self, now: int) -> None:
        self.refusal = None
        try:
            if self.coordinator.run_state is RunState.Paused:
                self.coordinator.resume(now)
            else:
                self.coordinator.pause(now)
        except CoordinatorError as e:
            self.refusal = e
            log.warning("Error pausing: %s", e)

    def after_change(self) -> None:
        """The `--init-warmup-time` override lasts until the run is first active."""
        if self.coordinator.active():
            self.coordinator.config.warmup_time = self.original_warmup_time

    def snapshot(self) -> Coordinator:
        """The state to save (see `psyche.coordinator.resume.resume_snapshot`)."""
        return resume_snapshot(self.coordinator, self.original_warmup_time)


__all__ = [
    "DEFAULT_BAN_EPOCHS",
    "JOIN_LOG_BURST",
    "MAX_BAN_EPOCHS",
    "VERIFIED_ROUNDS",
    "Ban",
    "ServerCore",
    "TickOutcome",
    "VerificationEvent",
]
