"""Fixtures the client tests share."""

from __future__ import annotations

import socket
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


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port bound, not listening, for the test's duration: connections to it are
    refused until a server listens there (its listener binds beside this socket: both reuse the
    address), and no other process's socket is given it meanwhile."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        yield int(held.getsockname()[1])


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tiny Llama's config.json in a directory (the ranks build it from its config)."""
    import json

    from psyche.modeling.configs import llama_config_dict

    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(llama_config_dict("tiny")))
    return directory
