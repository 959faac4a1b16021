"""Verification on the Solana coordinator (issue 27): the run's `RunVerification` account.

Upstream's programs elect no verifier (its data selection asserts `verification_percent == 0`),
so this is an extension, kept out of upstream's accounts: their layouts are unchanged. A run
with `verification_percent > 0` has one more account, the PDA `["verification",
coordinator_account]` of the coordinator program (`init_verification`, permissionless: the
payer pays its rent), which holds what the centralized server keeps in memory
(`psyche.coordinator.server_core.ServerCore`):

* the duties and reports of the last `VERIFIED_ROUNDS` rounds (`VerifiedRound`, converted to and
  from `psyche.coordinator.verification.RoundVerification`, whose `add` and `resolve` are the
  only copy of the rules: a member's report is heard once per round and only about its own
  duties; the tie-breakers decide);
* the members banned for losing a dispute (`BanRecord`, the server's escalating `Ban`);
* the last `VERIFICATION_LOG_LEN` things verification did (`VerificationEntry`): who verified
  whom and what it found, who was punished, slashed how much and who was credited;
* the run's `CoordinatorConfig.verifiers_train` (appended, 2026-11-28): the coordinator account
  is upstream's bytes and has no room for it, so the owner sets it here
  (`set_verifiers_train`) and the program and every client put it on the config they read
  from the coordinator account (`apply_to`). An account written before it reads `False`: the
  program zeroes the bytes past the account's encoding at every store (a shrunk log leaves no
  old byte where the flag is read).

* the run's `CoordinatorConfig.exact_verification_threads` (appended after `verifiers_train`,
  2026-11-28, later: the owner's `set_exact_verification_threads`, applied as `verifiers_train`
  is) and, in a run that verifies exactly, the follower duties and reports of the last
  `VERIFIED_ROUNDS` rounds (`FollowedRound`, converted to and from
  `psyche.coordinator.following.RoundFollowing`, whose `add` and `resolve` are the only copy of
  those rules: a follower's report is heard once per round and only about the trainers it
  follows; all three followers convict, two vouchers that outnumber the accusers punish them).

Economics (`punishment`): the loser is slashed `slashing_rate_per_client` of the epoch's rates
(the treasurer's `run_update` sets it, as upstream) at once, and that amount is credited, in
`earned` points, to the members whose findings decided against it (shared equally, the
remainder unpaid): no point is created. A follower's conviction credits the followers that
found the commitment differs (`follow_deciders`), a false accuser's punishment the followers that
vouched for it. Upstream's own slashing path (an `Ejected` client
slashed at the epoch's end) is not used: nothing upstream ejects, and its end-of-epoch walk
pairs exited clients with the run's clients in order, which a client removed out of order misses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

from solders.pubkey import Pubkey as SoldersPubkey

from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.following import FOLLOW_DRAW, FOLLOWERS_PER_TRAINER, RoundFollowing
from psyche.coordinator.run_state import SOLANA_RUN_ID_MAX_LEN
from psyche.coordinator.server_core import (
    DEFAULT_BAN_EPOCHS,
    MAX_BAN_EPOCHS,
    VERIFICATION_LOG_LEN,
    VERIFIED_ROUNDS,
    Ban,
)
from psyche.coordinator.verification import (
    MAX_FINDINGS,
    NO_DRAW,
    ROUND_SEED_LEN,
    VERIFICATION_TIE_BREAKERS,
    Finding,
    Resolution,
    RoundDuties,
    RoundVerification,
    VerificationDuty,
    VerificationReport,
)
from psyche.core.batch_id import BatchId
from psyche.core.identity import SIGNATURE_LEN
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import F32, U8, U16, U64, FixedBytes, FixedStr, struct
from psyche.solana.pubkey import Pubkey

REASON_LEN = 200
"""A punishment's reason is kept to this many bytes (the account's size is bounded)."""


@struct(frozen=True)
class DutyRecord:
    batch_id: BatchId
    trainer: NodeIdentity
    verifier: NodeIdentity


@struct(frozen=True)
class ReportRecord:
    """A report as the account keeps it: with its draw (`VerificationReport.draw`), so whoever
    reads it back (a tie-breaker learning its disputes, `json-dump-run`, an auditor) can check
    with `check_report` that the verifier checked what its own signature drew."""

    sender: NodeIdentity
    findings: list[Finding]
    draw: Annotated[bytes, FixedBytes(SIGNATURE_LEN)] = NO_DRAW


@struct(frozen=True)
class DecidedRecord:
    batch_id: BatchId
    loser: NodeIdentity


def _duties(records: Iterable[DutyRecord]) -> tuple[VerificationDuty, ...]:
    return tuple(VerificationDuty(r.batch_id, r.trainer, r.verifier) for r in records)


def _records(duties: Iterable[VerificationDuty]) -> list[DutyRecord]:
    return [DutyRecord(d.batch_id, d.trainer, d.verifier) for d in duties]


@struct
class VerifiedRound:
    """One round's `RoundVerification`, as the account stores it."""

    step: U64
    verifier_duties: list[DutyRecord]
    tie_breaker_duties: list[DutyRecord]
    reports: list[ReportRecord]
    decided: list[DecidedRecord]
    run_id: Annotated[str, FixedStr(SOLANA_RUN_ID_MAX_LEN)] = ""
    seed: Annotated[bytes, FixedBytes(ROUND_SEED_LEN)] = bytes(ROUND_SEED_LEN)
    """The run and the round's committee seed, which every draw message names
    (`psyche.coordinator.verification.draw_message`): the duties read back check draws as the
    round's own did."""

    @classmethod
    def of(cls, record: RoundVerification) -> VerifiedRound:
        duties = record.duties
        return cls(
            duties.step,
            _records(duties.verifiers),
            _records(duties.tie_breakers),
            [ReportRecord(s, list(r.findings), r.draw) for s, r in record.reports.items()],
            [DecidedRecord(b, loser) for b, loser in sorted(record.decided)],
            duties.run_id,
            duties.seed,
        )

    def record(self) -> RoundVerification:
        duties = RoundDuties(
            self.step,
            _duties(self.verifier_duties),
            _duties(self.tie_breaker_duties),
            run_id=self.run_id,
            seed=self.seed,
        )
        return RoundVerification(
            duties,
            {
                r.sender: VerificationReport(self.step, list(r.findings), r.draw)
                for r in self.reports
            },
            {(d.batch_id, d.loser) for d in self.decided},
        )


