"""Verifiers and tie-breakers (the book's third duty): who recomputes whose result, what they
report, and who loses a dispute. Pure functions; upstream stops at electing the committees.

With `verification_percent > 0` every round is started with `VERIFICATION_TIE_BREAKERS`
tie-breaker tasks (`tie_breaker_tasks_for`, the round's existing `tie_breaker_tasks` field,
always 0 upstream), so `CommitteeSelection` elects one tie-breaker, `ceil((n - 1) *
verification_percent / 100)` verifiers (`verifier_nodes_for`: upstream rounds down, which elects
no verifier in 4 clients at 25 %; the two agree at 0 and on every upstream test vector) and
trainers for the rest. Neither verifiers nor
tie-breakers train (`data_selection`), unless the run's `verifiers_train` is on: then they
also train a share (every client does, as without verification), a verifier recomputes its draw
after its own training (`psyche.client.round.verify`), a tie-breaker's own batch is in no pool and
a verifier's is dealt to another verifier (`verification_duties`). At 0 nothing changes: no
tie-breaker, no verifier.

Who may verify whom (`verification_duties`), from the round's seed, so anyone can check it: the
round's batches (ascending) are shuffled with a seed derived from the committee seed and the salt
"verification" and dealt round-robin to the verifiers in client-index order: each verifier's
**pool**. Which `VERIFIED_BATCHES_PER_VERIFIER` (2) of its pool a verifier checks is its
**draw** (`draw_batches`), known to nobody but it until its report: the pool shuffled with a
seed from its own Ed25519 signature (p2p key) of `draw_message` (the run's id, the round's
committee seed, its step and the verifier's pool: a draw of one run or round is refused in any
other, and reveals nothing about another). An honest verifier signs deterministically (RFC
8032: one draw a round); a signature is no VRF, so a hostile one could grind nonces for the draw
it likes, which gains it nothing that a false report about its draw does not. The report
carries the signature
(`VerificationReport.draw`) and `check_report` refuses one whose signature does not verify or
that names a batch outside the draw. So a trainer cannot know
before it commits whether its batch is checked (a draw from the committee seed alone, as before,
let a trainer lie only in rounds where it was not drawn). A pool of at most 2 batches is checked
whole, without a signature (there is nothing to choose). Every checked batch is recomputed by
exactly one verifier, each verifier recomputes at most 2 (each the other's decoy, so checking
two costs what checking one does: two recomputes). A round checks `min(trainers' batches, 2 x
verifiers)` batches: all of them while verifiers are at least half as many as trainers (4
clients at 25 %), and a drawn share of them otherwise (at 10 %, about 2 in 9 a round), so that a
verifier's work stays within a round (docs/reliability.md, "recompute and punish": coverage
against cost).

The tie-breakers (`tie_breaker_duties`) are the arbiters of the round's pooled batches, but they
recompute only the **disputed** ones (a verifier's finding `matches = False`: `RoundVerification.
disputed`), and only in the **next** round: a tie-breaker of round N keeps one copy of the weights
round N trained from (`psyche.client.round.verify`: only on the tie-breaker, at most one copy,
dropped once round N's disputes are known), and after the next round's verifier reports are in
(they arrive during round N's witness phase) recomputes each disputed batch and its decoy from
that copy. A round without a dispute costs it one copy of the weights; a dispute two recomputes.
So the decision lands one round after the lie: `RoundVerification.add` hears a tie-breaker only
about batches a verifier of the round disputed (it is what makes the cost bounded: a tie-breaker
cannot be made, nor claim, to arbitrate more), and `VERIFIED_ROUNDS` keeps a round's record
while its tie-breakers may still report.

What they report (`VerificationReport`): one message per sender and round, naming for each batch
it recomputed whether its recomputation matched the published result, and the evidence score (the comparison's distance). A verifier's non-matching finding is an accusation.
`check_report` bounds it: only a round's verifier or tie-breaker, only its own duties (a
verifier's: its draw), each once, finite scores, at most one report per sender and round
(`RoundVerification.add`).

Who loses (`resolve`): the tie-breakers decide, by majority of those that recomputed the batch
(ties: no decision). A trainer whose result the tie-breakers found wrong loses; a verifier that
accused a result the tie-breakers found right loses. A batch no tie-breaker reported on is not
decided (nobody is punished on one client's word).

This comparison is statistical (a trainer's payload carries optimizer state nobody else holds);
exact verification, where each trainer's followers rebuild its commitment bit for bit, is
`psyche.coordinator.following` (opt-in: `exact_verification_threads`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated

from psyche.coordinator.committee_selection import (
    Committee,
    CommitteeSelection,
    Member,
    verifier_nodes_for,
)
from psyche.coordinator.config import SOLANA_MAX_NUM_CLIENTS, CoordinatorConfig
from psyche.core.batch_id import BatchId
from psyche.core.deterministic_shuffle import deterministic_shuffle
from psyche.core.identity import SIGNATURE_LEN, verify_signature
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import F32, U32, FixedBytes, FixedVec, SmallBool, struct
from psyche.core.sha256 import sha256v

VERIFICATION_SALT = b"verification"
VERIFICATION_TIE_BREAKERS = 1
"""Tie-breakers per round of a run with `verification_percent > 0` (the arbiter of disputes)."""
VERIFIED_BATCHES_PER_VERIFIER = 2
"""Batches a verifier checks a round (its draw says which): two, each the other's decoy."""
DRAW_DOMAIN = b"psyche-verification-draw"
"""What a verifier's draw signature signs first (no other message of the protocol starts so)."""
DRAW_MESSAGE_LEN = len(DRAW_DOMAIN) + 32
"""Bytes of a draw message (`draw_message`: the domain and a SHA-256)."""

