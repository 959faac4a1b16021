"""Fixtures the client tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .hub_endpoint import HubEndpoint, point_huggingface_hub_at


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubEndpoint]:
    """A hub stand-in on loopback (`hub_endpoint.py`) that `huggingface_hub` talks to."""
    endpoint = HubEndpoint()
    with endpoint.serving():
        point_huggingface_hub_at(monkeypatch, endpoint.url, tmp_path / "hf-home")
        yield endpoint
