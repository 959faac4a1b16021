"""Shared test configuration: GPU skipping, the end-to-end files' order (longest first),
access to upstream's reference data, and OpenMP threads that wait without spinning."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterator

import pytest

from .upstream_data import UpstreamData

# Before anything imports torch (OpenMP reads it once, when torch loads it), for this process,
# its xdist workers and every process a test starts: an OpenMP thread that waits for its team
# sleeps instead of spinning. On the busy two-core machines this suite runs on, a spinning
# thread takes the CPU that the thread it waits for needs. A verifier on two intra-op threads,
# each run side by side with and without, at load 21-23: test_verification.py's 12 rounds took
# 324 s (43 s of CPU) spinning, 119 s (17 s) sleeping; test_verification_shadow.py's two
# thread-count tests 274 s (36 s) and 158 s (16 s). The policy changes when a thread waits, not
# the work it does: the results are the same bits. (An explicit OMP_WAIT_POLICY is kept.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

E2E_SECONDS = {
    # CI run 22 of 6613051 with two CPU-bound processes beside it (2026-11-28): setup + call +
    # teardown of each file's tests, `--durations`
    "tests/e2e/test_hostile_members.py": 170,
    "tests/e2e/test_nat.py": 130,
    "tests/e2e/test_training.py": 93,
    "tests/e2e/test_server_restart.py": 84,
    "tests/chaos/test_chaos_attacks.py": 81,
    "tests/e2e/test_parallel_clients.py": 73,
    "tests/chaos/test_chaos_short.py": 73,
    "tests/e2e/test_verifiers.py": 70,  # CI run 22's 34 for its one run, doubled (the followers')
    "tests/e2e/test_poisoned_members.py": 67,
    "tests/solana/test_train_e2e.py": 66,
    "tests/e2e/test_hostile_strangers.py": 60,
    "tests/e2e/test_gpu_script.py": 46,
    "tests/solana/test_verifiers_e2e.py": 45,
    "tests/solana/test_verifiers_train_e2e.py": 50,  # five members: 144-164 s alone at load 14-21
    "tests/e2e/test_run_finishes.py": 36,
    "tests/e2e/test_verifiers_train.py": 40,  # CI run 23 (3 e2e workers, load 8-13)
    # multi-rank files moved out of the unit phase (their setup in CI run 23's unit phase)
    "tests/client/test_parallel_witness.py": 60,
    "tests/modeling/test_torchtitan_2d.py": 45,
    "tests/e2e/test_local_testnet.py": 18,
    "tests/chaos/test_hostile_peer.py": 0,  # `just chaos` only: skipped here
}
"""How long each end-to-end file took (`--durations=0`, the e2e workers of one run on a loaded
two-core machine): only their order matters. scripts/test.sh hands whole files to its e2e
workers in collection order (`--dist loadfile --no-loadscope-reorder`), so the longest go first
and the short ones fill in at the end; in xdist's own order (most tests first) a 6-minute file
could start last and run alone. A file not listed counts as a middling one."""


def e2e_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with the end-to-end files longest first (`E2E_SECONDS`), each file's tests kept
    together and in order; the other tests ahead of them, as collected."""
    default = statistics.median(E2E_SECONDS.values())

    def cost(item: pytest.Item) -> float:
        if "e2e" not in item.keywords:
            return math.inf  # first: the unit tests keep their order
        return E2E_SECONDS.get(item.nodeid.split("::", 1)[0], default)

    return sorted(items, key=lambda item: -cost(item))  # stable: a file's tests stay in order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selection = config.getoption("markexpr", "") or ""
    for item in items:
        # Whole-system tests run separate processes that need the machine to themselves.
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.e2e)
        # The long chaos scenarios (about 10 minutes each) run only when asked for by marker.
        if "chaos_long" in item.keywords and "chaos_long" not in selection:
            item.add_marker(pytest.mark.skip(reason="long chaos scenario: run `just chaos`"))
    items[:] = e2e_order(items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    # torch is imported only when a GPU test was collected: it costs seconds.
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def upstream_data() -> UpstreamData:
    """Upstream's reference files: skips when `PSYCHE_UPSTREAM_DATA` is unset, fails when it is
    set and something is missing (see tests/upstream_data.py)."""
    return UpstreamData.from_environment()


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One torch thread for the test (a run of several tiny members is many small ops; OpenMP
    spinning on a busy 2-core machine only slows it), the setting restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