SignatureCheck = Callable[[bytes, bytes, bytes], bool]
"""Whether `signature` is `public_key`'s Ed25519 signature of `message` (public key, message,
signature): `verify_signature` everywhere but in the Solana program, which has no ed25519 call
and reads what the transaction's `Ed25519SigVerify` instruction verified."""
ROUND_SEED_LEN = 32
"""Bytes of a round's committee seed (`CommitteeSelection.get_seed`, a SHA-256)."""
NO_DRAW = bytes(SIGNATURE_LEN)
"""The draw of a report that needs none (a tie-breaker's, a pool checked whole)."""
MAX_FINDINGS = SOLANA_MAX_NUM_CLIENTS
"""A report names at most one finding per batch, and a round has at most one batch per client."""


def tie_breaker_tasks_for(config: CoordinatorConfig, num_clients: int) -> int:
    """The `tie_breaker_tasks` a round starts with: 0 (upstream) unless verification is on."""
    if config.verification_percent == 0:
        return 0
    return min(VERIFICATION_TIE_BREAKERS, num_clients)


def verifiers_for(config: CoordinatorConfig, num_clients: int) -> int:
    """How many verifiers `CommitteeSelection` elects in a round of `num_clients` clients."""
    free = num_clients - tie_breaker_tasks_for(config, num_clients)
    return verifier_nodes_for(free, config.verification_percent)


def verification_problem(config: CoordinatorConfig) -> tuple[str, str] | None:
    """Why a run cannot honour its `verification_percent` (config field, message), or None:
    with its fewest clients (`min_clients`), one tie-breaker aside, it must elect a verifier
    and keep a trainer (more clients only add trainers and verifiers, in that proportion)."""
    percent = config.verification_percent
    if percent == 0 or percent > 100:
        return None  # off, or refused as out of range elsewhere
    least = config.min_clients
    if _runnable(percent, least):
        return None
    ties = tie_breaker_tasks_for(config, least)
    found = "elects no verifier" if least <= ties else "leaves no trainer"
    fixes = []
    lower = max((p for p in range(1, percent) if _runnable(p, least)), default=None)
    if lower is not None:
        fixes.append(f"lower it to at most {lower}")
    enough = next((n for n in range(least, MAX_FINDINGS + 1) if _runnable(percent, n)), None)
    if enough is not None:
        fixes.append(f"raise min_clients to at least {enough}")
    return (
        "config.verification_percent",
        f"{percent} % of min_clients ({least}) less the {ties} tie-breaker {found}: "
        + (" or ".join(fixes) or "lower it and raise min_clients (3 clients run 50 %)"),
    )


def _runnable(percent: int, clients: int) -> bool:
    """Whether a round of `clients` at `percent` elects a tie-breaker, a verifier and a trainer."""
    free = clients - VERIFICATION_TIE_BREAKERS
    verifiers = verifier_nodes_for(max(free, 0), percent)
    return verifiers > 0 and free - verifiers > 0


