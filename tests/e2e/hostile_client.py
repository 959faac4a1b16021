"""A hostile run member as a real process, for the end-to-end tests only (never a command):

    python tests/e2e/hostile_client.py ATTACK START -- <psyche-client train arguments>

runs `psyche-client train` with every trainer it builds turned hostile
(`psyche.modeling.hostile.make_hostile`): from its `START`th result on, it commits to and sends
what `ATTACK` (`sign-flip`, `scaled`, ...) makes of its honest results. Its payloads hash to
their commitments and pass every check of their bytes: only the witnesses' checks can tell.

With `HOSTILE_VERIFIER=1` in its environment it also lies as a verifier (issue 27): whenever it
is a round's verifier it reports every result it verified as wrong (an honest tie-breaker's
verdicts stay honest: as tie-breaker it tells the truth, so the test can tell who is judged).
With `HOSTILE_FOLLOWER=silent` it sends no follower report (exact verification): its biased
rebuilds would accuse every honest trainer it follows and lose to their two other followers'
words, which the test of its followers' verdict on it keeps out of the way (the rule is
`tests/coordinator/test_following.py`'s).
"""

from __future__ import annotations

import os
import sys

from psyche.modeling import trainer as trainer_module
from psyche.modeling.hostile import Attack, HostileMember, make_hostile


def lie_as_verifier() -> None:
    """Every finding this client reports as a verifier says "does not match"."""
    from collections.abc import Callable

    from psyche.client.round import verify
    from psyche.client.round.state import RoundState
    from psyche.coordinator.verification import Finding, VerificationReport

    honest = verify.compare_and_report

    async def lying(
        trainer: trainer_module.Trainer,
        job: verify.VerifyJob,
        recomputed: verify.Recomputations,
        round_state: RoundState,
        deadline: float,
        send: Callable[[VerificationReport], None],
    ) -> VerificationReport:
        if job.tie_breaker:
            return await honest(trainer, job, recomputed, round_state, deadline, send)

        def send_lies(report: VerificationReport) -> None:
            lies = [Finding(f.batch_id, False, f.score) for f in report.findings]
            send(VerificationReport(report.step, lies, report.draw))

        return await honest(trainer, job, recomputed, round_state, deadline, send_lies)

    verify.compare_and_report = lying


def silent_follower() -> None:
    """This client follows as any member does but sends no follower report."""
    from psyche.client.round import follow

    async def silent(*args: object, **kwargs: object) -> None:
        return None

    follow.compare_and_report = silent  # type: ignore[assignment]


def main() -> None:
    attack, start, separator, *client_args = sys.argv[1:]
    assert separator == "--", "usage: hostile_client.py ATTACK START -- <train arguments>"
    honest_init = trainer_module.Trainer.__init__

    def hostile_init(self: trainer_module.Trainer, *args: object, **kwargs: object) -> None:
        honest_init(self, *args, **kwargs)  # type: ignore[arg-type]
        make_hostile(self, HostileMember(Attack(attack), seed=7, start=int(start)))

    trainer_module.Trainer.__init__ = hostile_init  # type: ignore[method-assign]
    if os.environ.get("HOSTILE_VERIFIER") == "1":
        lie_as_verifier()
    if os.environ.get("HOSTILE_FOLLOWER") == "silent":
        silent_follower()
    from psyche.cli.client.main import main as client_main

    sys.exit(client_main(client_args))


if __name__ == "__main__":
    main()
