"""Regression tests for the bugs the chaos suite found (each names the scenario that showed it)."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import trio

from psyche.coordinator import ClientState, RunState
from psyche.coordinator.server_core import ServerCore
from psyche.coordinator.testing import quick_coordinator, simulated_identity

from ..timing import scaled

NOW = 1_000_000
A, B, C = (simulated_identity(i) for i in range(3))


def test_a_client_restarted_with_the_same_key_is_not_kicked_from_pending() -> None:
    """sigkill: a killed client's replacement (same key, new connection) joined, but the per-tick
    kick of exited clients removed it again, so it never trained in any later epoch."""
    core = ServerCore.start(quick_coordinator(), now=NOW)
    for client in (A, B, C):
        core.on_join(client, core.run_id)
    now = NOW + 2
    core.on_tick(now, 1)
    assert core.coordinator.run_state is RunState.Warmup
    core.on_disconnect(C)  # the process was killed: withdrawn
    core.on_tick(now + 1, 2)
    assert [c.id for c in core.coordinator.epoch_state.exited_clients] == [C]
    core.on_join(C, core.run_id)  # its replacement connects
    for tick in range(3):
        core.on_tick(now + 1, 3 + tick)
    assert C in core.pending_clients
    # a client that stays connected and is dropped is still kicked, as upstream
    core.coordinator.epoch_state.clients[0].state = ClientState.Dropped
    core.on_join(A, core.run_id)
    core.kick_unhealthy_clients()
    assert A in core.pending_clients  # not exited yet
    core.coordinator._move_clients_to_exited(0)
    core.kick_unhealthy_clients()
    assert A not in core.pending_clients
    assert C in core.pending_clients


def test_a_dropped_client_that_joins_again_is_not_kicked_from_pending() -> None:
    """hostile_members (a loaded machine): an honest client too slow for a round was dropped by
    a health check and stayed connected; upstream's kick undid every later Join, so it sat out
    the rest of the run (and a run that needed it waited for good). A Join sent after it left
    the epoch is kept; one sent before (its old pending entry) is still kicked."""
    core = ServerCore.start(quick_coordinator(), now=NOW)
    for client in (A, B, C):
        core.on_join(client, core.run_id)
    core.on_tick(NOW + 2, 1)
    assert core.coordinator.run_state is RunState.Warmup
    core.coordinator.epoch_state.clients[0].state = ClientState.Dropped
    core.on_join(A, core.run_id)  # still in the epoch: this is no new request
    core.coordinator._move_clients_to_exited(0)
    core.kick_unhealthy_clients()
    assert A not in core.pending_clients
    core.on_join(A, core.run_id)  # it left, and asks to come back
    for _ in range(3):
        core.kick_unhealthy_clients()
    assert A in core.pending_clients


def test_a_round_without_witnesses_does_not_lock_everyone_out() -> None:
    """sigkill: the one elected witness (witness_nodes = 1) was killed; the round had no
    witness, the coordinator withdrew every client (upstream), the server kicked them all from
    the pending set on every tick, and the run never started again although two clients were
    connected and waiting."""
    from psyche.coordinator.backend import OpportunisticData
    from psyche.coordinator.testing import warmup_witness_for

    core = ServerCore.start(quick_coordinator(init_min_clients=2, witness_nodes=1), now=NOW)
    for client in (A, B, C):
        core.on_join(client, core.run_id)
    now = NOW + 2
    core.on_tick(now, 1)
    assert core.coordinator.run_state is RunState.Warmup
    for index, client in enumerate(core.coordinator.epoch_state.clients):
        core.on_witness(client.id, OpportunisticData.WarmupStep(warmup_witness_for(index)), now, 7)
    assert core.coordinator.run_state is RunState.RoundTrain
    core.on_disconnect(C)  # the witness dies; nobody witnesses the round
    states = [core.coordinator.run_state]
    while not (RunState.Cooldown in states and states[-1] is RunState.Warmup):
        assert len(states) < 20, states  # before the fix: WaitingForMembers forever
        now += 1
        core.on_tick(now, 2)
        states.append(core.coordinator.run_state)
    assert list(core.pending_clients) == [A, B]
    assert [c.id for c in core.coordinator.epoch_state.clients] == [A, B]


def test_libp2p_addresses_follow_the_announce_host() -> None:
    """partition: a node bound to one address announced its libp2p listener at the bound
    address and its blob listener at the announce host, so peers bypassed the announced route
    (a NAT's public address) for gossip."""
    from psyche.client.round.broadcast import open_network
    from psyche.network.connection import NetworkConfig
    from psyche.network.ticket import TransportAddr

    async def main() -> list[str]:
        config = NetworkConfig(run_id="r", bind_host="127.0.0.1", announce_host="127.0.0.9")
        async with open_network(config) as network:
            addrs = network.endpoint_addr().addrs
            return [
                a.value
                for a in addrs
                if isinstance(a, TransportAddr.Libp2p | TransportAddr.BlobTcp)
            ]

    found = trio.run(main)
    assert len(found) == 2, found
    assert all("127.0.0.9" in a and "127.0.0.1" not in a for a in found), found


def _run_with_file_size_limit(code: str, limit: int, cwd: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter whose files cannot grow past `limit` bytes (a full disk:
    writes fail with EFBIG instead of ENOSPC, through the same error paths)."""

    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        preexec_fn=limit_files,
        timeout=scaled(120),  # an interpreter that imports torch, on a busy machine
    )


def test_a_checkpoint_that_hits_a_full_disk_leaves_nothing_behind(tmp_path: Path) -> None:
    """disk-full: the step directory was created first and filled file by file, so a failed
    save left a directory named like a checkpoint without its model."""
    code = f"""
import torch
from pathlib import Path
from psyche.client.checkpoints.store import RunInstance, save_checkpoint_locally
target = Path({str(tmp_path)!r}) / "run-step7"
try:
    save_checkpoint_locally(
        target, {{"w": torch.zeros(100_000)}}, [], "{{}}", "{{}}",
        run=RunInstance("run", "instance"), step=7,
    )
except Exception as e:  # safetensors reports the I/O error as its own type
    print("failed:", e)
else:
    print("saved")
"""
    done = _run_with_file_size_limit(code, 64 * 1024, str(tmp_path))
    assert "failed:" in done.stdout, done.stdout + done.stderr
    assert "os error 27" in done.stdout, done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    # with room enough, the same call writes a complete checkpoint
    done = _run_with_file_size_limit(code, 16 << 20, str(tmp_path))
    assert "saved" in done.stdout, done.stdout + done.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["run-step7"], names
    assert sorted(p.name for p in (tmp_path / "run-step7").iterdir()) == [
        "config.json",
        "model.safetensors",
        "psyche-manifest.json",
        "tokenizer.json",
    ]


def test_a_saved_state_that_hits_a_full_disk_keeps_the_previous_one(tmp_path: Path) -> None:
    """disk-full on the server: the state file and `latest` are replaced whole or not at all."""
    from psyche.centralized.save_state import load_state, save_state
    from psyche.coordinator.testing import quick_coordinator

    first = save_state(tmp_path, quick_coordinator())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code = f"""
from psyche.centralized.save_state import save_state
from psyche.coordinator.testing import quick_coordinator
state = quick_coordinator()
state.progress.step = 42
try:
    save_state({str(tmp_path)!r}, state)
except OSError as e:
    print("failed:", e.errno)
else:
    print("saved")
"""
    done = _run_with_file_size_limit(code, 512, str(tmp_path))
    assert "failed: 27" in done.stdout, done.stdout + done.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert load_state(tmp_path).progress.step == load_state(first).progress.step


def test_a_fetch_that_outlives_its_round_does_not_stop_the_client() -> None:
    """Found by the soak: a client stalled (SIGSTOP) mid-round woke up after its round had stopped
    reading batches; the fetch task then sent into the closed channel and its BrokenResourceError
    took the whole client down (exit code 1)."""
    import numpy as np

    from psyche.client.round.fetch import DataFetcher
    from psyche.core.batch_id import BatchId
    from psyche.data_provider import TokenizedData

    class SlowData:
        def __init__(self) -> None:
            self.served = 0

        async def get_samples(self, batch: BatchId) -> list[TokenizedData]:
            await trio.sleep(0.05)
            self.served += 1
            return TokenizedData.from_rows(np.zeros((len(batch), 8), dtype=np.int32))

    async def main() -> int:
        data = SlowData()
        with trio.fail_after(30):
            # The nursery ends only when the fetcher's tasks have: no fixed wait needed.
            async with trio.open_nursery() as nursery:
                fetcher = DataFetcher(data, nursery, buffer=0)
                receive = fetcher.fetch([BatchId(0, 1), BatchId(2, 3)])
                await trio.sleep(0.01)
                await receive.aclose()  # the round is over before its first batch arrives
        return data.served

    assert trio.run(main) == 1  # fetched one batch, found nobody reading, stopped quietly
