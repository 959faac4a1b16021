"""Exact verification (issue 27): followers that rebuild a trainer's payload bit for bit, what
they report and who loses. Pure rules, shared by the server (and anyone who checks it).

Why followers. A trainer's payload is not a function of the round alone: DisTrO's carries the
trainer's momentum, DiLoCo's its inner AdamW and residual, none of it published. So a round's
verifier (`psyche.coordinator.verification`) can only compare statistically, and a lie smaller
than honest results vary (a bias of 1 % of the update's norm in a fixed direction) passes. A
client that holds the trainer's own state from the moment it starts can keep it itself and
rebuild the payload bit for bit (`psyche.modeling.verification.Shadow` / `follow`): that client
is the trainer's **follower**. It must see every round the trainer trains, from the first.

When a trainer's state starts. With `CoordinatorConfig.exact_verification_threads > 0` (and
`verification_percent > 0`) every member starts each epoch from a fresh own optimizer state
(DisTrO momentum zero and nothing owed; a fresh DiLoCo inner AdamW, no residual: the client swaps
`Trainer.fresh_own_state` in at the epoch's first round), so a follower assigned at an epoch's
start knows the state of each trainer it follows. The cost to training is one momentum restart
per epoch (upstream restarts it at a cold start's first round).

Who follows whom (`followers`): fixed for an epoch, from values anyone can check: the epoch's
members (the current clients and those that left during the epoch, `exited_clients`: the same
set at every round of the epoch), sorted by key and shuffled with a seed from the run's id and
the epoch number (`FOLLOW_SALT`); in that ring each member is followed by the next
`FOLLOWERS_PER_TRAINER` (3, fewer only in an epoch of fewer members), so each member also
follows three. Every round a trainer trains (one batch: `data_selection` gives each trainer one
slice) its followers advance their shadow of it (`follow_duties`), whatever their own role.

Exactness needs one determinism class: the same device kind and dtype and, on the CPU, the same
intra-op thread count (a 20M Llama's gradients differ in the last bits between 1 and 2 threads).
The run fixes the count (`exact_verification_threads`: the client sets torch's intra-op threads
to it). A client that cannot compute in the run's class (not on the CPU, several ranks,
casting parameters or gradients to another dtype: `exact_class_problem`) refuses the run in one
line, before it loads the model, naming the run's setting: as a trainer its followers would
convict it though honest. (Following only members of one's own class would let a member that declares another
class escape being followed at all.) A follower that misses one of a trainer's rounds
(its batch not fetched, the round cut, the payload never announced) cannot rebuild the rest of
the epoch and stops reporting on it (statistical verification goes on).

What a follower reports (`FollowReport`): a `VerificationReport` whose draw is `FOLLOW_DRAW`
(64 bytes 0xff: never an Ed25519 signature, its scalar is above the group order), one per sender
and round, one `Finding` per batch it followed: `matches` whether the trainer's commitment is
the shadow's (`Commitment.data_hash`, the payload's `compute_hash`: every bit of its step, batch
and results), `score` 0 when they match and 1 when they differ (a follower compares hashes: it
does not download the payload to count bits).
The centralized protocol carries it as a verification report (no new message), and the server
keeps it apart from the round's verifier reports (`RoundFollowing`) and does not relay it.

Who loses (`resolve_following`), per followed batch. A trainer loses only when all of its
followers (`CONVICTING_WORDS`, 3) found its commitment differs and none found it equal; an
accuser loses when at least `MIN_FOLLOWER_WORDS` (2) found it equal and outnumber the accusers.
So an honest member is never convicted by fewer than three colluders: an honest trainer needs
its three followers all hostile, an honest follower (it accuses only a lying trainer) needs the
liar and two vouching followers. With two followers and "two words convict" (the rule first
wired), two hostile members that are both an honest trainer's followers would convict it: that
happens when the two are neighbours in the ring, in an epoch of n members with probability
2/(n-1) (2/3 at 4 members, 2/7 at 8), every epoch, and for certain to members that grind their
keys (the ring's seed is known in advance). Now: 0 with one or two hostile members; three
hostile ones all following one honest trainer, n/C(n,3) of epochs (1 at 4 members, 1/7 at 8).
The price: a lying trainer with one colluding follower (or one whose honest follower dropped
its shadow) is not convicted by its followers; the statistical verifiers still check it. An
epoch of three members (two followers each) convicts no trainer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.verification import (
    Finding,
    Resolution,
    RoundDuties,
    VerificationDuty,
    VerificationReport,
    findings_problem,
)
from psyche.core.batch_id import BatchId
from psyche.core.deterministic_shuffle import deterministic_shuffle
from psyche.core.identity import SIGNATURE_LEN
from psyche.core.node_identity import NodeIdentity
from psyche.core.sha256 import sha256v

FOLLOW_SALT = b"psyche-following"
FOLLOWERS_PER_TRAINER = 3
"""Followers each trainer has in an epoch of more than three members."""
CONVICTING_WORDS = FOLLOWERS_PER_TRAINER
"""Accusations a trainer's conviction needs, with no follower vouching for it: all of its
followers. Two colluding members can never convict an honest trainer (it has three followers;
at most two are theirs), however the ring falls or they grind their keys to place themselves."""
MIN_FOLLOWER_WORDS = 2
"""Vouchers it takes to punish the followers that accused a trainer (who must be outnumbered):
an honest follower accuses only a lying trainer, so punishing it takes that trainer and two
vouching followers, three colluders."""
FOLLOW_DRAW = b"\xff" * SIGNATURE_LEN
"""The draw of a follower's report: no Ed25519 signature (its scalar is not below the order)."""

