"""Shared test configuration: GPU skipping and access to upstream's reference data."""

from __future__ import annotations

import pytest

from .upstream_data import UpstreamData


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selection = config.getoption("markexpr", "") or ""
    for item in items:
        # Whole-system tests run separate processes that need the machine to themselves.
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.e2e)
        # The long chaos scenarios (about 10 minutes each) run only when asked for by marker.
        if "chaos_long" in item.keywords and "chaos_long" not in selection:
            item.add_marker(pytest.mark.skip(reason="long chaos scenario: run `just chaos`"))
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
