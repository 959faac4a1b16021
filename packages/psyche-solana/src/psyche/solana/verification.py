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

Economics (`punishment`): the loser is slashed `slashing_rate_per_client` of the epoch's rates
(the treasurer's `run_update` sets it, as upstream) at once, and that amount is credited, in
`earned` points, to the members whose findings decided against it (shared equally, the
remainder unpaid): no point is created. Upstream's own slashing path (an `Ejected` client
slashed at the epoch's end) is not used: nothing upstream ejects, and its end-of-epoch walk
pairs exited clients with the run's clients in order, which a client removed out of order misses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

from solders.pubkey import Pubkey as SoldersPubkey

from psyche.coordinator.config import CoordinatorConfig
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
from psyche.core.serde import F32, U8, U64, FixedBytes, FixedStr, struct
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
    `batch_id` matching or not, with `score`) or "punished" (`subject` lost as `role`: slashed
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

    SEEDS_PREFIX = b"verification"

    def apply_to(self, config: CoordinatorConfig) -> None:
        """Put the run's `verifiers_train` on `config` (read from the coordinator account, which
        cannot hold it): what the program does before every instruction of a verifying run and
        a client on every state it follows."""
        config.verifiers_train = self.verifiers_train

    def round(self, step: int) -> VerifiedRound | None:
        return next((r for r in self.rounds if r.step == step), None)

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
    entry += 8 + 4 + (1 + VERIFICATION_TIE_BREAKERS) * identity + 8
    bans = MAX_FINDINGS * (32 + 16)
    log = 4 + VERIFICATION_LOG_LEN * entry
    return 8 + 1 + 32 + 4 + VERIFIED_ROUNDS * round_ + 4 + bans + log + 1  # + verifiers_train


RUN_VERIFICATION_SPACE = _space()


# --------------------------------------------------------------------------------------------
# What the program does with a report (pure: the program applies it to the accounts)


def findings_entries(
    record: RoundVerification, sender: NodeIdentity, report: VerificationReport
) -> list[VerificationEntry]:
    """The "verified" entries of an accepted report."""
    trainers = record.duties.trainers()
    return [
        VerificationEntry(
            report.step,
            "verified",
            trainers[f.batch_id],
            f.batch_id,
            sender,
            bool(f.matches),
            float(f.score),
        )
        for f in report.findings
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
    record: RoundVerification, resolution: Resolution, slashing_rate: int
) -> VerificationEntry:
    """The "punished" entry of `resolution`: the loser slashed `slashing_rate`, shared equally
    by `deciders` (the remainder is nobody's)."""
    credited = deciders(record, resolution)
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
    if entry.kind == "verified":
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
    "punishment",
    "verification_to_json",
]
