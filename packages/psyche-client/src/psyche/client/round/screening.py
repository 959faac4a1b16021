"""This client's witness checks of its peers' results, round by round (the glue between the
round's state and `psyche.modeling.screening`): a round this client starts opens its checks
(`WitnessScreening.open_round`), its own update becomes their reference once it is known
(`set_reference`), and a peer's decoded result is checked against it (`screen_result`, handed to
`payloads.check_payload`); before the witness of a round is sent, the round's held checks are
judged as a whole (`judge_round`); a round that is over closes its checks (`close_round`).

A peer's result waits for this client's own update of the round (or for the certainty that none
is coming: `RoundState.reference_ready`), so every honest witness checks against the same kind
of reference; the checks and the judgement run in worker threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from psyche.client.background import Background
from psyche.client.round import payloads
from psyche.client.round.state import RoundState
from psyche.client.round.train import OwnResult
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    from psyche.modeling.distro import DistroResult
    from psyche.modeling.screening import RoundScreen, Verdict, WitnessScreen
    from psyche.modeling.trainer import Trainer


class WitnessScreening:
    """The checks of one client's trainer (`enabled` off: none, every result whose bytes check
    out is attested, as upstream does). What it remembers of the results it screened spans
    rounds (`WitnessScreen`), built on the first round it opens."""

    def __init__(self, trainer: Trainer, enabled: bool = True) -> None:
        self.trainer = trainer
        self.enabled = enabled
        self._witness_screen: WitnessScreen | None = None

    def open_round(self) -> RoundScreen | None:
        """This client's checks of a round it starts (None when it does not screen)."""
        if not self.enabled:
            return None
        if self._witness_screen is None:
            from psyche.modeling.screening import WitnessScreen, screening_settings

            reader = self.trainer.screening_reader()
            if reader is None:
                return None
            self._witness_screen = WitnessScreen(reader, screening_settings(reader))
        return self._witness_screen.open_round()


def close_round(round_state: RoundState, tasks: Background) -> None:
    """The round is over here: its checks let go of what they hold (in a worker thread)."""
    screen = round_state.screen
    if screen is not None:
        tasks.start_soon(trio.to_thread.run_sync, screen.close)


def set_reference(round_state: RoundState, result: OwnResult, tasks: Background) -> None:
    """This client's own update of `round_state` (its recorded result) becomes the reference of
    the round's checks, set in the background; checks waiting for it go on once it is (or at
    once when the round has no checks, or this client no update)."""
    screen = round_state.screen
    if screen is None or round_state.reference_ready.is_set():
        return
    if result.reference is None:
        round_state.reference_ready.set()
        return
    reference = result.reference
    round_state.reference_pending = True

    async def set_it() -> None:
        try:
            await trio.to_thread.run_sync(screen.set_reference, reference, result.sent)
        finally:
            round_state.reference_ready.set()

    tasks.start_soon(set_it)


async def screen_result(
    round_state: RoundState, sender: NodeIdentity, results: list[DistroResult]
) -> Verdict | None:
    """This client's witness checks of a peer's decoded result (`payloads.check_payload`),
    once its own update of that round is known (or known to be missing)."""
    screen = round_state.screen
    if screen is None:
        return None
    await round_state.reference_ready.wait()
    return await trio.to_thread.run_sync(screen.check, sender, results)


async def judge_round(round_state: RoundState) -> None:
    """Judge the round's held checks as a whole (`RoundScreen.judge`: leave-one-out medians,
    in a witness's very first round one model-sized sum of the round's results) in a worker
    thread, before this client sends its witness of the round (`payloads.settle_blind_votes`
    casts the votes by it): the event loop goes on meanwhile. Again while a held check came in
    during a judgement (each pass covers more of the round's bounded checks), so the judgement
    covers every held check the loop has seen; nothing when no held vote waits. The verdicts
    are `judge`'s, the same whichever thread makes them; a judgement changes nothing in the
    round (the round takes the one its votes are cast by: `RoundScreen.commit`), so one made
    again ends where a single one would."""
    if not payloads.judgement_due(round_state):
        return  # no checkpoint: nothing waits
    async with round_state.judging:
        while payloads.judgement_due(round_state):
            screen = round_state.screen
            assert screen is not None  # `judgement_due` says there is one
            held = round_state.held_checks
            round_state.judgement = await trio.to_thread.run_sync(screen.judge)
            if len(round_state.judgement) < held:
                return  # cannot happen (a held check is in its screen before its verdict)


__all__ = ["WitnessScreening", "close_round", "judge_round", "screen_result", "set_reference"]
