"""A witness's checks of a peer's result before it attests it (a port extension).

Upstream's witness attests every result whose bytes hash to their commitment, so a member with
a valid key can send a well-formed but poisoned update and every client applies it. Here a
witness first compares each decoded result with what it knows of the run:

* **agreement**: the first-order effect of the result along the witness's own estimate of the
  descent direction, one gather and dot product per result. The direction is the witness's own
  update of that round as it compressed it (DisTrO: its momentum as `generate` left it; DiLoCo:
  its pseudo-gradient plus its error-feedback residual), plus the results it accepted in recent
  rounds (decayed by `aggregate_decay` a round), each normalized, read in the domain the
  payloads live in (DCT coefficients for DisTrO and sparse DiLoCo, the values for bf16 and
  int8). The statistic is
  self-normalized, `t = sum(v_i r_i) / sqrt(sum((v_i r_i)^2))` over the result's values `v` and
  the direction `r` at the same positions: a result independent of the direction (random
  signs, a fixed push) has `t` about N(0, 1) whatever the model size, a sign-flipped one a `t`
  as negative as an honest one's is positive, and scaling a result does not change it. A
  result is refused when `t` is below `min_agreement`, below `a * level - b` where the level
  is the lowest of the medians of the `t`s of the results that passed here in each of the last
  `level_rounds` rounds (before any round closed, the open round before's checks so far)
  (`relative_agreement`: while the run's results agree strongly, one that does not stands out;
  DisTrO takes the lower of two, because one round can agree far more strongly than the next:
  the first round of an epoch, whose continuing members' momenta still hold what they sent
  last, agrees about twice as strongly as the rounds around it, and its median alone refused
  the next round's honest results, a member just back with a fresh momentum's first; a sender
  that joined after the witness is judged against half the level for its first rounds,
  `fresh_sender_rounds`: its fresh momentum agrees about half as strongly; a sender with
  results here before is refused so only when its last ones were below the bar too, and at
  once only below `-a / 2 x level`: `relative_results`), or when
  the `t`s of the sender's last `window_rounds` results here sum to less than
  `min_window_z * sqrt(n)` (late in a run a DisTrO result's own `t` is too noisy to judge
  alone, a consistently opposed sender's is not);
* **norm**: within `max_norm_ratio` of the witness's own sent update's norm either way (a
  result scaled to the format's bound, an all-zero free rider; the DCT is orthonormal, so the
  norm read in the payload's domain is the update's);
* **not a copy**: a count-sketch fingerprint of every result seen (this round's that came
  earlier, the witness's own first, and the last `history_rounds` rounds') is compared by
  cosine; at `duplicate_cosine` or above the later one is refused (a copy of another member's
  result, a replay of an older one).

The recent aggregate of a DisTrO witness whose optimizer keeps what it applied (the
per-parameter route: a CPU client; `Distro.applied`) is not folded from its own accepted results
but is the coefficients of the last round the run applied (the consensus of round N - 2 when
round N's reference is taken; `Reference.applied`): the scatter of every accepted result into a
model-sized buffer is saved (the apply wrote those coefficients anyway), and every honest witness
holds the same bits (the consensus set's payloads are content-addressed, the scatter-mean is
exact). A hostile result enters it only where a quorum attested it and the run applied it. It
has no history: one applied round is a weak direction alone (DisTrO's error feedback moves a
member's next top-k away from what it just sent), so a witness with no update of its own in a
round measures along its last own update beside it.

A witness with no update of its own in a round (its training cut by the timeout, a verifier, a
member that has just joined) judges each result against the round's others checked so far
(`WitnessScreen._blind_problem`): once three others were checked, the norm against their
median (before, against its last closed round's), the agreement along its recent aggregate
(with applied coefficients, plus its last own update)
against half their median agreement (from two others on; capped by its closed rounds'
levels). Arrival order is the trainers' to choose, so its refusals never accuse
(`Verdict.blind`), and its votes follow the round judged as a whole once the witness is sent
(`RoundScreen.judge`: leave-one-out medians over every result received by then; in its very
first round, with no aggregate, each result's agreement along the sum of the round's others).

A witness with an update of its own but no level yet (its first round: no closed round, none
open before it) holds its votes the same way: `min_agreement` alone passed a sign-flipped DiLoCo
result weakly opposed to its update (`t` -3.9 where honest ones had 15 to 30), a four-member
run's quorum with the hostile member's own vote. Its round is judged as a whole, each result
against `held_level_share` of the lower median of the others' `t`s (leave-one-out), beside
each result's `t` along the round's consensus (the sum of the round's other results and the
witness's own sent one: one model-sized sum a round; `held_consensus`). One member's update is
one small batch's: for DisTrO a second test on the two `t`s together refuses what the own
update alone let pass (a 1-bit sign flip at `t` -4.2: `WitnessScreen._consensus_problem`); for
both the own update's agreement tests (floor, level) refuse only where the consensus agrees
(DisTrO: only at a witness whose update opposes the round's other results) (an
honest DiLoCo pseudo-gradient at `t` -2.39 and -6.36 along one witness's, 35 and more along the
consensus: `WitnessScreen._consensus_confirms`; DisTrO's also wherever the consensus `t` is
negative: a joiner's fresh momentum opposed all three honest results of its first round as a
witness, `t` -7.6 to -10, refused by the floor in a real four-process run).

On for DisTrO (`consensus_outlier`, `OutlierTest`): a DisTrO witness with an update of its own
holds its votes in every round, not only its first: once the round's results are in, each that
passed its checks is read along the sum of the others that passed and the witness's own sent
one, and it is an outlier of the round when its `t` along that consensus and its `t` along the
witness's update are *both* under `share` of the others' lower medians, where both medians
clear their gates (the round's results clearly agree); its sender is refused when it was an
outlier in `outliers` of its last `rounds` open rounds here (`WitnessScreen._outlier_problem`,
the evidence kept by `commit`). Random signs on honest positions and a push in one fixed
direction carry nothing along either, and the own update's tests alone passed them where a
round's honest results agreed only moderately (a four-member run: applied in 27 of 60 rounds).
The sum is taken window by window of the domain, not model-sized (`_windowed_agreements`). A
first form (one round, a weighted sum of the two) refused honest results: late in a run the
consensus agrees weakly and a strong own-update `t` carried a weak one through the sum (the
gates), two colluders can pull an honest target's consensus `t` far down but not its `t` along
an honest witness's update (both must be low), and one weak round of an honest member is chance
(the evidence). What it refuses withholds the witness's vote only (its participant bloom
attested the result at its check), and witnesses decide apart, as every other check here
(docs/reliability.md, "DisTrO's consensus-outlier test").

Every sum is taken in slices below torch's threading grain and added in order
(`_serial_sums`), so two witnesses with the same inputs get the same bits of every statistic
whatever their thread counts.

`WitnessScreen` is one witness's memory over a run, `RoundScreen` one round of it. The client
puts only results that pass into its witness blooms (`psyche.client.round.payloads`). Nothing here
decides what a client applies: that is the coordinator's consensus over the witnesses' blooms,
the same for every client, so honest witnesses may disagree here without any client's weights
diverging (docs/reliability.md, "Poisoned results"). The screening state lives in host memory:
about two float32 copies of the model (the own update of the round being screened, the recent
aggregate: the folded one, or the optimizer's kept applied coefficients), three while rounds
have `precombine_from` checks or more (the combined direction; not with applied coefficients,
whose 2-D blocks are stored column-major: each check gathers twice).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

import torch

from psyche.coordinator.consensus import witness_quorum_for
from psyche.core.definitions import DilocoTransmission
from psyche.modeling.compression import decompress_idx, index_width
from psyche.modeling.diloco.codec import (
    DilocoLayout,
    _sparse_indices,
    entry_values,
)
from psyche.modeling.diloco.optimizer import Diloco
from psyche.modeling.distro import Distro, DistroResult, unpack_tensor_sign_from_boolean

# count-sketch hashing: a position times an odd constant (below 2^63 for positions below 2^31),
# the bucket and the sign from bits of the product
_HASH_MULTIPLIER = 0x9E3779B1
_BUCKET_SHIFT = 16
_SIGN_SHIFT = 40
_CPU = torch.device("cpu")
# the integer type `decompress_idx` views a payload's index bytes as, by `index_width`
_INDEX_DTYPES = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.int64}
# values a slice of the combined direction is built in (1 MiB of float32: stays in cache between
# its two operations)
_SLICE = 1 << 18
# entries of a result whose per-entry work runs together (`_slices`: 128 KiB of int64)
_ENTRIES = 1 << 14
# a model-sized norm reads one block of `_NORM_BLOCK` values in `_NORM_EVERY` (`sampled_norm`)
_NORM_BLOCK = 1024
_NORM_EVERY = 16
# a DisTrO result's fingerprint reads the entries of one block in `_SKETCH_EVERY`
_SKETCH_EVERY = 4
_K = TypeVar("_K", bound=Hashable)


@dataclass(frozen=True)
class OutlierTest:
    """DisTrO's consensus-outlier test (`ScreeningSettings.consensus_outlier`): a result that
    passed every other test is an *outlier* of its round when its `t` along the round's
    consensus `c` and along the witness's own update `t` are **both** under `share` of the
    others' lower medians (`C`, `T`), and the test is *open* only where the medians reach
    `consensus_gate` and `update_gate` (the round's results clearly agree along both). A
    sender is refused when its result is an outlier now and was in at least `outliers - 1` of
    its last `rounds - 1` open rounds here (`outliers` of `rounds` with this one).

    Why each part (docs/reliability.md, "DisTrO's consensus-outlier test"): the weighted sum
    `c/C + w t/T` refused honest results late in a run, where `C` is 1.7 to 3.4 and a strong
    own-update `t` carried a weak consensus one (the gate closes there, the AND form needs
    both weak); two colluders can pull a target's consensus `t` down but not its `t` along an
    honest witness's own update (the AND form); one round of an honest result that agrees
    weakly with both is chance, the same sender weak round after round is not (the evidence).
    Random signs on honest positions and a push in one fixed direction score about N(0, 1)
    along both in every round.

    The defaults are measured (`scripts/bench/poison.py --record`, docs/reliability.md): of
    about 15,000 judgements of honest results with both gates open (homogeneous runs, a fresh
    joiner, two colluders framing a member, every member on its own data) the lowest
    `max(c/C, t/T)` was 0.185 once and 0.351 next, and no honest result was an outlier twice at
    one witness; random signs at 1 of 4, 60 steps were applied in 7 of 60 rounds (27 with the
    test off)."""

    share: float = 0.35
    consensus_gate: float = 1.5
    update_gate: float = 4.0
    outliers: int = 2
    rounds: int = 4


@dataclass(frozen=True)
class ScreeningSettings:
    """Thresholds of the checks (see the module docstring). The agreement thresholds are set
    against the statistic's spread when results carry no common signal at all (an honest result
    then has `t` about N(0, 1.4^2): measured on random tokens), so that an honest result is
    refused with a probability of about 1e-5 or less even then."""

    min_agreement: float = -6.0
    relative_agreement: tuple[float, float] | None = None
    level_rounds: int = 1
    """The relative test's level: the lowest median of this many last rounds (more than one
    lags behind a run whose agreement grows, as a DiLoCo run's does over its first rounds)."""
    relative_results: int = 1
    """A sender with results checked here before is judged over its last `relative_results`
    (this one and those before it): the relative test refuses only when all of them are below
    its bar, and the floor refuses at once only a result below both `min_agreement` and
    `-a / 2 x share x level` (opposed at least half as strongly as the bar asks a result to
    agree: a sign flip's `t` is about minus an honest one's; honest results fell to -0.30 of
    the level, and a sign flip that passes is refused once three are below the bar). A
    sender's first result here is judged alone, as with 1.

    In a three-member tiny-cpu run (`tests/modeling/test_screening_weak_round.py`; e2e's
    model, data and 3/3/2-row batches) about one honest result in a hundred agreed with
    every witness alike at a fraction of the level for one round (`t` 4.07 and 5.98 where the
    level was 23.4 and 22.5), and its next result as before (23 and 21); one witness's update
    made both others' honest results fall to -6.5 and -6.8 (level 22.6). The old rule refused
    32 of 2,880 honest checks there; in a real-process run, `t` 8.46 under 0.7 x 22.99 - 6 and
    -3.08 under 0.7 x 16.08 - 6, and with one witness a round each such refusal left the batch
    without consensus and its honest trainer health-checked out. Over two results the bar had
    to come down to about 0.6 of the level (two weak rounds in a row: 9.48 after a weak one
    where the bar was 10.1), which let most random-sign lies of `scripts/bench/poison.py`
    through; over three it keeps 0.7. A lie that carries nothing (random signs, a fixed push:
    `t` about 0) is refused from its third round on, two rounds later than alone."""
    fresh_sender_rounds: int = 0
    fresh_sender_share: float = 1.0
    """A sender of which this witness has checked fewer than `fresh_sender_rounds` results (with
    an update of its own) while it has closed at least that many rounds itself (a member that
    joined after the witness, or came back: a fresh momentum) is judged at its check against
    `fresh_sender_share` of the level (`a x share x level - b`). In an all-honest real-process
    run a joiner's second result agreed at `t` 9.03 where the witness's level was 21.84 (0.41 of
    it), refused under 0.7 x 21.84 - 6, and with one witness a round that left its batch
    without consensus and the honest joiner health-checked out; a tiny run's joiner on one row
    beside members on four agreed at 0.46 of the level, 12.7 under 0.7 x 27.7 - 6
    (`tests/modeling/test_screening_fresh.py`). Members that started with the witness are judged
    as before (halving every sender's level let a sign flip through at a four-member run's
    third round). 0: no sender is judged so."""
    level_min_results: int = 2
    """A round's level counts only when it is the median of at least this many results'
    `t`s; a round of fewer sets none (its place among the last `level_rounds` stays taken, so
    an older level does not stand in for it). In a two-member run a witness's level was the
    other member's `t` of the round before, no median at all: an honest DisTrO result at
    `t` 9.39 was refused under 0.7 x 24.13 - 6 = 10.89 (one run in four of
    `tests/client/test_hostile_strangers.py`). Without a level only the floor and the window
    judge, as in a witness's first round."""
    held_level_share: float = 0.5
    """A witness with an update of its own but no level yet (its first round) judges the
    round's results as a whole (`RoundScreen.judge`): its level for each is this share of the
    lower median of the other results' `t`s. Half by default, as a witness without an update
    of its own halves its median: a member back with a fresh momentum agrees about half as
    strongly as the others."""
    held_consensus: Literal["refuses", "confirms"] | None = None
    """How a witness's first round (`RoundScreen.judge` with an update of its own) uses the
    round's consensus, each result's `t` along the sum of the round's other results and the
    witness's own sent one: "refuses" (DisTrO), a second test beside the own update's level,
    on the sum of the two `t`s (`WitnessScreen._consensus_problem`: its 1-bit sign flip passed
    the own update's test alone). The own update's floor and level refuse a result only where
    its consensus `t` is below the others' level too (`_consensus_confirms`): with "confirms"
    always, with "refuses" only at a witness whose own update opposes the round (the others'
    lower median along it negative), and there also wherever that `t` is negative (a 1-bit
    flip's was only -3.0 and -4.7; an ordinary witness's floor still refuses a flip whose
    consensus `t` happens to be positive, as a four-member CI run's was): a
    witness just joined, its momentum fresh, had its update oppose all three honest DisTrO
    results of its first round (`t` -7.6 to -10, a real four-process run; refused by the floor
    before, `tests/modeling/test_screening_fresh_witness.py`; DiLoCo: one
    member's pseudo-gradient of four inner steps on two rows agreed with an honest one at `t`
    -2.39 where the round's median was 23.3, refused in an eight-member run). A sparse DiLoCo
    flip is not separable by either: an honest member's sparse result scored -0.8 to -1.9
    along every witness's update and -2.3 along the consensus, its flip the mirror of that."""
    consensus_outlier: OutlierTest | None = None
    """In every round a witness with an update of its own holds its votes and judges the round
    as a whole (`RoundScreen.judge`), and beside its other tests refuses a sender whose result
    agrees with neither the round's consensus nor the witness's update in this round and in
    enough of its last rounds (`OutlierTest`, `WitnessScreen._outlier_problem`). None: no such
    test, and a witness holds its votes only in its first round."""
    window_rounds: int = 16
    min_window_z: float = -6.0
    """The window test: `sum(t) / sqrt(n)` over the sender's last `n` results here."""
    window_min_results: int = 4
    """The window test waits for this many of the sender's results."""
    max_norm_ratio: float = 8.0
    duplicate_cosine: float = 0.95
    history_rounds: int = 4
    aggregate_decay: float = 0.75
    aggregate_weight: float = 1.0
    """The recent accepted results' share of the direction (the own update's is 1)."""
    sketch_size: int = 4096
    """Buckets of a fingerprint (a power of two)."""
    precombine_from: int = 4
    """A round's direction is combined once over the whole domain (one model-sized buffer
    more) when the witness's previous round had at least this many checks: each check then
    gathers once instead of twice. The same bits either way (`WitnessScreen._agreement`);
    0 always, a large number never."""