# --------------------------------------------------------------------------------------------
# Duties


@dataclass(frozen=True, order=True)
class VerificationDuty:
    """`verifier` recomputes the result `trainer` published for `batch_id`."""

    batch_id: BatchId
    trainer: NodeIdentity
    verifier: NodeIdentity


def _members(
    clients: Sequence[Member], selection: CommitteeSelection, committee: Committee
) -> list[NodeIdentity]:
    if selection.everyone_trains():
        return []
    return [
        client.id
        for index, client in enumerate(clients[: selection.total_nodes])
        if selection.get_committee(index).committee is committee
    ]


def verification_seed(selection: CommitteeSelection) -> int:
    """The u64 that orders the round's batches for dealing (from the committee seed)."""
    return int.from_bytes(sha256v((selection.get_seed(), VERIFICATION_SALT))[:8], "little")


def verification_duties(
    clients: Sequence[Member],
    selection: CommitteeSelection,
    assignments: Mapping[BatchId, NodeIdentity],
) -> list[VerificationDuty]:
    """Every verifier's pool in the round (see the module docstring), in dealing order: every
    batch of the round, each in one pool.

    Where verifiers and the tie-breaker train too (`CoordinatorConfig.verifiers_train`), a
    tie-breaker's batch is in no pool (it would arbitrate its own result), and a verifier's is
    dealt to the next verifier instead of itself (none where it is the only verifier). Where only
    trainers hold batches (the default), this is the plain round-robin deal."""
    verifiers = _members(clients, selection, Committee.Verifier)
    if not verifiers:
        return []
    tie_breakers = set(_members(clients, selection, Committee.TieBreaker))
    batches = list(assignments)
    deterministic_shuffle(batches, verification_seed(selection))
    duties = []
    turn = 0
    for batch in batches:
        trainer = assignments[batch]
        if trainer in tie_breakers:
            continue
        if verifiers[turn % len(verifiers)] == trainer:
            turn += 1  # nobody checks its own batch
            if verifiers[turn % len(verifiers)] == trainer:
                continue  # the only verifier's own batch
        duties.append(VerificationDuty(batch, trainer, verifiers[turn % len(verifiers)]))
        turn += 1
    return duties


def draw_message(run_id: str, seed: bytes, step: int, pool: Sequence[VerificationDuty]) -> bytes:
    """What a verifier signs for its draw in round `step` of run `run_id`, whose committee seed
    is `seed` (`CommitteeSelection.get_seed`): the run, the seed, the step and its pool
    (ascending: each batch and its trainer), so a signature is good for one round of one run
    and one pool only. Without the run and the seed, the same members with the same pool at the
    same step (another run of theirs, or a round started again with a new seed) would sign the
    same message: the draw revealed there would be known to a trainer here before it commits,
    and replaying it would be accepted. Variable-length parts are length-prefixed (no two
    different tuples give the same bytes). The domain is followed by the SHA-256 of those parts
    (since 2026-11-28), so the message is `DRAW_MESSAGE_LEN` bytes whatever the pool: a Solana
    transaction carries it whole in its `Ed25519SigVerify` instruction (1232 bytes a
    transaction: a pool of 12 batches spelled out would not fit)."""
    name = run_id.encode()
    parts = [
        len(name).to_bytes(4, "little"),
        name,
        len(seed).to_bytes(4, "little"),
        bytes(seed),
        step.to_bytes(8, "little"),
    ]
    for duty in sorted(pool):
        parts += [
            duty.batch_id.start.to_bytes(8, "little"),
            duty.batch_id.end.to_bytes(8, "little"),
            duty.trainer.signer,
        ]
    return DRAW_DOMAIN + sha256v(parts)


def draw_batches(pool: Sequence[VerificationDuty], draw: bytes) -> list[VerificationDuty]:
    """The duties of `pool` a verifier whose draw signature is `draw` checks (ascending): the
    pool whole when it holds at most `VERIFIED_BATCHES_PER_VERIFIER`, else that many of it,
    shuffled with a seed from the signature (unchecked here: `RoundDuties.drawn` checks it)."""
    ordered = sorted(pool)
    if len(ordered) <= VERIFIED_BATCHES_PER_VERIFIER:
        return ordered
    seed = int.from_bytes(sha256v((bytes(draw), VERIFICATION_SALT))[:8], "little")
    deterministic_shuffle(ordered, seed)
    return sorted(ordered[:VERIFIED_BATCHES_PER_VERIFIER])


