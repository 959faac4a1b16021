"""A run's state at an epoch boundary: what a server saves, and what it starts from.

What a saved state means (docs/centralized.md, "Saving and resuming"): the run as it would be
right after an epoch ended, so that a restarted server continues it with the clients that hold
the model. `resume_snapshot` makes that state from the live coordinator:

* at an epoch end (upstream saves there) it only restores the `--init-warmup-time` override and
  empties `exited_clients`;
* mid-epoch (the save on shutdown), the epoch is closed as its cooldown would close it: the next
  epoch starts after the current round's data, the epoch counter advances, non-healthy clients
  leave, and a Hub/Gcs checkpoint becomes P2P (the clients now hold a newer model than the repo);
* the clients of the last epoch keep their identities (upstream zeroes them), so when one of
  them rejoins, joiners fetch the model from it (P2P) rather than from the initial repo;
* the state is WaitingForMembers (upstream), except that a Finished run stays Finished.

The files themselves are the server's business (`psyche.centralized.save_state`).
"""

from __future__ import annotations

from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.run_state import ClientState, RunState
from psyche.core.numeric import truncating_cast_unsigned, wrapping_u64


def close_epoch(coordinator: Coordinator) -> None:
    """End a running epoch in place as its cooldown tick would (without the clock)."""
    if coordinator.run_state not in (
        RunState.RoundTrain,
        RunState.RoundWitness,
        RunState.Cooldown,
    ):
        return
    current = coordinator.current_round()
    if current is not None:
        batch_size = coordinator.get_target_global_batch_size(current)
        coordinator.progress.epoch_start_data_index = wrapping_u64(current.data_index + batch_size)
    coordinator.progress.epoch = truncating_cast_unsigned(coordinator.progress.epoch + 1, 16)
    epoch_state = coordinator.epoch_state
    epoch_state.clients = [c for c in epoch_state.clients if c.state is ClientState.Healthy]
    llm = coordinator.model.value
    match llm.checkpoint:
        case Checkpoint.Hub(repo) | Checkpoint.Dummy(repo):
            llm.checkpoint = Checkpoint.P2P(repo)
        case Checkpoint.Gcs(repo):
            llm.checkpoint = Checkpoint.P2PGcs(repo)
    epoch_state.cold_start_epoch = False
    coordinator.pending_pause = False


def resume_snapshot(coordinator: Coordinator, original_warmup_time: int) -> Coordinator:
    """The state to write to disk (see the module docstring); `coordinator` is not changed."""
    state = coordinator.copy()
    state.config.warmup_time = original_warmup_time
    close_epoch(state)
    if state.run_state is not RunState.Finished:
        state.run_state = RunState.WaitingForMembers
    state.epoch_state.exited_clients = []
    return state


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


__all__ = ["close_epoch", "prepare_for_start", "resume_snapshot"]