FollowReport = VerificationReport
"""A follower's report: a `VerificationReport` whose draw is `FOLLOW_DRAW`."""


def is_follow_report(report: VerificationReport) -> bool:
    return bytes(report.draw) == FOLLOW_DRAW


def exact_verification_on(coordinator: Coordinator) -> bool:
    """Whether the run verifies exactly (followers), by its config."""
    config = coordinator.config
    return config.verification_percent != 0 and config.exact_verification_threads > 0


EXACT_DEVICE_TYPE = "cpu"
"""The one device kind exact verification rebuilds on (its determinism class: the CPU, the
model's own dtype, `exact_verification_threads` intra-op threads)."""


def exact_class_problem(
    coordinator: Coordinator, device_type: str, options: Sequence[str] = ()
) -> str | None:
    """Why a client computing on `device_type` (torch's `device.type`), with `options` (those
    by which it computes otherwise than one rank in the model's dtype: "--param-dtype bf16",
    "2 ranks (--dp 2 --tp 1)"), cannot be a member of this run, or None.

    A run that verifies exactly convicts a trainer whose commitment its followers (all in the
    run's class: the CPU, one rank, the model's dtype, `exact_verification_threads` threads) do
    not rebuild bit for bit, so a member outside that class would be convicted though honest.
    Such a client refuses the run (one line, the run's setting named) instead of joining it:
    no honest member is ever rebuilt in a class it does not compute in."""
    if not exact_verification_on(coordinator):
        return None
    threads = coordinator.config.exact_verification_threads
    why = (
        f"this client computes on {device_type} (--device cpu to join it)"
        if device_type != EXACT_DEVICE_TYPE
        else f"this client computes with {', '.join(options)} (leave it out to join)"
        if options
        else None
    )
    if why is None:
        return None
    return (
        f"this run verifies exactly (config.exact_verification_threads = {threads}): each "
        f"member's followers rebuild its results bit for bit on the CPU in the model's dtype, "
        f"and {why}"
    )


def follow_seed(run_id: str, epoch: int) -> int:
    """The u64 that orders an epoch's members into the followers' ring."""
    name = run_id.encode()
    parts = (len(name).to_bytes(4, "little"), name, epoch.to_bytes(8, "little"), FOLLOW_SALT)
    return int.from_bytes(sha256v(parts)[:8], "little")


def followers(
    run_id: str,
    epoch: int,
    members: Iterable[NodeIdentity],
    per_trainer: int = FOLLOWERS_PER_TRAINER,
) -> dict[NodeIdentity, tuple[NodeIdentity, ...]]:
    """Each member's followers in epoch `epoch` of run `run_id` (see the module docstring): the
    next `per_trainer` members after it in the epoch's ring (fewer in a smaller epoch; none
    alone). The order of `members` does not matter."""
    ring = sorted(set(members), key=lambda node: bytes(node.signer))
    deterministic_shuffle(ring, follow_seed(run_id, epoch))
    count = min(per_trainer, len(ring) - 1)
    return {
        node: tuple(ring[(i + k) % len(ring)] for k in range(1, count + 1))
        for i, node in enumerate(ring)
    }


def epoch_members(coordinator: Coordinator) -> list[NodeIdentity]:
    """The epoch's members: its clients now and those that left it (the same at every round)."""
    state = coordinator.epoch_state
    return [c.id for c in (*state.clients, *state.exited_clients)]


def followers_for_state(coordinator: Coordinator) -> dict[NodeIdentity, tuple[NodeIdentity, ...]]:
    """The current epoch's followers (empty unless the run verifies exactly)."""
    if not exact_verification_on(coordinator):
        return {}
    return followers(coordinator.run_id, coordinator.progress.epoch, epoch_members(coordinator))