def tie_breaker_duties(
    clients: Sequence[Member],
    selection: CommitteeSelection,
    assignments: Mapping[BatchId, NodeIdentity],
) -> list[VerificationDuty]:
    """Every batch in the round's verifiers' pools (ascending), for every tie-breaker: what it
    may be asked to arbitrate (it recomputes only the disputed ones, in the next round)."""
    checked = sorted(d.batch_id for d in verification_duties(clients, selection, assignments))
    return [
        VerificationDuty(batch, assignments[batch], tie_breaker)
        for tie_breaker in _members(clients, selection, Committee.TieBreaker)
        for batch in checked
    ]


@dataclass(frozen=True)
class RoundDuties:
    """Who recomputes what in one round (`step`), as every client and the server derive it."""

    step: int
    verifiers: tuple[VerificationDuty, ...]
    tie_breakers: tuple[VerificationDuty, ...]
    assigned: tuple[tuple[BatchId, NodeIdentity], ...] = ()
    """Every batch of the round and its trainer, checked or not (where a decoy comes from)."""
    run_id: str = ""
    """The run's id (`Coordinator.run_id`): part of every draw message (`draw_message`)."""
    seed: bytes = bytes(ROUND_SEED_LEN)
    """The round's committee seed (`CommitteeSelection.get_seed`): part of every draw message.
    The defaults serve only duties without a verifier (nothing is drawn); `round_duties` and
    the Solana account's read-back always set both."""

    def of(self, node: NodeIdentity) -> list[VerificationDuty]:
        """`node`'s duties, as verifier (its pool) or as tie-breaker (one of the two, or none)."""
        return [d for d in (*self.verifiers, *self.tie_breakers) if d.verifier == node]

    def pool(self, node: NodeIdentity) -> list[VerificationDuty]:
        """The batches verifier `node` may be drawn to check (ascending; none if no verifier)."""
        return sorted(d for d in self.verifiers if d.verifier == node)

    def draw_message(self, node: NodeIdentity) -> bytes:
        """What verifier `node` signs for its draw this round (`draw_message`)."""
        return draw_message(self.run_id, self.seed, self.step, self.pool(node))

    def drawn(
        self, node: NodeIdentity, draw: bytes, verify: SignatureCheck = verify_signature
    ) -> list[VerificationDuty] | None:
        """The duties verifier `node` checks with draw signature `draw`, or None when the pool
        needs a draw and `draw` is not the signature of `draw_message` by `node`'s p2p key
        (the key of the round's member, whatever identity the caller holds), as `verify`
        decides."""
        pool = self.pool(node)
        if len(pool) > VERIFIED_BATCHES_PER_VERIFIER:
            key = pool[0].verifier.p2p_identity
            if not verify(key, self.draw_message(node), bytes(draw)):
                return None
        return draw_batches(pool, draw)

    def checks(
        self, node: NodeIdentity, sign: Callable[[bytes], bytes] | None
    ) -> tuple[list[VerificationDuty], bytes] | None:
        """What `node` checks this round and the draw its report carries: a tie-breaker's
        duties (no draw); a verifier's pool whole when it is small enough, else the batches
        its signature (`sign`, its p2p key's) of `draw_message` draws. None: a verifier whose
        pool needs a draw, without `sign`."""
        if self.is_tie_breaker(node):
            return self.of(node), NO_DRAW
        pool = self.pool(node)
        if len(pool) <= VERIFIED_BATCHES_PER_VERIFIER:
            return pool, NO_DRAW
        if sign is None:
            return None
        draw = sign(self.draw_message(node))
        return draw_batches(pool, draw), draw

    def trainers(self) -> dict[BatchId, NodeIdentity]:
        """Who trained each batch under verification (the checked ones)."""
        return {d.batch_id: d.trainer for d in (*self.verifiers, *self.tie_breakers)}

    def is_tie_breaker(self, node: NodeIdentity) -> bool:
        return any(d.verifier == node for d in self.tie_breakers)