DISTRO_SCREENING = ScreeningSettings(
    relative_agreement=(0.7, 6.0),
    level_rounds=2,
    relative_results=3,
    fresh_sender_rounds=4,
    fresh_sender_share=0.5,
    held_consensus="refuses",
    consensus_outlier=OutlierTest(),
)
"""DisTrO: an honest 1-bit result's `t` is 5 to 15 early in a run and about N(2, 1.3^2) late
(tiny run, c16 k4; docs/reliability.md): one round alone refuses only a clearly opposed result,
the sender's window a consistently opposed one. The level is the lower median of the last two
rounds: an epoch's first round agrees about twice as strongly as the next (tiny run, c16 k8:
t 35 against 18), and a member back with a fresh momentum agrees about half as strongly as
the others for its first rounds. A sender is judged over its last three results
(`relative_results`): about one honest result in a hundred agrees weakly for a round (tiny-cpu,
three members, `scripts/bench/honest_tiny_cpu.py`: the rule on one result refused 29 of 2,400
honest checks, over three none of the same checks)."""
DILOCO_SCREENING = ScreeningSettings(
    relative_agreement=(0.4, 6.0), held_level_share=1.0, held_consensus="confirms"
)
"""DiLoCo: honest pseudo-gradients agree with `t` of 10 to 130 on the tiny run, the lowest of a
round at least 0.43 of its median. A first round's level is all of the lower median of the
others (a random-sign result's `t`, about N(0, 1), lies below 0.4 x 21.7 - 6 = 2.7 where
honest ones have 21.7 and 23.3; half of it passed one at `t` 1.15)."""


def screening_settings(reader: ResultReader) -> ScreeningSettings:
    """The thresholds for the run's optimizer."""
    return DISTRO_SCREENING if reader.distro else DILOCO_SCREENING


@dataclass(frozen=True)
class Reference:
    """A witness's own update of one round as its optimizer compressed it, in the payloads'
    domain (one tensor per parameter: `Distro.encoded`, `Diloco.encoded`); taking one copies
    nothing, `RoundScreen.set_reference` reads it onto the host as float32."""

    tensors: list[torch.Tensor]
    applied: list[torch.Tensor] | None = None
    """The coefficients the witness's optimizer last applied (`Distro.applied`: the run's
    consensus of the last round it applied), which become the witness's recent aggregate
    (`WitnessScreen`); None: the witness folds the results it accepted instead."""


@dataclass(frozen=True)
class _Own:
    """A reference read into the payloads' domain (`ResultReader.domain`), 1 / its norm, and
    the norm of what the witness sent."""

    tensors: list[torch.Tensor]
    scale: float
    own_norm: float
    serial: int = 0
    """Which reference of its witness this is (the combined direction is of one)."""


@dataclass(frozen=True)
class _Applied:
    """`Reference.applied` read for gathers: each parameter's coefficients as stored (flat
    float32 host tensors, no copy where they are that already), for a parameter whose blocks
    are stored column-major its block size and the table that moves a position within a block
    to where its value is stored (`_block_moves`; None: stored in order), and their norm."""

    source: list[torch.Tensor]
    stored: list[torch.Tensor]
    moves: list[tuple[int, torch.Tensor] | None]
    norm: float
    _masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    """Per result shape (its parts' sizes), each entry's block size - 1 where its part is
    stored column-major, else 0 (`_storage_positions`)."""

    @classmethod
    def read(cls, tensors: list[torch.Tensor], size: int) -> _Applied:
        stored: list[torch.Tensor] = []
        moves: list[tuple[int, torch.Tensor] | None] = []
        for tensor in tensors:
            t = tensor.detach().to(_CPU, torch.float32)
            if not t.is_contiguous() and t.dim() >= 3 and t.transpose(-1, -2).is_contiguous():
                n1, n2 = t.shape[-2], t.shape[-1]
                stored.append(t.transpose(-1, -2).reshape(-1))
                moves.append((n1 * n2, _block_moves(n1, n2)))
            else:
                stored.append(t.reshape(-1))
                moves.append(None)
        if sum(t.numel() for t in stored) != size:
            raise ValueError(
                f"applied coefficients of {sum(t.numel() for t in stored)} values, "
                f"the domain has {size}"
            )
        return cls(tensors, stored, moves, sampled_norm(stored))

    def same(self, tensors: list[torch.Tensor]) -> bool:
        return len(tensors) == len(self.source) and all(
            a is b for a, b in zip(tensors, self.source)
        )

    def at(self, flat: Flat) -> list[torch.Tensor]:
        """The coefficients at a result's positions, one tensor per part (the gathers' values
        are those of the logical positions, whatever the storage order)."""
        where = self._storage_positions(flat)
        if where is not None:
            return [stored.index_select(0, w) for stored, w in zip(self.stored, where)]
        out = []
        for stored, move, (positions, _) in zip(self.stored, self.moves, flat.parts):
            if positions is None:
                out.append(stored.clone())
            elif move is None:
                out.append(stored.index_select(0, positions))
            else:
                block, table = move
                # a position's place in its block: a mask where the block is a power of two
                within = (
                    positions.bitwise_and(block - 1)
                    if block & (block - 1) == 0
                    else positions.remainder(block)
                )
                moved = positions + table.index_select(0, within)
                out.append(stored.index_select(0, moved))
        return out

    def _storage_positions(self, flat: Flat) -> list[torch.Tensor] | None:
        """Where each part's entries are stored, in whole-result operations: where every
        column-major part has the same power-of-two block shape (one `_block_moves` table,
        which has 0 at 0, so a mask of 0 leaves an in-order part's positions as they are).
        None otherwise (`at` goes part by part)."""
        shapes = {(move[0], id(move[1])) for move in self.moves if move is not None}
        if flat.local is None or len(shapes) != 1:
            return None
        ((block, _),) = shapes
        if block & (block - 1):
            return None
        table = next(move[1] for move in self.moves if move is not None)
        sizes = tuple(values.numel() for _, values in flat.parts)
        mask = self._masks.get(sizes)
        if mask is None:
            mask = torch.cat(
                [
                    torch.full((n,), block - 1 if move else 0, dtype=flat.local.dtype)
                    for n, move in zip(sizes, self.moves)
                ]
            )
            self._masks.clear()
            self._masks[sizes] = mask
        where = flat.local + table.index_select(0, flat.local.bitwise_and(mask))
        return list(where.split(sizes))