def follow_duties(
    following: Mapping[NodeIdentity, Sequence[NodeIdentity]],
    assignments: Mapping[BatchId, NodeIdentity],
) -> tuple[VerificationDuty, ...]:
    """Every follower's duty in a round (by batch, ascending; its followers in ring order): for each batch, each of its trainer's
    followers (the duty's `verifier`) advances its shadow and compares."""
    return tuple(
        VerificationDuty(batch, trainer, follower)
        for batch, trainer in sorted(assignments.items())
        for follower in following.get(trainer, ())
    )


def round_following(coordinator: Coordinator, duties: RoundDuties) -> RoundFollowing | None:
    """What the server and the Solana program record when a round starts: its followers'
    duties (`follow_duties` of the epoch's ring and the round's batches, no report yet), or None
    where the run does not verify exactly or the round assigned no batch."""
    following = followers_for_state(coordinator)
    if not following or not duties.assigned:
        return None
    return RoundFollowing(duties.step, follow_duties(following, dict(duties.assigned)))


def check_follow_report(
    step: int,
    duties: Sequence[VerificationDuty],
    sender: NodeIdentity,
    report: VerificationReport,
) -> str | None:
    """Why a follower's `report` is refused, or None: about round `step`, only batches whose
    trainer `sender` follows, each once, finite scores."""
    if not is_follow_report(report):
        return "not a follower's report"
    if report.step != step:
        return f"about step {report.step}, not {step}"
    own = {d.batch_id for d in duties if d.verifier == sender}
    if not own:
        return f"{sender} follows no trainer of step {step}"
    return findings_problem(report, own, "whose trainer it does not follow")


def resolve_following(
    step: int,
    duties: Sequence[VerificationDuty],
    reports: Iterable[tuple[NodeIdentity, VerificationReport]],
) -> list[Resolution]:
    """Who loses, from checked follower reports (see the module docstring), by batch."""
    trainer_of = {d.batch_id: d.trainer for d in duties}
    words: dict[BatchId, list[tuple[NodeIdentity, Finding]]] = {}
    for sender, report in reports:
        for finding in report.findings:
            words.setdefault(finding.batch_id, []).append((sender, finding))
    out: list[Resolution] = []
    for batch in sorted(words):
        said = words[batch]
        wrong = [(s, f) for s, f in said if not f.matches]
        right = [(s, f) for s, f in said if f.matches]
        trainer = trainer_of[batch]
        if len(wrong) >= CONVICTING_WORDS and not right:
            out.append(
                Resolution(
                    step,
                    batch,
                    trainer,
                    "trainer",
                    f"its commitment for {batch} at step {step} is not what {len(wrong)} of "
                    f"{len(said)} followers rebuilt bit for bit",
                )
            )
            continue  # none vouched for it: nobody else loses
        if len(right) < MIN_FOLLOWER_WORDS or len(right) <= len(wrong):
            continue
        for follower, _ in wrong:  # outnumbered by followers that rebuilt it the same
            out.append(
                Resolution(
                    step,
                    batch,
                    follower,
                    "follower",
                    f"it accused {trainer}'s commitment for {batch} at step {step} against "
                    f"{len(right)} of {len(said)} followers' exact rebuilds",
                )
            )
    return out


@dataclass
class RoundFollowing:
    """The follower reports of one round received so far (one per sender), and what was
    decided; `duties` from `follow_duties` when the round started."""

    step: int
    duties: tuple[VerificationDuty, ...]
    reports: dict[NodeIdentity, VerificationReport] = field(default_factory=dict)
    decided: set[tuple[BatchId, NodeIdentity]] = field(default_factory=set)

    def add(self, sender: NodeIdentity, report: VerificationReport) -> str | None:
        """Record `report`; why it is refused (a second one, `check_follow_report`), or None."""
        if sender in self.reports:
            return "a second follower report for the round"
        problem = check_follow_report(self.step, self.duties, sender, report)
        if problem is None:
            self.reports[sender] = report
        return problem

    def resolve(self) -> list[Resolution]:
        """The decisions the reports so far allow that were not made before."""
        new = [
            r
            for r in resolve_following(self.step, self.duties, self.reports.items())
            if (r.batch_id, r.loser) not in self.decided
        ]
        self.decided.update((r.batch_id, r.loser) for r in new)
        return new


__all__ = [
    "CONVICTING_WORDS",
    "EXACT_DEVICE_TYPE",
    "FOLLOWERS_PER_TRAINER",
    "FOLLOW_DRAW",
    "FOLLOW_SALT",
    "MIN_FOLLOWER_WORDS",
    "FollowReport",
    "RoundFollowing",
    "check_follow_report",
    "epoch_members",
    "exact_class_problem",
    "exact_verification_on",
    "follow_duties",
    "follow_seed",
    "followers",
    "followers_for_state",
    "is_follow_report",
    "resolve_following",
    "round_following",
]