def round_duties(
    step: int,
    clients: Sequence[Member],
    selection: CommitteeSelection,
    assignments: Mapping[BatchId, NodeIdentity],
    *,
    run_id: str,
) -> RoundDuties:
    """Who recomputes what in round `step` of run `run_id` (its draws bound to both)."""
    return RoundDuties(
        step,
        tuple(verification_duties(clients, selection, assignments)),
        tuple(tie_breaker_duties(clients, selection, assignments)),
        tuple(sorted(assignments.items())),
        run_id=run_id,
        seed=selection.get_seed(),
    )


# --------------------------------------------------------------------------------------------
# Reports


@struct(frozen=True)
class Finding:
    """One recomputed batch: whether the recomputation matched the result its trainer published
    (the round's assignment names the trainer), and the comparison's score (its distance; what a
    tolerance is measured against)."""

    batch_id: BatchId
    matches: SmallBool
    score: F32


@struct(frozen=True)
class VerificationReport:
    """What a verifier or tie-breaker found in round `step` (sent once per round; the sender is
    the authenticated connection's key). A verifier's `matches = False` is an accusation."""

    step: U32
    findings: Annotated[list[Finding], FixedVec(MAX_FINDINGS)]
    draw: Annotated[bytes, FixedBytes(SIGNATURE_LEN)] = NO_DRAW
    """A verifier's signature of its round's `draw_message` (which batches it checked)."""

    def accusations(self) -> list[Finding]:
        return [f for f in self.findings if not f.matches]


def check_report(
    duties: RoundDuties,
    sender: NodeIdentity,
    report: VerificationReport,
    verify: SignatureCheck = verify_signature,
) -> str | None:
    """Why `report` from `sender` is refused, or None: it must be about `duties`' round, from one
    of its verifiers or tie-breakers, name only that sender's duties (a verifier's: the batches
    its draw signature draws, `RoundDuties.drawn`), each at most once, with finite scores."""
    if report.step != duties.step:
        return f"about step {report.step}, not {duties.step}"
    if not duties.of(sender):
        return f"{sender} is no verifier or tie-breaker of step {duties.step}"
    if duties.is_tie_breaker(sender):
        own = {d.batch_id for d in duties.of(sender)}
    else:
        drawn = duties.drawn(sender, report.draw, verify)
        if drawn is None:
            return f"its draw is not its signature of step {duties.step}'s draw"
        own = {d.batch_id for d in drawn}
    return findings_problem(report, own, "not among its duties")


def findings_problem(
    report: VerificationReport, own: Collection[BatchId], not_own: str
) -> str | None:
    """Why `report`'s findings are refused, or None: each names one of `own` (else
    `not_own` says why), at most once, with a finite score. Shared by the verifiers' and the
    followers' reports."""
    seen: set[BatchId] = set()
    for finding in report.findings:
        if finding.batch_id not in own:
            return f"names {finding.batch_id}, {not_own}"
        if finding.batch_id in seen:
            return f"names {finding.batch_id} twice"
        if not math.isfinite(finding.score):
            return f"a non-finite score for {finding.batch_id}"
        seen.add(finding.batch_id)
    return None


# --------------------------------------------------------------------------------------------
# Resolution


@dataclass(frozen=True)
class Resolution:
    """A decided dispute (or a wrong result a tie-breaker found): `loser` is removed and banned."""

    step: int
    batch_id: BatchId
    loser: NodeIdentity
    role: str  # "trainer" or "verifier"
    reason: str