@functools.cache
def _block_moves(n1: int, n2: int) -> torch.Tensor:
    """For each position `q = r * n2 + c` within an `n1 x n2` block stored column-major, how
    far its value is stored from `q` (`c * n1 + r - q`)."""
    q = torch.arange(n1 * n2, dtype=torch.int32)
    return (q % n2) * n1 + q // n2 - q


@dataclass(frozen=True)
class Fingerprint:
    sketch: torch.Tensor
    norm: float

    def cosine(self, other: Fingerprint) -> float:
        if self.norm == 0.0 or other.norm == 0.0:
            return 0.0
        return float(torch.dot(self.sketch, other.sketch)) / (self.norm * other.norm)


@dataclass(frozen=True)
class Measure:
    agreement: float
    norm: float
    fingerprint: Fingerprint


@dataclass(frozen=True)
class Verdict:
    measure: Measure
    problem: str | None
    """Why the result is refused; None when it passes."""
    checked: bool = True
    """False when the agreement could not be measured: the witness had no update of its own
    that round and no accepted result of an earlier round (the norm against the round's other
    results and the copy check ran)."""
    blind: bool = False
    """The witness had no update of its own that round (`WitnessScreen._blind_problem`): its
    baseline is the round's other results, whose arrival order a trainer controls, so a refusal
    here says nothing about the sender that should drop it (the client attests it as
    delivered and withholds only its vote)."""
    index: int | None = None
    """A held verdict's place among its round's held checks (a blind one, or one made with an
    own update before the witness had a level: its first round): `RoundScreen.judge` judges it
    again over the whole round (the verdict the client's vote follows)."""
    outlier: bool | None = None
    """The round's judgement found it an outlier of its round (`OutlierTest`); None: the test
    did not judge it (off, closed, or the result failed another test). Kept by `commit` as the
    sender's evidence."""

    @property
    def passed(self) -> bool:
        return self.problem is None


@dataclass(eq=False)
class _BlindCheck:
    """One result a witness with no update of its own checked in a round, kept for the
    round's judgement over all its results (`RoundScreen.judge`)."""

    sender: Hashable
    measure: Measure
    measured: bool
    """Its agreement was measured along the recent aggregate."""
    history: tuple[float, ...]
    """The sender's blind `t`s as the window test read them at its check."""
    copy: str | None
    """Why it is a copy of a result seen before it (None: it is not)."""
    flat: Flat | None = None
    leveled: str | None = None
    """Checked with an own update and a level (`consensus_outlier` holds every round): the
    judgement keeps its check's verdict, this its problem ("" when it passed), and only adds
    `WitnessScreen._outlier_problem`."""
    passed: bool = True
    """With an own update: it passed (at its check, then at the judgement the round took:
    `RoundScreen.commit`), so it is among the round's accepted results and levels."""


@dataclass(frozen=True)
class Flat:
    """A result read as values at positions of the whole model's payload domain (the
    parameters' domains one after the other); `positions` None: every position, in order.
    `parts` are the same per parameter, positions within the parameter's domain."""

    positions: torch.Tensor | None
    values: torch.Tensor
    parts: list[tuple[torch.Tensor | None, torch.Tensor]]
    sketched: torch.Tensor | None = None
    """The entries the fingerprint reads (`ResultReader.describe`); None: every one."""
    local: torch.Tensor | None = None
    """The parts' positions in one tensor (`parts` are its pieces), where they were read so."""