@struct(frozen=True)
class FollowerReportRecord:
    """A follower's report as the account keeps it: its draw is always `FOLLOW_DRAW`."""

    sender: NodeIdentity
    findings: list[Finding]


@struct(frozen=True)
class FollowedBatch:
    """A batch of a followed round, its trainer and the trainer's followers (in ring order):
    `follow_duties`' duties of the batch, the trainer and batch stored once."""

    batch_id: BatchId
    trainer: NodeIdentity
    followers: list[NodeIdentity]


@struct
class FollowedRound:
    """One round's `RoundFollowing`, as the account stores it."""

    step: U64
    batches: list[FollowedBatch]
    reports: list[FollowerReportRecord]
    decided: list[DecidedRecord]

    @classmethod
    def of(cls, record: RoundFollowing) -> FollowedRound:
        batches: dict[BatchId, FollowedBatch] = {}
        for d in record.duties:  # by batch, each batch's followers in ring order
            found = batches.setdefault(d.batch_id, FollowedBatch(d.batch_id, d.trainer, []))
            found.followers.append(d.verifier)
        return cls(
            record.step,
            list(batches.values()),
            [FollowerReportRecord(s, list(r.findings)) for s, r in record.reports.items()],
            [DecidedRecord(b, loser) for b, loser in sorted(record.decided)],
        )

    def duties(self) -> tuple[VerificationDuty, ...]:
        return tuple(
            VerificationDuty(b.batch_id, b.trainer, f) for b in self.batches for f in b.followers
        )

    def record(self) -> RoundFollowing:
        return RoundFollowing(
            self.step,
            self.duties(),
            {
                r.sender: VerificationReport(self.step, list(r.findings), FOLLOW_DRAW)
                for r in self.reports
            },
            {(d.batch_id, d.loser) for d in self.decided},
        )