@dataclass
class RoundVerification:
    """The reports of one round received so far (at most one per sender), and what was decided."""

    duties: RoundDuties
    reports: dict[NodeIdentity, VerificationReport] = field(default_factory=dict)
    decided: set[tuple[BatchId, NodeIdentity]] = field(default_factory=set)

    @classmethod
    def heard(
        cls, duties: RoundDuties, reports: Mapping[NodeIdentity, VerificationReport]
    ) -> tuple[RoundVerification, list[tuple[NodeIdentity, str]]]:
        """The record a reader builds from reports it read back (from the server or a Solana
        account), and those it refused (sender, why): each heard under the same rule the
        coordinator applied (`add`: a draw that is not its verifier's signature of this run's
        and round's draw message, say, is left out), the verifiers' reports before the
        tie-breakers'. A reader need not trust what relayed them, and a report stored without
        its draw is not heard."""
        record = cls(duties)
        refused: list[tuple[NodeIdentity, str]] = []
        ordered = sorted(reports.items(), key=lambda item: duties.is_tie_breaker(item[0]))
        for sender, report in ordered:
            problem = record.add(sender, report)
            if problem is not None:
                refused.append((sender, problem))
        return record, refused

    def add(
        self,
        sender: NodeIdentity,
        report: VerificationReport,
        verify: SignatureCheck = verify_signature,
    ) -> str | None:
        """Record `report`; why it is refused (a second report, `check_report` with `verify`,
        or a tie-breaker's finding about a batch no verifier disputed), or None."""
        if sender in self.reports:
            return "a second report for the round"
        problem = check_report(self.duties, sender, report, verify)
        if problem is None and self.duties.is_tie_breaker(sender):
            disputed = set(self.disputed())
            undisputed = next((f for f in report.findings if f.batch_id not in disputed), None)
            if undisputed is not None:
                problem = f"names {undisputed.batch_id}, which no verifier disputed"
        if problem is None:
            self.reports[sender] = report
        return problem

    def disputed(self) -> list[BatchId]:
        """The batches a verifier's report accused (ascending): what the tie-breakers
        recompute, in the next round."""
        return sorted(
            {
                f.batch_id
                for sender, report in self.reports.items()
                if not self.duties.is_tie_breaker(sender)
                for f in report.accusations()
            }
        )

    def awaited(self) -> list[NodeIdentity]:
        """The round's verifiers whose report has not arrived (a tie-breaker waits for them,
        briefly, before it decides there is no dispute)."""
        verifiers = dict.fromkeys(d.verifier for d in self.duties.verifiers)
        return [v for v in verifiers if v not in self.reports]

    def resolve(self) -> list[Resolution]:
        """The decisions the reports received so far allow that were not made before."""
        new = [
            r
            for r in resolve(self.duties, self.reports.items())
            if (r.batch_id, r.loser) not in self.decided
        ]
        self.decided.update((r.batch_id, r.loser) for r in new)
        return new


def resolve(
    duties: RoundDuties, reports: Iterable[tuple[NodeIdentity, VerificationReport]]
) -> list[Resolution]:
    """Who loses, from checked reports (see the module docstring), ordered by batch."""
    tie_votes: dict[BatchId, list[bool]] = {}
    accusers: dict[BatchId, list[tuple[NodeIdentity, Finding]]] = {}
    trainer_of = duties.trainers()
    for sender, report in reports:
        tie_breaker = duties.is_tie_breaker(sender)
        for finding in report.findings:
            if tie_breaker:
                tie_votes.setdefault(finding.batch_id, []).append(bool(finding.matches))
            elif not finding.matches:
                accusers.setdefault(finding.batch_id, []).append((sender, finding))
    out: list[Resolution] = []
    for batch in sorted(tie_votes):
        votes = tie_votes[batch]
        wrong, right = votes.count(False), votes.count(True)
        if wrong > right:
            out.append(
                Resolution(
                    duties.step,
                    batch,
                    trainer_of[batch],
                    "trainer",
                    f"its result for {batch} at step {duties.step} does not match the "
                    f"recomputation of {wrong} of {len(votes)} tie-breakers",
                )
            )
        elif right > wrong:
            for accuser, finding in accusers.get(batch, []):
                out.append(
                    Resolution(
                        duties.step,
                        batch,
                        accuser,
                        "verifier",
                        f"it accused {trainer_of[batch]} of a wrong result for {batch} at step "
                        f"{duties.step} (score {finding.score:.3g}); {right} of {len(votes)} "
                        "tie-breakers found the result right",
                    )
                )
    return out


__all__ = [
    "DRAW_DOMAIN",
    "DRAW_MESSAGE_LEN",
    "MAX_FINDINGS",
    "NO_DRAW",
    "ROUND_SEED_LEN",
    "VERIFICATION_SALT",
    "VERIFICATION_TIE_BREAKERS",
    "VERIFIED_BATCHES_PER_VERIFIER",
    "Finding",
    "Resolution",
    "RoundDuties",
    "RoundVerification",
    "SignatureCheck",
    "VerificationDuty",
    "VerificationReport",
    "check_report",
    "draw_batches",
    "draw_message",
    "resolve",
    "round_duties",
    "tie_breaker_duties",
    "tie_breaker_tasks_for",
    "verification_duties",
    "verification_problem",
    "verification_seed",
    "verifiers_for",
]