class ResultReader:
    """Reads one run's results as values at flat positions of the model's payload domain: DCT
    coefficients for DisTrO and sparse DiLoCo, the parameters' values for the dense DiLoCo
    forms."""

    def __init__(self, distro: Distro | None = None, diloco: Diloco | None = None) -> None:
        if (distro is None) == (diloco is None):
            raise ValueError("a reader reads DisTrO or DiLoCo results")
        self.layouts: list[DilocoLayout] | None = diloco.layouts() if diloco else None
        if distro is not None:
            sizes = [
                math.prod(distro.transform.encoded_shape(tuple(p.shape))[0])
                for _, p in distro.variables
            ]
        else:
            sizes = [_domain_numel(layout) for layout in self.layouts or []]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.size = sum(sizes)
        self.dense_form = self.layouts is not None and all(
            layout.transmission is not DilocoTransmission.Sparse for layout in self.layouts
        )
        # a dense result's fingerprint reads every `stride`-th value (about 64k of them)
        self._stride = max(1, self.size // 65_536) if self.dense_form else 1
        self._sampled_hash: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._sketch_cache: tuple[tuple[tuple[int, int, int], ...], torch.Tensor] | None = None
        self._starts_cache: (
            tuple[tuple[tuple[int, int, int], ...], torch.Tensor, torch.Tensor] | None
        ) = None

    @classmethod
    def of(cls, optimizer: Distro | Diloco) -> ResultReader:
        if isinstance(optimizer, Diloco):
            return cls(diloco=optimizer)
        return cls(distro=optimizer)

    @property
    def distro(self) -> bool:
        return self.layouts is None

    def _entry(self, r: DistroResult, i: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(positions in parameter `i`'s domain, or None for a dense entry; float32 values)."""
        if self.layouts is None:
            idx = decompress_idx(r.totalk, r.sparse_idx.to(_CPU))
            k = max(idx.shape[-1] if idx.dim() else 1, 1)
            # each entry's block start: the block's row times the block size, per entry
            starts = torch.arange(idx.numel() // k, dtype=torch.int64).mul_(r.totalk)
            starts = starts.unsqueeze(1).expand(-1, k).reshape(-1)
            return starts.add_(idx.reshape(-1)), _float_values(r.sparse_val.to(_CPU))
        layout = self.layouts[i]
        values = entry_values(r, layout, _CPU)
        if layout.transmission is not DilocoTransmission.Sparse:
            return None, values
        assert layout.sparse is not None
        idx = _sparse_indices(r, layout, _CPU)
        rows = torch.arange(idx.shape[0], dtype=torch.int64).unsqueeze(1)
        return (rows * layout.sparse.totalk + idx).reshape(-1), values

    def flat(self, results: Sequence[DistroResult]) -> Flat:
        if self.layouts is None:
            whole = self._distro_flat(results)
            if whole is not None:
                return whole
        parts = [self._entry(r, i) for i, r in enumerate(results)]
        values = torch.cat([v for _, v in parts])
        if self.dense_form:
            return Flat(None, values, parts)
        shifted = [p + offset for (p, _), offset in zip(parts, self.offsets) if p is not None]
        return Flat(torch.cat(shifted), values, parts)

    def _distro_flat(self, results: Sequence[DistroResult]) -> Flat | None:
        """`flat` of a DisTrO result in a few whole-result operations, the same values as
        `_entry` part by part: every entry's block start (a part's rows times its block size,
        plus its offset) depends only on the result's shapes, the same for every result of a
        run, so it is kept (`_starts`) and each result costs one index conversion and two adds.
        None when a part has no entry axis (`_entry` reads it)."""
        views = [r.sparse_idx.to(_CPU).view(_INDEX_DTYPES[index_width(r.totalk)]) for r in results]
        if any(v.dim() == 0 or v.shape[-1] == 0 for v in views):
            return None
        shape = tuple((int(r.totalk), v.numel(), v.shape[-1]) for r, v in zip(results, views))
        local, shifted = self._starts(shape)
        if len({v.dtype for v in views}) == 1:
            raw = torch.cat([v.reshape(-1) for v in views])
        else:
            raw = torch.cat([v.reshape(-1).to(local.dtype) for v in views])
        if raw.dtype not in (torch.uint8, local.dtype):
            raw = raw.to(local.dtype)  # torch adds no other unsigned type
        idx, positions = torch.empty_like(shifted), torch.empty_like(shifted)
        for part, out, here, start, start_here in _slices(raw, positions, idx, shifted, local):
            torch.add(part, start, out=out)
            torch.add(part, start_here, out=here)
        vals = [r.sparse_val.to(_CPU).reshape(-1) for r in results]
        if all(v.dtype == torch.bool for v in vals):
            # `unpack_tensor_sign_from_boolean`'s values (True -> -1, False -> +1) for the
            # whole result: 1 - 2 b is exact, and a quarter of `torch.where`'s time
            values = torch.cat(vals).to(torch.float32).mul_(-2.0).add_(1.0)
        else:
            values = torch.cat([_float_values(v) for v in vals])
        sizes = [n for _, n, _ in shape]
        parts: list[tuple[torch.Tensor | None, torch.Tensor]] = list(
            zip(idx.split(sizes), values.split(sizes))
        )
        return Flat(positions, values, parts, self._sketched(shape), idx)

    def _sketched(self, shape: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
        """The entries of every `_SKETCH_EVERY`-th block of each part, for results of `shape`
        (`_starts`); the last shape's are kept. A block's entries are all in or all out, so a
        copy with its entries reordered within their blocks (the same update) has the same
        fingerprint; a quarter of the entries still puts about 45 per bucket at 20M, c16 k8."""
        cached = self._sketch_cache
        if cached is None or cached[0] != shape:
            firsts = itertools.accumulate((n for _, n, _ in shape), initial=0)
            picked = torch.cat(
                [
                    torch.arange(first, first + n).view(-1, k)[::_SKETCH_EVERY].reshape(-1)
                    for (_, n, k), first in zip(shape, firsts)
                ]
            )
            cached = self._sketch_cache = (shape, picked)
        return cached[1]

    def _starts(self, shape: tuple[tuple[int, int, int], ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each entry's block start within its part and within the whole domain, for results
        whose parts are `(totalk, entries, entries per block)`; the last shape's are kept.
        int32 while the domain allows (`_position_dtype`): half the memory traffic of every
        per-entry operation, the same values."""
        cached = self._starts_cache
        dtype = _position_dtype(self.size)
        if cached is None or cached[0] != shape:
            local = torch.cat(
                [
                    torch.arange(n // k, dtype=dtype)
                    .mul_(totalk)
                    .unsqueeze(1)
                    .expand(-1, k)
                    .reshape(-1)
                    for totalk, n, k in shape
                ]
            )
            offsets = torch.cat(
                [
                    torch.full((n,), offset, dtype=dtype)
                    for (_, n, _), offset in zip(shape, self.offsets)
                ]
            )
            cached = self._starts_cache = (shape, local, offsets.add_(local))
        return cached[1], cached[2]

    def add_into(self, total: torch.Tensor, flat: Flat, alpha: float = 1.0) -> None:
        """`total += flat * alpha` (float32 over the whole domain)."""
        if flat.positions is None:
            total.add_(flat.values, alpha=alpha)
        else:
            total.index_add_(0, flat.positions, flat.values, alpha=alpha)

    # ---- the witness's reference ------------------------------------------------------------

    def reference(self, optimizer: Distro | Diloco) -> Reference:
        """This replica's own update of the step or round that just ended, as it compressed it
        (`keep_encoded`: DisTrO's momentum in the DCT domain, DiLoCo's pseudo-gradient plus its
        residual in the payloads' domain); raises `ValueError` when there is none."""
        if optimizer.encoded is None:
            raise ValueError("the optimizer kept no update (keep_encoded, or nothing yet)")
        applied = optimizer.applied if isinstance(optimizer, Distro) else None
        return Reference(list(optimizer.encoded), list(applied) if applied is not None else None)

    def domain(self, reference: Reference) -> list[torch.Tensor]:
        """A reference as flat float32 CPU tensors, one per parameter (no copy where it is one
        already)."""
        return [x.detach().reshape(-1).to(_CPU, torch.float32) for x in reference.tensors]

    # ---- measures ----------------------------------------------------------------------------

    def describe(self, flat: Flat, sketch_size: int) -> tuple[float, Fingerprint]:
        """A result's norm and fingerprint."""
        norm = math.sqrt(_sum_squares(flat.values))
        if flat.positions is None:
            _, bucket, sign = self._dense_hash(sketch_size)
            signed = flat.values[:: self._stride] * sign
            sketch = torch.zeros(sketch_size).index_add_(0, bucket, signed)
        else:
            # slice by slice, each slice's work in cache; the sketch adds the same values in
            # the same order as one `index_add_` of the whole result
            sketch = torch.zeros(sketch_size)
            read_at, read = flat.positions, flat.values
            if flat.sketched is not None:
                read_at = read_at.index_select(0, flat.sketched)
                read = read.index_select(0, flat.sketched)
            for positions, values in _slices(read_at, read):
                bucket, sign = _hash(positions, sketch_size)
                sketch.index_add_(0, bucket, sign.mul_(values))
        return norm, Fingerprint(sketch, float(torch.linalg.vector_norm(sketch)))

    def _dense_hash(self, sketch_size: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        cached = self._sampled_hash
        if cached is None or cached[0] != sketch_size:
            bucket, sign = _hash(torch.arange(0, self.size, self._stride), sketch_size)
            cached = self._sampled_hash = (sketch_size, bucket, sign)
        return cached


def _domain_numel(layout: DilocoLayout) -> int:
    if layout.transmission is DilocoTransmission.Sparse:
        assert layout.sparse is not None
        return math.prod(layout.sparse.xshape)
    return layout.numel


def _position_dtype(size: int) -> torch.dtype:
    """The integer type of positions in a domain of `size` values (`index_select` and
    `index_add_` take int32 indices as they take int64)."""
    return torch.int32 if size < 2**31 else torch.int64


def sampled_norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of flat float32 tensors together, estimated from one block of
    `_NORM_BLOCK` values in every `_NORM_EVERY` (a tensor smaller than that whole), the
    estimate of each tensor's sum of squares scaled to its size. A sixteenth of a model-sized
    read: the norms of the own update and the aggregate only weigh the two against each
    other in the direction, where a percent does not matter, and the same bits give the same
    estimate on every witness (the checks stay deterministic)."""
    total = 0.0
    span = _NORM_BLOCK * _NORM_EVERY
    rows = _ENTRIES // _NORM_BLOCK
    rest = []
    for t in tensors:
        bulk = t.numel() // span * span
        if bulk:
            blocks = t[:bulk].view(-1, _NORM_EVERY, _NORM_BLOCK)[:, 0]
            total += sum(_sum_squares(b) for b in blocks.split(rows)) * _NORM_EVERY
        rest.append(t[bulk:])
    total += _sum_squares(torch.cat(rest)) if rest else 0.0
    return math.sqrt(total)


def _sum_squares(x: torch.Tensor) -> float:
    """`sum(x^2)` the same to the bit whatever torch's thread count (`_serial_sums`)."""
    return sum(float(s.square().sum()) for s in x.reshape(-1).split(_ENTRIES))


def _serial_sums(x: torch.Tensor) -> tuple[float, float]:
    """`sum(x)` and `sum(x^2)`, the same to the bit whatever torch's thread count: torch
    splits a reduction between threads only from 32,768 values (`at::internal::GRAIN_SIZE`),
    so each `_ENTRIES`-long slice is reduced by one thread in one order, and the slices'
    partial sums are added in Python, in order. (A whole-tensor `sum` or BLAS `dot` gave
    other low bits at 1, 2 and 4 threads, so two witnesses with the same inputs could reach
    different verdicts at a threshold.)"""
    num = den = 0.0
    for s in x.reshape(-1).split(_ENTRIES):
        num += float(s.sum())
        den += float(s.square().sum())
    return num, den


def _hash(positions: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bucket in [0, size) (a power of two) and a sign for each position (the same on every
    machine)."""
    product = positions.to(torch.int64) * _HASH_MULTIPLIER
    bucket = (product >> _BUCKET_SHIFT).bitwise_and_(size - 1)
    sign = product.bitwise_right_shift_(_SIGN_SHIFT).bitwise_and_(1).to(torch.float32)
    return bucket, sign.mul_(2.0).sub_(1.0)


def _slices(*tensors: torch.Tensor) -> Iterable[tuple[torch.Tensor, ...]]:
    """Equal tensors cut into `_ENTRIES`-long slices side by side (views): a result's
    per-entry work done slice by slice stays in cache, three times faster on a loaded machine
    than whole-result operations, with the same values (every operation is elementwise)."""
    return zip(*(t.split(_ENTRIES) for t in tensors))


def _float_values(val: torch.Tensor) -> torch.Tensor:
    """A part's values as flat float32 (1-bit signs: True -> -1, False -> +1)."""
    if val.dtype == torch.bool:
        val = unpack_tensor_sign_from_boolean(val, torch.float32)
    return val.reshape(-1).float()


def _at(t: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """`t` at `positions` (a copy; the same values as `t[positions]`, gathered faster)."""
    return t.clone() if positions is None else t.index_select(0, positions)


def agreement(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The self-normalized agreement `t = sum(v_i r_i) / sqrt(sum((v_i r_i)^2))` of a result's
    values `v` with a direction `r` read at the same positions, over `(r, v)` pairs of equal
    shapes (one per parameter; `r` is overwritten). About N(0, 1) when the values' signs are
    independent of the direction, whatever the scale of either (the module docstring): the
    witness's checks and a verifier's (`psyche.modeling.verification`) both read results so."""
    return _sum_agreement(direction.mul_(values) for direction, values in pairs)


def _sum_agreement(products: Iterable[torch.Tensor]) -> float:
    """`t` from the products `v_i r_i` of every part, summed together (one copy, then a
    fixed number of slices however many parts the model has)."""
    num, den = _serial_sums(torch.cat([prod.reshape(-1) for prod in products]))
    return num / math.sqrt(den) if den > 0.0 else 0.0


# --------------------------------------------------------------------------------------------
# One witness over a run


_BLIND_OTHERS = 3
"""Other results a witness without an update of its own checks in a round before it judges a
norm against their median (`WitnessScreen._blind_problem`; the agreement, from two)."""


class WitnessScreen:
    """One witness's checks over a run: what it remembers of earlier rounds (the results it
    accepted, every sender's recent agreements, fingerprints) and the rounds it screens.

    Thread-safe: a round's results may be checked from several threads at once."""

    def __init__(self, reader: ResultReader, settings: ScreeningSettings) -> None:
        self.reader = reader
        self.settings = settings
        self._lock = threading.Lock()
        self._aggregate: torch.Tensor | None = None
        self._applied: _Applied | None = None
        """The coefficients the witness's optimizer last applied, once a reference brought
        them (`Reference.applied`): the recent aggregate from then on, and no round is folded."""
        self._aggregate_scale = 1.0
        self._aggregate_norm = 0.0
        self._last_own: _Own | None = None
        """The last round's own update (`_blind_agreement`)."""
        self._norm_level = 0.0
        """The median norm of the results accepted in the last closed round that had any."""
        self._agreements: dict[Hashable, deque[float]] = {}
        self._blind_agreements: dict[Hashable, deque[float]] = {}
        self._outlier_flags: dict[Hashable, deque[bool]] = {}
        """Each sender's outlier verdicts (`OutlierTest`) of the last open rounds the witness
        committed (`_commit`): the evidence a refusal needs."""
        """Each sender's recent `t`s along the aggregate alone (rounds without an own update):
        another scale than `_agreements`', so kept apart from the window test of those."""
        self._levels: deque[float | None] = deque(maxlen=settings.level_rounds)
        self._closed_rounds = 0
        """Rounds closed with checks against an update of the witness's own (a level's)."""
        """The median `t` of each of the last rounds (`level_rounds`) that had any; None for
        a round of fewer than `level_min_results` (`_closed_levels`)."""
        self._fingerprints: deque[list[Fingerprint]] = deque(maxlen=settings.history_rounds)
        self._aggregate_version = 0
        """Counts the aggregate's changes (a combined direction is of one version)."""
        self._last_round_checks = 0
        self._direction: torch.Tensor | None = None
        self._direction_key: tuple[int, int] | None = None
        self._serials = itertools.count(1)
        self._rounds = itertools.count()
        self._recent: deque[RoundScreen] = deque(maxlen=2)
        """The rounds opened last (a round still open lends its level to the next one)."""

    def open_round(self) -> RoundScreen:
        screen = RoundScreen(self)
        with self._lock:
            self._recent.append(screen)
        return screen

    def _level_list(self, screen: RoundScreen) -> list[float]:
        """The levels `screen`'s relative test takes the lowest of: the closed rounds' (the last
        `level_rounds`), or while there are none, the level of what the round opened just
        before `screen` has checked so far, if that round is still open.

        A client closes round N - 1 only when round N + 1 starts (its late results are still
        checked during round N), so a witness's second round had no level at all and only
        `min_agreement` judged it: a member's first sign-flipped result, as weakly opposed to
        one witness's update as an honest result may agree with it, was attested, and with the
        hostile member's own vote that one attestation is a quorum of a four-member run. Only
        a witness with no closed level takes the open round's (later rounds are judged as
        before: an open round's level may be of part of its results). Called under the lock."""
        if self._levels:
            return self._closed_levels()
        minimum = self.settings.level_min_results
        return [
            level
            for earlier in self._recent
            if earlier.serial < screen.serial and not earlier.folded
            for level in [_round_level(earlier, minimum)]
            if level is not None
        ][-self.settings.level_rounds :]

    def _closed_levels(self) -> list[float]:
        """The levels of the last closed rounds that set one (`level_min_results`). Called
        under the lock."""
        return [level for level in self._levels if level is not None]

    def _agreement(self, flat: Flat, own: _Own) -> float:
        """`t` of a result along the direction: the own update over its norm, plus the recent
        aggregate over its norm times `aggregate_weight`, read at the result's positions.

        Two ways to the same bits: gathering the own update and the aggregate at the result's
        positions and combining them there, or gathering once from the direction combined over
        the whole domain (`_combined`, built once a round when the previous round had
        `precombine_from` checks or more: three model-sized passes, against one gather saved a
        check). Every operation is elementwise with the same operands (the one with a scalar
        factor included) and the sums run part by part, so `t` does not depend on the way."""
        weight = self.settings.aggregate_weight
        combined: torch.Tensor | None = None
        parts: Sequence[torch.Tensor | None] = [None] * len(flat.parts)
        with self._lock:
            if len(flat.parts) != len(own.tensors):
                raise ValueError(
                    f"a result of {len(flat.parts)} parts, the model has {len(own.tensors)}"
                )
            aggregate = self._aggregate
            norm = self._aggregate_norm
            factor = weight * self._aggregate_scale / norm if weight and norm else 0.0
            if self._applied is None and self._last_round_checks >= self.settings.precombine_from:
                if not factor or aggregate is None:
                    aggregate, factor = None, 0.0
                combined = _at(self._combined(own, aggregate, factor), flat.positions)
            elif factor:
                # the aggregate changes only under the lock
                parts = self._aggregate_at(flat) or parts
        if combined is not None:
            sizes = [values.numel() for _, values in flat.parts]
            return agreement(zip(combined.split(sizes), (v for _, v in flat.parts)))
        # part by part, each part's work in cache: the own update gathered, scaled, the
        # aggregate added, times the values, summed
        products = []
        for tensor, (positions, values), part in zip(own.tensors, flat.parts, parts):
            piece = tensor.clone() if positions is None else tensor.index_select(0, positions)
            piece.mul_(own.scale)
            if part is not None:
                piece.add_(part, alpha=factor)
            products.append(piece.mul_(values))
        return _sum_agreement(products)

    def _blind_agreement(self, flat: Flat) -> float | None:
        """`t` of a result along the recent aggregate (a witness with no update of its own
        this round); None when it has none yet. With applied coefficients, along them and the
        witness's last own update, as an own update's check (one round's consensus alone
        passed a sign-flipped DisTrO result at `t` -2.96)."""
        with self._lock:
            last = self._last_own if self._applied is not None else None
        if last is not None:
            return self._agreement(flat, last)
        with self._lock:
            at = self._aggregate_at(flat)  # the aggregate changes only under the lock
        if at is None:
            return None
        return agreement(zip(at, (v for _, v in flat.parts)))

    def _aggregate_at(self, flat: Flat) -> list[torch.Tensor] | None:
        """The recent aggregate at a result's positions, one tensor per part (unscaled: its
        scale and norm weigh it); None when there is none, or it is zero. Called under the
        lock."""
        if self._aggregate_norm == 0.0:
            return None
        if self._applied is not None:
            return self._applied.at(flat)
        if self._aggregate is None:
            return None
        sizes = [values.numel() for _, values in flat.parts]
        return list(_at(self._aggregate, flat.positions).split(sizes))

    def _adopt(self, applied: list[torch.Tensor]) -> None:
        """The coefficients of the witness's last applied round become its recent aggregate
        (kept, not copied); the aggregate it folded, if any, is let go."""
        with self._lock:
            if self._applied is not None and self._applied.same(applied):
                return
        read = _Applied.read(applied, self.reader.size)
        with self._lock:
            self._applied, self._aggregate = read, None
            self._aggregate_scale, self._aggregate_norm = 1.0, read.norm
            self._aggregate_version += 1

    def _combined(self, own: _Own, aggregate: torch.Tensor | None, factor: float) -> torch.Tensor:
        """The direction over the whole domain, `own * scale (+ aggregate * factor)`, built
        into one kept buffer the first time a round asks (again when the aggregate changed
        since: a round closing while the next one is checked); called under the lock. Built in
        slices that stay in cache between the two operations."""
        version = self._aggregate_version
        buffer, kept = self._direction, self._direction_key
        if buffer is not None and kept == (own.serial, version):
            return buffer
        if buffer is None or buffer.numel() != self.reader.size:
            buffer = self._direction = torch.empty(self.reader.size)
        self._direction_key = None
        sizes = [t.numel() for t in own.tensors]
        if sum(sizes) != self.reader.size:
            raise ValueError(
                f"a reference of {sum(sizes)} values, the domain has {self.reader.size}"
            )
        whole = aggregate.split(sizes) if aggregate is not None else [None] * len(sizes)
        for piece, tensor, agg in zip(buffer.split(sizes), own.tensors, whole):
            for start in range(0, piece.numel(), _SLICE):
                out = piece[start : start + _SLICE]
                torch.mul(tensor[start : start + _SLICE], own.scale, out=out)
                if agg is not None:
                    out.add_(agg[start : start + _SLICE], alpha=factor)
        self._direction_key = (own.serial, version)
        return buffer

    def _decide(
        self,
        sender: Hashable,
        measure: Measure,
        screen: RoundScreen,
        measured: bool,
        reference: _Own | None,
    ) -> Verdict:
        """`measured`: the agreement was measured (against the own update, or without one
        against the recent aggregate); `reference`: the own update it was measured against
        (the round's when the check began: one set meanwhile does not make a blind measure
        judged as an own-update one); called under the lock."""
        settings = self.settings
        earlier = [*screen.seen, *(fp for rnd in self._fingerprints for fp in rnd)]
        problem = None
        histories = self._agreements if reference is not None else self._blind_agreements
        history = histories.setdefault(sender, deque(maxlen=settings.window_rounds))
        levels: list[float] = []
        if reference is not None:
            history.append(measure.agreement)
            levels = self._level_list(screen)
            fresh = len(history) <= settings.fresh_sender_rounds <= self._closed_rounds
            share = settings.fresh_sender_share if fresh else 1.0
            problem = self._first_order_problem(
                measure, reference.own_norm, history, levels, share=share, over_results=True
            )
        else:
            problem = self._blind_problem(measure, screen, history, measured)
        copy = self._copy(measure, earlier) if problem is None or reference is None else None
        problem = problem or copy
        index = None
        if reference is not None:
            (screen.agreements if problem is None else screen.refused_agreements).append(
                measure.agreement
            )
            bar = self._relative_bar(levels, share)
            if problem is None and bar is not None and measure.agreement < bar:
                screen.lenient.append(measure.agreement)  # passed on its results before
        every_round = settings.consensus_outlier is not None and reference is not None
        if reference is None or not levels or every_round:
            # no level yet (a witness's first rounds), or a test of the whole round in every
            # round (`consensus_outlier`): the vote follows `RoundScreen.judge`
            index = len(screen.blind)
            held = _BlindCheck(sender, measure, measured, tuple(history), copy)
            held.passed = problem is None
            if levels and reference is not None:
                held.leveled = problem or ""
            screen.blind.append(held)
        screen.seen.append(measure.fingerprint)
        if problem is None and not screen.judged:  # after the judgement the round is settled
            screen.accepted_norms.append(measure.norm)
        return Verdict(
            measure,
            problem,
            checked=reference is not None or measured,
            blind=reference is None,
            index=index,
        )

    def _copy(self, measure: Measure, earlier: Sequence[Fingerprint]) -> str | None:
        """Why a result is a copy of an earlier one (None: it is not)."""
        for fingerprint in earlier:
            cosine = measure.fingerprint.cosine(fingerprint)
            if cosine >= self.settings.duplicate_cosine:
                return f"a copy of an earlier result (cosine {cosine:.3f})"
        return None

    def _blind_problem(
        self, measure: Measure, screen: RoundScreen, history: deque[float], measured: bool
    ) -> str | None:
        """The checks of a witness with no update of its own this round (its training was
        cut by the round's timeout, a verifier, a member that has just joined): it used to
        vouch for every result that was not a copy. Now each result is judged against the
        others: its norm against the median norm of the round's other results checked here so
        far (before any, of the results this witness accepted in its last closed round), its
        agreement, measured against the recent aggregate of accepted results, against the
        median agreement of the round's other results checked here so far (leave-one-out: the
        result itself is not in it, and one hostile result of three cannot move it), halved:
        a member back with a fresh momentum agrees about half as strongly as the others, and
        with no own update there is no second round's level to soften one round's.

        The order results arrive in is the trainers' to choose (one can publish at the round's
        start without training), so a hostile first result must not become the baseline every
        honest one is judged by (one aligned with the public aggregate, `t` in the hundreds,
        refused every honest one after it; one of a huge norm, with no closed round yet, too).
        The in-round norm test waits for `_BLIND_OTHERS` other results, whose median is
        honest while the hostile members among them are a minority (before, the norm is judged
        against the last closed round's accepted norms). The relative level starts from two
        others (a four-member run's witness sees only three, and a sign-flipped DisTrO result
        lies above `min_agreement`: its vote and the hostile member's own must not make a
        quorum), capped by this witness's closed rounds' levels where it has any, so early
        results cannot raise it above them; a witness without any may still refuse the second
        honest result after a hostile first one (without accusing), none from the third on. What arrives
        first can still pass here: the vote follows `RoundScreen.judge`, which judges it again
        against every later result, and `Verdict.blind` keeps a refusal here from accusing. The round's blind agreements are
        on another scale than the own update's, so they set no level for later rounds and
        their window is their own (`_blind_agreements`). Called under the lock."""
        others_t, others_norm = screen.blind_agreements, screen.blind_norms
        in_round = len(others_norm) >= _BLIND_OTHERS
        basis = statistics.median(others_norm) if in_round else self._norm_level
        levels: list[float] = []
        if measured and len(others_t) >= 2:
            levels = [statistics.median(others_t) / 2, *self._closed_levels()]
        if measured:
            history.append(measure.agreement)
        problem = self._first_order_problem(measure, basis, history if measured else (), levels)
        others_norm.append(measure.norm)
        if measured:
            others_t.append(measure.agreement)
        return problem

    def _first_order_problem(
        self,
        measure: Measure,
        basis_norm: float,
        history: Sequence[float],
        levels: Sequence[float],
        floor: bool = True,
        share: float = 1.0,
        over_results: bool = False,
    ) -> str | None:
        """`basis_norm`: the norm a result's is compared with (the witness's own sent result's;
        without one, the round's other results'); 0: none. `floor`: `min_agreement` judges.
        `share`: of the lowest level (`fresh_sender_share` for a fresh sender). `over_results`:
        a check with an update of the witness's own as it comes in, judged with the sender's
        results before it (`relative_results`; not a blind check, whose level is the round's
        other results' and whose refusals do not accuse, nor a judged round's)."""
        settings = self.settings
        if measure.norm == 0.0:
            return "the update is zero"
        if basis_norm > 0.0:
            ratio = measure.norm / basis_norm
            if not 1.0 / settings.max_norm_ratio <= ratio <= settings.max_norm_ratio:
                return (
                    f"norm {measure.norm:.4g} is {ratio:.3g}x the basis "
                    f"({basis_norm:.4g}: this witness's own, or without one the round's "
                    f"others'); at most {settings.max_norm_ratio:g}x either way"
                )
        t = measure.agreement
        bar = self._relative_bar(levels, share)
        # the sender's results here before this one (`history` ends with its `t`)
        n = settings.relative_results
        before = list(history)[-n:-1] if bar is not None and over_results and n > 1 else []
        if floor and t < settings.min_agreement and not before:
            return f"agreement t = {t:.2f} is below {settings.min_agreement:g}"
        if bar is not None and settings.relative_agreement is not None:
            a, b = settings.relative_agreement
            level = min(levels)
            if floor and before and t < min(settings.min_agreement, -(bar + b) / 2):
                # judged with the sender's results before it: refused at once only where opposed
                # at least half as strongly as the bar asks it to agree (a sign flip)
                return (
                    f"agreement t = {t:.2f} is below {settings.min_agreement:g} and below "
                    f"-{a * share / 2:g} x {level:.2f} (the lowest median of this witness's last "
                    f"{len(levels)} rounds)"
                )
            if t < bar and all(earlier < bar for earlier in before):
                factor = f"{a:g} x {share:g}" if share != 1.0 else f"{a:g}"
                also = ", ".join(f"{earlier:.2f}" for earlier in before)
                return (
                    f"agreement t = {t:.2f} is below {factor} x {level:.2f} (the lowest median "
                    f"of this witness's last {len(levels)} rounds) - {b:g}"
                    + (f", as were the sender's results before it here ({also})" if also else "")
                )
        if len(history) >= settings.window_min_results:
            z = sum(history) / math.sqrt(len(history))
            if z < settings.min_window_z:
                return (
                    f"the sender's agreement over its last {len(history)} results sums to "
                    f"{z:.2f} x sqrt({len(history)}), below {settings.min_window_z:g}"
                )
        return None

    def _relative_bar(self, levels: Sequence[float], share: float = 1.0) -> float | None:
        """The relative test's bar, `a x share x` the lowest level `- b` (None: no test)."""
        relative = self.settings.relative_agreement
        if relative is None or not levels:
            return None
        return relative[0] * share * min(levels) - relative[1]

    def _judge(self, screen: RoundScreen) -> list[Verdict]:
        """`RoundScreen.judge`: every held check of the round judged against all the round's
        other results (leave-one-out medians), whatever order they came in. Held: every check
        of a witness without an update of its own, and with one, every check made while the
        witness had no level yet (`_level_list`, its first round): `min_agreement` alone let a
        sign-flipped DiLoCo bf16 result pass a witness whose own update it opposed only weakly
        (`t` -3.9 where the round's honest results had 15 to 30: a four-member run's quorum
        with the hostile member's own vote), and the witness then folded it into its aggregate,
        along which the next round's lie agreed (`t` +15.7). With an own update the level is the
        lower median of the other held checks' `t`s (times `held_level_share`): a hostile
        result's high `t` cannot raise the level an honest one of a four-member run is judged
        by (two others), and a hostile one's low `t` only lowers it.

        Changes nothing: the round takes a judgement only when its votes are cast (`_commit`),
        so judging again over more checks (a late one) ends where one judgement of them all
        would."""
        with self._lock:
            order = _judgement_order(screen.blind)
            checks = [screen.blind[k] for k in order]
        flats = [c.flat for c in checks]
        ts = [c.measure.agreement for c in checks]
        measured = [c.measured for c in checks]
        along_round = False
        if len(checks) >= 2 and not all(measured):
            whole = [f for f in flats if f is not None]
            if len(whole) == len(flats):
                # no aggregate (the witness's first round): along the round's other results
                ts, measured, along_round = self._round_agreements(whole), [True] * len(ts), True
        own = screen.reference
        middle = statistics.median if own is None else statistics.median_low
        # the first-round tests' consensus: not where every check had a level (later rounds)
        first = any(c.leveled is None for c in checks)
        consensus = (
            None if along_round or not first else self._held_consensus(screen, flats, measured)
        )
        problems: list[str | None] = []
        measures: list[Measure] = []
        with self._lock:
            for i, check in enumerate(checks):
                others = [k for k in range(len(checks)) if k != i]
                norms = [checks[k].measure.norm for k in others]
                basis = (
                    own.own_norm
                    if own is not None
                    else statistics.median(norms)
                    if len(norms) >= _BLIND_OTHERS
                    else self._norm_level
                )
                others_t = [ts[k] for k in others if measured[k]]
                levels: list[float] = []
                if measured[i] and len(others_t) >= 2:
                    closed = [] if along_round else self._closed_levels()
                    share = 0.5 if own is None else self.settings.held_level_share
                    levels = [middle(others_t) * share, *closed]
                history = check.history if measured[i] and not along_round else ()
                measure = dataclasses.replace(check.measure, agreement=ts[i])
                problem = self._first_order_problem(measure, basis, history, levels) or check.copy
                if check.leveled is not None:
                    # judged against a level at its check: that verdict stands
                    problem = check.leveled or None
                elif consensus is not None:
                    refuses = self.settings.held_consensus == "refuses"
                    # DisTrO: only a witness whose own update opposes the round (the others'
                    # lower median along it is negative: a fresh momentum) is the odd one out;
                    # an ordinary witness's floor refuses a 1-bit flip whose consensus `t`
                    # happens to be positive (four members: a flip applied at step 4 of a
                    # fresh-clone CI run when every witness deferred to the consensus)
                    odd = not refuses or (
                        len(others_t) >= 2 and statistics.median_low(others_t) < 0.0
                    )
                    if problem is not None and odd:
                        # the own update's agreement (floor, level) refuses with the consensus
                        # (a fresh witness's update may oppose every honest result); the norm,
                        # window and copy tests alone. DisTrO's also wherever its consensus `t`
                        # is negative: a 1-bit flip's is only weakly so (-3.0, -4.7)
                        alone = self._first_order_problem(measure, basis, history, [], floor=False)
                        opposed = refuses and consensus[i] < 0.0
                        if (alone or check.copy) is None and not (
                            opposed or self._consensus_confirms(consensus, i)
                        ):
                            problem = None
                    if refuses:
                        problem = problem or self._consensus_problem(ts, consensus, i)
                problems.append(problem)
                measures.append(measure)
        outliers = {} if along_round else self._outliers(screen, checks, ts, measured, problems)
        verdicts: dict[int, Verdict] = {}
        for i, (measure, problem) in enumerate(zip(measures, problems)):
            index = order[i]
            flag, why = outliers.get(i, (None, None))
            verdicts[index] = Verdict(
                measure, problem or why, measured[i], blind=own is None, index=index, outlier=flag
            )
        return [verdicts[i] for i in range(len(checks))]

    def _outliers(
        self,
        screen: RoundScreen,
        checks: Sequence[_BlindCheck],
        ts: Sequence[float],
        measured: Sequence[bool],
        problems: Sequence[str | None],
    ) -> dict[int, tuple[bool, str | None]]:
        """`_outlier_problem` of each held check that passed every other test, by place,
        against the others that did (`consensus_outlier`): whether it is an outlier of the
        round, and why its sender is refused (None: it is not). The consensus is the sum of
        those results and the witness's own sent one. Only results that passed are in it, and
        only their `t`s set the levels: a copy of another member's result (refused as one)
        doubles that result in the sum, and with it both their consensus `t`s, which raised the
        others' level over an honest result's (refused at `t` 5.12 + 5.65 under the levels
        13.89 and 39.06 of a six-member run with two copiers). One sum of the round's results
        a round (`_windowed_agreements`). Reads the senders' evidence under the lock."""
        own_flat = screen.own_flat
        if (
            self.settings.consensus_outlier is None
            or screen.reference is None
            or own_flat is None
            or not all(measured)
        ):
            return {}
        eligible = [k for k, p in enumerate(problems) if p is None]
        whole = [checks[k].flat for k in eligible]
        if len(eligible) <= self.settings.level_min_results or any(f is None for f in whole):
            return {}
        consensus = self._round_agreements([f for f in whole if f is not None], also=[own_flat])
        passed_ts = [ts[k] for k in eligible]
        found: dict[int, tuple[bool, str | None]] = {}
        with self._lock:
            for j, k in enumerate(eligible):
                judged = self._outlier_problem(checks[k].sender, passed_ts, consensus, j)
                if judged is not None:
                    found[k] = judged
        return found

    def _commit(self, screen: RoundScreen, verdicts: Sequence[Verdict]) -> None:
        """`RoundScreen.commit`: the round takes the judgement its votes were cast by, once.
        Without an own update it folds (`_close`) what passed there, not what passed at its
        check; with one, a check that passed and was refused there leaves the round's
        accepted results and passed level (`_unaccept`). `verdicts`: `_judge`'s, by index
        (the held checks it covered, the first of `screen.blind`)."""
        with self._lock:
            if screen.committed:
                return
            screen.committed = True
            covered = screen.blind[: len(verdicts)]
            order = _judgement_order(covered)
            if screen.reference is None:
                passed = [covered[k] for k in order if verdicts[k].passed]
                screen.accepted = [c.flat for c in passed if c.flat is not None]
                screen.accepted_norms = [c.measure.norm for c in passed]
                screen.judged = True
                return
            test = self.settings.consensus_outlier
            for k in order:
                if not verdicts[k].passed and covered[k].passed:
                    self._unaccept(screen, covered[k])
                flag = verdicts[k].outlier
                if test is not None and flag is not None:
                    flags = self._outlier_flags.setdefault(
                        covered[k].sender, deque(maxlen=test.rounds)
                    )
                    flags.append(flag)

    def _held_consensus(
        self, screen: RoundScreen, flats: Sequence[Flat | None], measured: Sequence[bool]
    ) -> list[float] | None:
        """Each held check's `t` along the round's consensus (`_round_agreements` with the
        witness's own sent result), for `_consensus_problem` or `_consensus_confirms`: with
        `held_consensus`, an update of the witness's own, two checks or more, each measured
        along that update. One model-sized sum a first round (not timed at 1B)."""
        own_flat = screen.own_flat
        whole = [f for f in flats if f is not None]
        if (
            not self.settings.held_consensus
            or screen.reference is None
            or own_flat is None
            or len(whole) < 2
            or len(whole) != len(flats)
            or not all(measured)
        ):
            return None
        return self._round_agreements(whole, also=[own_flat])

    def _consensus_confirms(self, consensus: Sequence[float], i: int) -> bool:
        """Whether a result's `t` along the round's consensus is below `a x held_level_share x`
        the lower median of the others' `- b` too (`held_consensus` "confirms"): the witness's
        own update is one member's, and in DiLoCo's first round one member's pseudo-gradient
        (four inner steps on two rows) can agree with an honest other's at `t` -2.39 where the
        round's median was 23.3 (`scripts/bench/honest_checks.py`, eight members: bf16 and
        int8 refused 3 honest checks of 504, sparse 2, one of them at `t` -6.36, below the
        floor); their consensus `t`s were 35 and more, the others' 40 to 61. The consensus
        holds every other member's update; a sign flip lies below both. Called under the
        lock."""
        relative = self.settings.relative_agreement
        others = [c for k, c in enumerate(consensus) if k != i]
        if relative is None or len(others) < self.settings.level_min_results:
            return True
        a, b = relative
        level = statistics.median_low(others) * self.settings.held_level_share
        return consensus[i] < a * level - b

    def _consensus_problem(
        self, ts: Sequence[float], consensus: Sequence[float], i: int
    ) -> str | None:
        """A held check of a witness's first round (an update of its own, no level yet), as a
        second test beside its own update's: the sum of the result's `t` along the witness's
        update and its `t` along the round's consensus (every other result of the round and
        the witness's own sent one, `_round_agreements`) against `a x held_level_share / 2 x`
        the lower median of the other results' sums `- b` (`relative_agreement`; half, as a
        sum of two: with the whole share an honest result at 5.1 + 5.7 was refused under
        0.7 x 26.5 - 6 where two copiers raised the others' sums), and only where
        their median is at least `b`: the round's results clearly agree (the median, not the
        lower one: in a four-member round an honest result's consensus holds the flip, which
        cancels an honest one, and its sum fell to 3.6). With no common signal each statistic
        is about N(0, 1.4^2) and their sum spreads up to sqrt(3) times one's (the own sent
        result is in both), so the margin `b` alone would not hold there; for an honest result
        to be refused at one witness so, the others' median must reach `b` by chance as well
        (about 2e-4 of rounds of four members, the honest one then below the threshold in
        under 1 %). A hostile result's high sum can open the test for the others in such a
        round (one honest check in about 150 refused there, at one witness: not its quorum).

        The witness's own update is one small batch's: in a four-member DisTrO run (1-bit, c16
        k4; `scripts/bench/honest_checks.py`) honest results scored `t` 3.1 to 14.5 along it
        and a sign flip -1.3 to -10.8, above the own update's threshold (0.7 x 0.5 x the lower
        median of the others - 6) at one or two witnesses of three, and with the hostile
        member's own vote that was a quorum. The round's consensus holds the other members'
        updates, which agree with each other more than with the witness's own (the flip -3.0
        and -4.7 along it, the same at every witness), so the two together refuse it at every
        witness (sums -5.9 to -23.2 under -3.7 to -5.4; the lowest honest sum 3.1).
        Only where the first test passed: the two together only add refusals. And only where
        the result's `t` along the witness's update is negative and under `held_level_share` of
        the others' lower median (the flip's was -1.3 to -10.8): two colluders of eight that
        moved a third of their entries onto an honest target's positions with its signs negated
        pulled its consensus `t` to -16.75, and its sum under the bar at every honest witness,
        while its `t` along their updates was 0.76 to 6.9 (`scripts/bench/poison.py --only
        honest-cases --cases frame`; 0.76 was under half the others' 3.66).
        Called under the lock."""
        relative = self.settings.relative_agreement
        if relative is None:
            return None
        scores = [t + c for t, c in zip(ts, consensus)]
        others = [score for k, score in enumerate(scores) if k != i]
        if len(others) < self.settings.level_min_results:
            return None
        a, b = relative
        if statistics.median(others) < b:
            return None
        # a sum of two `t`s: half the share, the own update's test's bar on each of them
        level = statistics.median_low(others) * self.settings.held_level_share / 2
        if scores[i] >= a * level - b:
            return None
        # and opposed to this witness's update, under its share of the others' too: colluders
        # can pull an honest result's consensus `t` down, not its `t` along this update
        own_level = statistics.median_low(ts[k] for k in range(len(ts)) if k != i)
        if ts[i] >= min(0.0, self.settings.held_level_share * own_level):
            return None
        return (
            f"agreement with this witness's update and the round's other results together, "
            f"t = {ts[i]:.2f} + {consensus[i]:.2f}, is below {a:g} x {level:.2f} (the others' "
            f"sums) - {b:g}, and {ts[i]:.2f} under 0 and {self.settings.held_level_share:g} x "
            f"{own_level:.2f} (the others' lower median along this witness's update)"
        )

    def _outlier_problem(
        self, sender: Hashable, ts: Sequence[float], consensus: Sequence[float], i: int
    ) -> tuple[bool, str | None] | None:
        """A held check of a round with an update of the witness's own (`consensus_outlier`,
        every round): None where the test is closed (fewer than `level_min_results` others, or
        either lower median of the others below its gate); else whether the result is an outlier
        (`c < share x C` and `t < share x T`, its `t` along the round's consensus `c` and along
        the witness's update `t`, `C` and `T` the others' lower medians) and why its sender is
        refused: an outlier now and in `outliers - 1` of its last `rounds - 1` open rounds here
        (`_outlier_flags`, kept by `_commit`).

        A result whose signs carry nothing (random signs on honest positions, a push in one
        fixed direction) has both `t`s about N(0, 1), and the own update's tests let it pass
        where honest results agree only moderately (four-member DisTrO run, c16 k4,
        `scripts/bench/honest_checks.py --hostile random-signs`: honest `t` 3.5 to 10 along
        the witness's update and 2.2 to 5 along the consensus, random signs -1.7 to 1.9 and
        -1.6 to 2.6: applied in every round). The consensus `t` is the same at every witness
        (the round's sum less the result itself); colluders can lower an honest target's (their
        results are in the sum) but not its `t` along an honest witness's own update, so both
        must be low. The consensus holds every result of the round that passed the other tests
        (`_outliers`), so a member's late negated copy of an honest result (refused by the own
        update's tests) does not lower that result's consensus `t`. Called under the lock."""
        test = self.settings.consensus_outlier
        if test is None:
            return None
        others = [k for k in range(len(ts)) if k != i]
        if len(others) < self.settings.level_min_results:
            return None
        c_level = statistics.median_low(consensus[k] for k in others)
        t_level = statistics.median_low(ts[k] for k in others)
        if c_level < test.consensus_gate or t_level < test.update_gate:
            return None
        outlier = consensus[i] < test.share * c_level and ts[i] < test.share * t_level
        if not outlier:
            return False, None
        earlier = (
            list(self._outlier_flags.get(sender, ()))[-(test.rounds - 1) :]
            if test.rounds > 1
            else []
        )
        count = 1 + sum(earlier)
        if count < test.outliers:
            return True, None
        return True, (
            f"agreement t = {consensus[i]:.2f} along the round's other results and {ts[i]:.2f} "
            f"along this witness's update, both under {test.share:g} of the others' lower "
            f"medians ({c_level:.2f}, {t_level:.2f}), in {count} of the sender's last "
            f"{len(earlier) + 1} open rounds here (at least {test.outliers} refuse)"
        )

    @staticmethod
    def _unaccept(screen: RoundScreen, check: _BlindCheck) -> None:
        """A result that passed its check (with an own update) and not the judgement the round
        took (`_commit`): out of what the round folds (its aggregate, norm level) and of its
        passed level. Called under the lock."""
        check.passed = False
        screen.accepted = [f for f in screen.accepted if f is not check.flat]
        screen.accepted_norms.remove(check.measure.norm)
        screen.agreements.remove(check.measure.agreement)
        screen.refused_agreements.append(check.measure.agreement)

    def _round_agreements(self, flats: Sequence[Flat], also: Sequence[Flat] = ()) -> list[float]:
        """Each result's `t` along the sum of the round's other results and `also` (one
        model-sized sum, each result's own values taken out again at its positions): a
        direction with no history, for a witness that has neither an update of its own nor an
        aggregate, and the consensus of a witness's first round (`_consensus_problem`) or of
        any round (`_outliers`)."""
        every = [*also, *flats]
        counts = {f.positions.numel() if f.positions is not None else -1 for f in every}
        if len(counts) == 1 and -1 not in counts:
            return _windowed_agreements(flats, also)
        total = torch.zeros(self.reader.size)
        for flat in [*also, *flats]:
            self.reader.add_into(total, flat)
        out = []
        for flat in flats:
            sizes = [values.numel() for _, values in flat.parts]
            others = _at(total, flat.positions).sub_(flat.values)
            out.append(agreement(zip(others.split(sizes), (v for _, v in flat.parts))))
        return out

    def _close(self, screen: RoundScreen) -> None:
        """Fold a round in: its accepted results into the decayed aggregate (kept as
        `scale * A`, so a round costs its results' values and one norm; not once applied
        coefficients are the aggregate), its level, its fingerprints."""
        with self._lock:
            if screen.accepted and self._applied is None:
                if self._aggregate is None:
                    self._aggregate, self._aggregate_scale = torch.zeros(self.reader.size), 1.0
                aggregate = self._aggregate
                self._aggregate_scale *= self.settings.aggregate_decay
                for flat in screen.accepted:
                    self.reader.add_into(aggregate, flat, 1.0 / self._aggregate_scale)
                if self._aggregate_scale < 1e-6:
                    aggregate.mul_(self._aggregate_scale)
                    self._aggregate_scale = 1.0
                norm = sampled_norm([aggregate])
                self._aggregate_norm = self._aggregate_scale * norm
                self._aggregate_version += 1
            if screen.accepted_norms:
                self._norm_level = statistics.median(screen.accepted_norms)
            self._last_round_checks = screen.checks
            if screen.checks < self.settings.precombine_from:
                self._direction = self._direction_key = None  # the next round gathers
            if screen.agreements or screen.refused_agreements:
                self._levels.append(_round_level(screen, self.settings.level_min_results))
                self._closed_rounds += 1
            self._fingerprints.append(list(screen.seen))
            screen.folded = True


def _windowed_agreements(flats: Sequence[Flat], also: Sequence[Flat]) -> list[float]:
    """`WitnessScreen._round_agreements` of results of as many entries each, the same bits,
    without a model-sized sum: the entries are taken `_ENTRIES` at a time, the same places of
    every result, whose positions lie in one short window of the domain (DisTrO's and sparse
    DiLoCo's results hold the same number of entries per block, blocks in order), summed
    there in the same order as the model-sized sum adds them, read back and reduced slice by
    slice as `_serial_sums` does. A fresh model-sized buffer cost its page faults and every
    scatter and gather a cache miss: a round of four checks at 20M cost 1.68 times main's
    checks with it, 1.26 times in windows (`scripts/bench/screening_ab.py --clients 5`)."""
    every = [*also, *flats]
    count = every[0].positions.numel() if every and every[0].positions is not None else 0
    nums, dens = [0.0] * len(flats), [0.0] * len(flats)
    buffer = torch.empty(0)
    for a in range(0, count, _ENTRIES):
        b = min(a + _ENTRIES, count)
        at = [f.positions[a:b] for f in every if f.positions is not None]
        lo = min(int(p.min()) for p in at)
        size = max(int(p.max()) for p in at) + 1 - lo
        if buffer.numel() < size:
            buffer = torch.empty(size)
        window = buffer[:size].zero_()
        local = [p - lo for p in at]
        for f, where in zip(every, local):
            window.index_add_(0, where, f.values[a:b])
        for j, f in enumerate(flats):
            values = f.values[a:b]
            product = window.index_select(0, local[len(also) + j]).sub_(values).mul_(values)
            nums[j] += float(product.sum())
            dens[j] += float(product.square().sum())
    return [num / math.sqrt(den) if den > 0.0 else 0.0 for num, den in zip(nums, dens)]


def _judgement_order(checks: Sequence[_BlindCheck]) -> list[int]:
    """The held checks' places in the one order a judgement takes them in, whatever the
    arrival order (the round's sum adds in this order, a blind round folds in it)."""
    return sorted(
        range(len(checks)), key=lambda k: (repr(checks[k].sender), checks[k].measure.norm)
    )


def _round_level(screen: RoundScreen, minimum: int) -> float | None:
    """A round's level: the median `t` of its results that passed on their own (not those the
    relative test let pass on the sender's results before, `RoundScreen.lenient`: a weak one
    would lower the bar for the next rounds, a hostile member's first random-sign lie in a
    three-member run to where its next ones passed; of all of them if none did so); None before
    `minimum` of them were checked against a reference."""
    passed = list(screen.agreements)
    for t in screen.lenient:
        if t in passed:
            passed.remove(t)
    level = passed or [*screen.agreements, *screen.refused_agreements]
    return statistics.median(level) if level and len(level) >= minimum else None


class RoundScreen:
    """One round as one witness screens it: its own update (`set_reference`; without one only
    the copy check runs), then `check` for each peer's result in the order they came, then
    `close` once the round has left the witness's hands."""

    def __init__(self, witness: WitnessScreen) -> None:
        self.witness = witness
        self.serial = next(witness._rounds)
        """Rounds of a witness in the order they were opened."""
        self.reference: _Own | None = None
        self.seen: list[Fingerprint] = []
        self.agreements: list[float] = []
        """The `t` of each result that passed (and, below, of each refused one)."""
        self.refused_agreements: list[float] = []
        self.lenient: list[float] = []
        """The `t`s among `agreements` below the relative bar, passed on the sender's previous
        results (`ScreeningSettings.relative_results`): no part of the round's level."""
        self.blind: list[_BlindCheck] = []
        """Without a reference, or with one but no level yet: every result checked, in the
        order they came (`judge`)."""
        self.judged = False
        """Without an update of its own, a judgement was committed (`commit`): what the round
        folds is what passed there."""
        self.committed = False
        """`commit` ran (once a round)."""
        self.own_flat: Flat | None = None
        """This witness's own sent result of the round (the first `set_reference`'s)."""
        self.blind_agreements: list[float] = []
        self.blind_norms: list[float] = []
        """Without a reference: the `t` (against the aggregate) and norm of every result
        checked so far, each judged against the others' medians (`_blind_problem`)."""
        self.accepted: list[Flat] = []
        self.accepted_norms: list[float] = []
        self.checks = 0
        """Results checked against a reference."""
        self.closed = False
        self.folded = False
        """Its level is among the witness's closed rounds' (set under the lock)."""

    def set_reference(self, reference: Reference, own_sent: Sequence[DistroResult]) -> None:
        """This witness's own update and sent result of the round (a second own result of the
        round only joins the fingerprints and the accepted results)."""
        w = self.witness
        if reference.applied is not None:
            w._adopt(reference.applied)
        flat = w.reader.flat(own_sent)
        norm, fingerprint = w.reader.describe(flat, w.settings.sketch_size)
        mine = None
        if self.reference is None:
            tensors = w.reader.domain(reference)
            size = sampled_norm(tensors)
            mine = _Own(tensors, 1.0 / size if size > 0.0 else 0.0, norm, next(w._serials))
        with w._lock:
            if self.reference is None:
                self.reference = mine
                self.own_flat = flat
                w._last_own = mine
            self.seen.insert(0, fingerprint)
            self.accepted.append(flat)
            self.accepted_norms.append(norm)

    def check(self, sender: Hashable, results: Sequence[DistroResult]) -> Verdict:
        """Whether `sender`'s result may be attested (measured outside the lock, decided and
        remembered inside it)."""
        w = self.witness
        flat = w.reader.flat(results)
        norm, fingerprint = w.reader.describe(flat, w.settings.sketch_size)
        own = self.reference
        measured: float | None = w._agreement(flat, own) if own is not None else None
        if measured is None:
            measured = w._blind_agreement(flat)
        measure = Measure(measured or 0.0, norm, fingerprint)
        with w._lock:
            if own is not None:
                self.checks += 1
            verdict = w._decide(sender, measure, self, measured is not None, own)
            if verdict.index is not None:
                self.blind[verdict.index].flat = flat
            if verdict.passed and not self.judged:
                self.accepted.append(flat)
        return verdict

    def judge(self) -> list[Verdict]:
        """The round's blind checks (no update of this witness's own: `Verdict.index`) judged
        again over every result checked so far, each against all the others (leave-one-out
        medians of their norms and agreements, the closed rounds' levels as caps), so the
        order the results came in no longer matters: a hostile result that came first and
        passed against nothing is refused once honest ones follow, and an honest one a hostile
        first result made fail passes. A witness with neither an update of its own nor an
        aggregate yet (its very first round) measures each result's agreement along the sum of
        the round's others. One verdict per blind check, by index; the client votes by these
        when it sends its witness (`psyche.client.round.payloads.settle_blind_votes`).

        Pure: the round's state changes only by `commit`, so a judgement may be made again
        (a held check came in after it) and any thread may make it."""
        return self.witness._judge(self)

    def commit(self, verdicts: Sequence[Verdict]) -> None:
        """The round takes `verdicts` (`judge`'s), the judgement its votes are cast by: what it
        folds into the witness's memory and the level it lends follow them, once (a later
        commit changes nothing). The state is that of one judgement of the checks `verdicts`
        cover, however many were made before."""
        self.witness._commit(self, verdicts)

    def settle(self, verdicts: Mapping[_K, Verdict]) -> dict[_K, Verdict]:
        """The verdicts this witness votes by, as a client casts its votes
        (`psyche.client.round.payloads.settle_blind_votes`): each held one (`Verdict.index`)
        replaced by the round's judgement (`judge`, committed), the others as they were
        checked."""
        if all(v.index is None for v in verdicts.values()):
            return dict(verdicts)
        judged = self.judge()
        self.commit(judged)
        return {k: v if v.index is None else judged[v.index] for k, v in verdicts.items()}

    def close(self) -> None:
        """Fold the round into the witness's memory (once)."""
        w = self.witness
        with w._lock:
            if self.closed:
                return
            self.closed = True
        w._close(self)


# --------------------------------------------------------------------------------------------
# Witnessing in one process (the research simulations)


class RoundTamper(Protocol):
    """Hostile members of a simulation (`psyche.modeling.hostile.HostileMembers`): called once a
    round with every member's sent results and the optimizer, returns what each one sends."""

    indices: frozenset[int]
    late: frozenset[int]

    def __call__(
        self, sent: Sequence[Sequence[DistroResult]], source: Distro | Diloco
    ) -> list[list[DistroResult]]: ...


@dataclass
class Tally:
    """What a simulation's witnesses decided, by the sender's honesty."""

    honest_checks: int = 0
    honest_refused: int = 0
    hostile_checks: int = 0
    hostile_refused: int = 0
    lowest_honest_agreement: float = math.inf
    refusals: list[str] = field(default_factory=list)
    """Why honest results were refused."""
    hostile_applied: list[tuple[int, int]] = field(default_factory=list)
    """(round, member) of every hostile result a quorum vouched for, rounds counted from 0."""
    rounds: int = 0


class WitnessPanel:
    """Every member of a simulated run witnesses every round (`witness_nodes = 0`): an honest
    member screens the others' results against its own update (a `WitnessScreen` each) and
    keeps its own; a hostile one vouches for every result. A result is applied when at least
    the coordinator's quorum of witnesses vouch for it (`witness_quorum_for`). Results are
    checked in the order they would arrive: the `late` members' (copiers) last."""

    def __init__(
        self,
        optimizer: Distro | Diloco,
        settings: ScreeningSettings,
        members: int,
        hostile: RoundTamper | None = None,
    ) -> None:
        self.reader = ResultReader.of(optimizer)
        self.settings = settings
        self.members = members
        self.hostile = hostile.indices if hostile is not None else frozenset()
        self.late = hostile.late if hostile is not None else frozenset()
        self.quorum = witness_quorum_for(0, members)
        self.tally = Tally()
        self.screens = {
            w: WitnessScreen(self.reader, settings) for w in range(members) if w not in self.hostile
        }

    def accepted(
        self,
        results: Sequence[Sequence[DistroResult]],
        own: Mapping[int, tuple[Reference, Sequence[DistroResult]]],
    ) -> list[int]:
        """Which members' results of this round the run applies, ascending. `own`: each honest
        member's reference and honest sent result."""
        order = sorted(range(len(results)), key=lambda i: (i in self.late, i))
        votes = [0] * len(results)
        for w in range(self.members):
            screen = self.screens.get(w)
            if screen is None:
                votes = [v + 1 for v in votes]
                continue
            votes[w] += 1  # its own result
            rnd = screen.open_round()
            rnd.set_reference(*own[w])
            checked = {i: rnd.check(i, results[i]) for i in order if i != w}
            for i, verdict in rnd.settle(checked).items():
                self._count(i, verdict)
                votes[i] += 1 if verdict.passed else 0
            rnd.close()
        accepted = [i for i, v in enumerate(votes) if v >= self.quorum]
        tally = self.tally
        tally.hostile_applied += [(tally.rounds, i) for i in accepted if i in self.hostile]
        tally.rounds += 1
        return accepted

    def _count(self, sender: int, verdict: Verdict) -> None:
        t = self.tally
        if sender in self.hostile:
            t.hostile_checks += 1
            t.hostile_refused += 0 if verdict.passed else 1
            return
        t.honest_checks += 1
        t.lowest_honest_agreement = min(t.lowest_honest_agreement, verdict.measure.agreement)
        if not verdict.passed:
            t.honest_refused += 1
            t.refusals.append(str(verdict.problem))


def simulate_round(
    sent: Sequence[list[DistroResult]],
    optimizers: Sequence[Distro | Diloco],
    send: Callable[[list[DistroResult], int], list[DistroResult]],
    hostile: RoundTamper | None,
    witnesses: WitnessPanel | None,
) -> tuple[list[list[DistroResult]], list[int]]:
    """One round's exchange in a simulation: each honest member's reference (its optimizer's
    own update, taken before anything else runs on it), the hostile members' rewrite, every
    result through `send(result, member)` (the wire), and the witnesses' verdict. Returns what
    was received and which members' results the run applies."""
    own = {}
    if witnesses is not None:
        own = {
            i: (witnesses.reader.reference(optimizer), sent[i])
            for i, optimizer in enumerate(optimizers)
            if i not in witnesses.hostile
        }
    if hostile is not None:
        sent = hostile(sent, optimizers[0])
    received = [send(results, i) for i, results in enumerate(sent)]
    if witnesses is None:
        return received, list(range(len(received)))
    return received, witnesses.accepted(received, own)