@struct(frozen=True)
class BanRecord:
    """`ServerCore`'s `Ban` of one member (by its wallet): it sits out the epochs before
    `epoch + 1 + epochs`."""

    signer: Pubkey
    epoch: U64
    epochs: U64

    def ban(self) -> Ban:
        return Ban(self.epoch, self.epochs, "verification")


@struct(frozen=True)
class VerificationEntry:
    """One thing verification did: `kind` "verified" (`by` found `subject`'s result for
    `batch_id` matching or not, with `score`), "followed" (`by`, a follower, found `subject`'s
    commitment its exact rebuild or not) or "punished" (`subject` lost as `role`: slashed
    `slashed` points, `credit` points to each of `credited`)."""

    step: U64
    kind: str
    subject: NodeIdentity
    batch_id: BatchId
    by: NodeIdentity = NodeIdentity()
    matches: bool = False
    score: F32 = 0.0
    role: str = ""
    reason: str = ""
    slashed: U64 = 0
    credited: list[NodeIdentity] = dataclasses.field(default_factory=list)
    credit: U64 = 0


@struct
class RunVerification:
    """The account (see the module docstring)."""

    bump: U8
    coordinator_account: Pubkey
    rounds: list[VerifiedRound] = dataclasses.field(default_factory=list)
    bans: list[BanRecord] = dataclasses.field(default_factory=list)
    log: list[VerificationEntry] = dataclasses.field(default_factory=list)
    verifiers_train: bool = False
    """The run's `CoordinatorConfig.verifiers_train` (see the module docstring)."""
    exact_verification_threads: U16 = 0
    """The run's `CoordinatorConfig.exact_verification_threads` (see the module docstring)."""
    following: list[FollowedRound] = dataclasses.field(default_factory=list)
    """The follower duties and reports of the last `VERIFIED_ROUNDS` rounds of a run that
    verifies exactly."""

    SEEDS_PREFIX = b"verification"

    def apply_to(self, config: CoordinatorConfig) -> None:
        """Put the run's `verifiers_train` and `exact_verification_threads` on `config` (read
        from the coordinator account, which cannot hold them): what the program does before
        every instruction of a verifying run and a client on every state it follows."""
        config.verifiers_train = self.verifiers_train
        config.exact_verification_threads = self.exact_verification_threads

    def round(self, step: int) -> VerifiedRound | None:
        return next((r for r in self.rounds if r.step == step), None)

    def followed_round(self, step: int) -> FollowedRound | None:
        return next((r for r in self.following if r.step == step), None)

    def keep_following(self, record: RoundFollowing) -> None:
        """Store `record` (replacing its step's), keeping the last `VERIFIED_ROUNDS` rounds."""
        rounds = {r.step: r for r in self.following}
        rounds[record.step] = FollowedRound.of(record)
        self.following = [rounds[s] for s in sorted(rounds)[-VERIFIED_ROUNDS:]]

    def draw_signer(self, step: int, signer: bytes) -> tuple[bytes, bytes] | None:
        """The p2p public key and the draw message (`RoundDuties.draw_message`) of wallet
        `signer`'s draw as a verifier of round `step`, as the program recorded the round: what
        the report's `Ed25519SigVerify` instruction must name. None: no such round or duty."""
        stored = self.round(step)
        return None if stored is None else draw_signer(stored.record().duties, signer)

    def keep_round(self, record: RoundVerification) -> None:
        """Store `record` (replacing its step's), keeping the last `VERIFIED_ROUNDS` rounds."""
        rounds = {r.step: r for r in self.rounds}
        rounds[record.duties.step] = VerifiedRound.of(record)
        self.rounds = [rounds[s] for s in sorted(rounds)[-VERIFIED_ROUNDS:]]

    def note(self, entries: Iterable[VerificationEntry]) -> None:
        self.log = [*self.log, *entries][-VERIFICATION_LOG_LEN:]

    def banned_until(self, signer: bytes) -> int | None:
        """The epoch `signer`'s ban ends (the first it may join), or None."""
        record = next((b for b in self.bans if b.signer == signer), None)
        return None if record is None else record.ban().until_epoch

    def ban(self, signer: bytes, epoch: int) -> Ban | None:
        """Ban `signer` as `ServerCore._ban` does (escalating; one ban per epoch); the ban, or
        None when it was banned in this epoch already. Records past their memory are dropped."""
        self.bans = [b for b in self.bans if b.ban().remembered_until > epoch]
        last = next((b.ban() for b in self.bans if b.signer == signer), None)
        if last is not None and last.epoch == epoch:
            return None
        epochs = DEFAULT_BAN_EPOCHS
        if last is not None and epoch < last.remembered_until:
            epochs = min(max(last.epochs * 2, epochs), MAX_BAN_EPOCHS)
        self.bans = [b for b in self.bans if b.signer != signer]
        self.bans.append(BanRecord(signer, epoch, epochs))
        return Ban(epoch, epochs, "verification")


def draw_signer(duties: RoundDuties, signer: bytes) -> tuple[bytes, bytes] | None:
    """The p2p public key and the draw message (`RoundDuties.draw_message`) of wallet `signer`'s
    draw as a verifier of the round of `duties`: what its report's `Ed25519SigVerify`
    instruction names. None: `signer` is no verifier of the round."""
    node = next((d.verifier for d in duties.verifiers if d.verifier.signer == signer), None)
    return None if node is None else (node.p2p_identity, duties.draw_message(node))


def _space() -> int:
    """The account's size: every list at its bound (a round has at most one batch per client,
    `MAX_FINDINGS`; every batch has one verifier and `VERIFICATION_TIE_BREAKERS` tie-breakers,
    so a round's reports name at most that many findings in all, and decide at most one loser
    per finding)."""
    identity, batch, finding = 64, 16, 16 + 1 + 4
    duty = batch + 2 * identity
    findings = (1 + VERIFICATION_TIE_BREAKERS) * MAX_FINDINGS
    round_ = (
        8
        + 4
        + MAX_FINDINGS * duty
        + 4
        + VERIFICATION_TIE_BREAKERS * MAX_FINDINGS * duty
        + 4
        + MAX_FINDINGS * (identity + 4 + SIGNATURE_LEN)
        + findings * finding
        + 4
        + findings * (batch + identity)
        + SOLANA_RUN_ID_MAX_LEN
        + ROUND_SEED_LEN
    )
    entry = 8 + (4 + 9) + identity + batch + identity + 1 + 4 + (4 + 8) + (4 + REASON_LEN)
    credited = max(1 + VERIFICATION_TIE_BREAKERS, FOLLOWERS_PER_TRAINER)  # deciders at most
    entry += 8 + 4 + credited * identity + 8
    bans = MAX_FINDINGS * (32 + 16)
    log = 4 + VERIFICATION_LOG_LEN * entry
    # a followed round: each batch has at most `FOLLOWERS_PER_TRAINER` followers, each member
    # reports once, one finding per duty; a batch decides against its trainer or against the
    # accusers that two vouchers outnumber (fewer than half its followers)
    follow_duties = FOLLOWERS_PER_TRAINER * MAX_FINDINGS
    losers = max(1, (FOLLOWERS_PER_TRAINER - 1) // 2) * MAX_FINDINGS
    followed = (
        8
        + 4
        + MAX_FINDINGS * (batch + identity + 4 + FOLLOWERS_PER_TRAINER * identity)
        + 4
        + MAX_FINDINGS * (identity + 4)
        + follow_duties * finding
        + 4
        + losers * (batch + identity)
    )
    settings = 1 + 2  # verifiers_train, exact_verification_threads
    return (
        (8 + 1 + 32 + 4 + VERIFIED_ROUNDS * round_ + 4 + bans + log + settings)
        + 4
        + VERIFIED_ROUNDS * followed
    )


RUN_VERIFICATION_SPACE = _space()


# --------------------------------------------------------------------------------------------
# What the program does with a report (pure: the program applies it to the accounts)


def findings_entries(
    record: RoundVerification | RoundFollowing,
    sender: NodeIdentity,
    report: VerificationReport,
) -> list[VerificationEntry]:
    """The "verified" entries of an accepted verifier's or tie-breaker's report, the "followed"
    entries of a follower's."""
    if isinstance(record, RoundFollowing):
        kind, trainers = "followed", {d.batch_id: d.trainer for d in record.duties}
    else:
        kind, trainers = "verified", record.duties.trainers()
    return [
        VerificationEntry(
            report.step,
            kind,
            trainers[f.batch_id],
            f.batch_id,
            sender,
            bool(f.matches),
            float(f.score),
        )
        for f in report.findings
    ]


def follow_deciders(record: RoundFollowing, resolution: Resolution) -> list[NodeIdentity]:
    """Who found what a follower's `resolution` decided: against a trainer, the followers
    that found its commitment differs; against an accusing follower, those that vouched for the
    commitment. In report order."""
    matches = resolution.role != "trainer"
    return [
        sender
        for sender, report in record.reports.items()
        for f in report.findings
        if f.batch_id == resolution.batch_id and bool(f.matches) == matches
    ]


def deciders(record: RoundVerification, resolution: Resolution) -> list[NodeIdentity]:
    """Who found what `resolution` decided: against a trainer, the verifiers that accused it and
    the tie-breakers that found its result wrong; against a verifier, the tie-breakers that
    found the accused result right. In report order (the order they arrived)."""
    against_trainer = resolution.role == "trainer"
    out: list[NodeIdentity] = []
    for sender, report in record.reports.items():
        tie_breaker = record.duties.is_tie_breaker(sender)
        for f in report.findings:
            if f.batch_id != resolution.batch_id:
                continue
            if (tie_breaker and bool(f.matches) != against_trainer) or (
                against_trainer and not tie_breaker and not f.matches
            ):
                out.append(sender)
    return out


def punishment(
    resolution: Resolution, credited: list[NodeIdentity], slashing_rate: int
) -> VerificationEntry:
    """The "punished" entry of `resolution`: the loser slashed `slashing_rate`, shared equally
    by `credited` (its `deciders` or `follow_deciders`; the remainder is nobody's)."""
    credit = slashing_rate // len(credited) if credited else 0
    reason = resolution.reason.encode()[:REASON_LEN].decode(errors="ignore")
    return VerificationEntry(
        resolution.step,
        "punished",
        resolution.loser,
        resolution.batch_id,
        role=resolution.role,
        reason=reason,
        slashed=slashing_rate,
        credited=credited,
        credit=credit,
    )


def entry_line(entry: VerificationEntry) -> str:
    """One line for people."""
    if entry.kind == "verified":
        found = "matches" if entry.matches else "does NOT match"
        return (
            f"step {entry.step}: {entry.by} verified {entry.subject}'s {entry.batch_id}: "
            f"{found} (score {entry.score:.3g})"
        )
    if entry.kind == "followed":
        found = "is" if entry.matches else "is NOT"
        return (
            f"step {entry.step}: {entry.by} followed {entry.subject}'s {entry.batch_id}: "
            f"the commitment {found} its exact rebuild"
        )
    credited = ", ".join(str(c) for c in entry.credited) or "nobody"
    return (
        f"step {entry.step}: {entry.subject} punished as {entry.role} for {entry.batch_id}: "
        f"slashed {entry.slashed}, {entry.credit} credited to {credited} ({entry.reason})"
    )


def _key(identity: NodeIdentity) -> str:
    return str(SoldersPubkey.from_bytes(identity.signer))


def entry_to_json(entry: VerificationEntry) -> dict[str, Any]:
    out: dict[str, Any] = {
        "step": entry.step,
        "kind": entry.kind,
        "subject": _key(entry.subject),
        "batch": str(entry.batch_id),
    }
    if entry.kind in ("verified", "followed"):
        out.update(by=_key(entry.by), matches=entry.matches, score=float(entry.score))
    else:
        out.update(
            role=entry.role,
            reason=entry.reason,
            slashed=entry.slashed,
            credited=[_key(c) for c in entry.credited],
            credit_each=entry.credit,
        )
    return out


def verification_to_json(value: RunVerification) -> dict[str, Any]:
    """`json-dump-run`'s `verification`: whether verifiers train too, who verifies whom in the kept rounds and what each
    reported (with each verifier's draw signature and the round's seed), the bans, and what
    verification did (oldest first)."""

    def duty(d: DutyRecord, role: str) -> dict[str, Any]:
        return {
            "batch": str(d.batch_id),
            "trainer": _key(d.trainer),
            "verifier": _key(d.verifier),
            "role": role,
        }

    return {
        "verifiers_train": value.verifiers_train,
        "exact_verification_threads": value.exact_verification_threads,
        # who follows whom in the kept rounds of a run that verifies exactly, what each said
        "following": [
            {
                "step": r.step,
                "batches": [
                    {
                        "batch": str(b.batch_id),
                        "trainer": _key(b.trainer),
                        "followers": [_key(f) for f in b.followers],
                    }
                    for b in r.batches
                ],
                "reports": {
                    _key(report.sender): [
                        {"batch": str(f.batch_id), "matches": bool(f.matches)}
                        for f in report.findings
                    ]
                    for report in r.reports
                },
            }
            for r in value.following
        ],
        "rounds": [
            {
                "step": r.step,
                "duties": [duty(d, "verifier") for d in r.verifier_duties]
                + [duty(d, "tie_breaker") for d in r.tie_breaker_duties],
                "reports": {
                    _key(report.sender): [
                        {"batch": str(f.batch_id), "matches": bool(f.matches), "score": f.score}
                        for f in report.findings
                    ]
                    for report in r.reports
                },
                # what a verifier's draw signed (`draw_message`) and its signature: anyone can
                # check that it checked what its own key drew
                "seed": r.seed.hex(),
                "draws": {
                    _key(report.sender): report.draw.hex()
                    for report in r.reports
                    if report.draw != NO_DRAW
                },
            }
            for r in value.rounds
        ],
        "bans": {
            str(SoldersPubkey.from_bytes(b.signer)): {
                "epoch": b.epoch,
                "epochs": b.epochs,
                "until_epoch": b.ban().until_epoch,
            }
            for b in value.bans
        },
        "log": [entry_to_json(e) for e in value.log],
    }


def finding_limit(findings: Sequence[Finding]) -> str | None:
    """Why a report's findings are refused before the rules see them (more than a round has
    batches), or None."""
    if len(findings) > MAX_FINDINGS:
        return f"{len(findings)} findings, more than the {MAX_FINDINGS} a round can have"
    return None


__all__ = [
    "RUN_VERIFICATION_SPACE",
    "BanRecord",
    "DecidedRecord",
    "DutyRecord",
    "FollowedBatch",
    "FollowedRound",
    "FollowerReportRecord",
    "ReportRecord",
    "RunVerification",
    "VerificationEntry",
    "VerifiedRound",
    "deciders",
    "draw_signer",
    "entry_line",
    "entry_to_json",
    "finding_limit",
    "findings_entries",
    "follow_deciders",
    "punishment",
    "verification_to_json",
]
