"""Which hub failures a model load reports as `ModelUnreachable` (the client leaves the epoch
and joins again at the next warmup) and which as a plain `ModelLoadError` (the client ends in
one line): a real hub stand-in on loopback (`hub_endpoint.py`) answering with an HTTP error, a
loopback port that refuses connections, and a host name under `.invalid`, which never resolves.

Before: only a refused or dropped connection or a timeout was transient; a hub answering 500 or
503, or a DNS failure, ended the client like a repo that is not there."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from psyche.client.setup.model_loading import ModelUnreachable, check_device, load_hub_checkpoint
from psyche.modeling.causal_lm import ModelLoadError

from .hub_endpoint import HubEndpoint, point_huggingface_hub_at

REPO = "psyche-tests/tiny-llama"


def _load() -> None:
    load_hub_checkpoint(REPO, None, "HfAuto", check_device("cpu"))


@pytest.mark.parametrize("status", [500, 502, 503, 429])
def test_a_hub_that_answers_try_later_is_unreachable(
    hub: HubEndpoint, model_dir: Path, status: int
) -> None:
    hub.create_repo(REPO, {"config.json": (model_dir / "config.json").read_bytes()})
    hub.fail_status = status
    with pytest.raises(ModelUnreachable) as raised:
        _load()
    assert REPO in str(raised.value)
    assert str(status) in str(raised.value)
    assert hub.requests  # the hub was asked, and said no for now


def test_a_hub_name_that_does_not_resolve_is_unreachable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(socket.gaierror):  # the premise: the name never resolves
        socket.getaddrinfo("psyche-hub.invalid", 443)
    point_huggingface_hub_at(monkeypatch, "http://psyche-hub.invalid", tmp_path / "hf-home")
    with pytest.raises(ModelUnreachable) as raised:
        _load()
    assert REPO in str(raised.value)


def test_a_hub_that_refuses_connections_is_unreachable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, held_port: int
) -> None:
    url = f"http://127.0.0.1:{held_port}"
    point_huggingface_hub_at(monkeypatch, url, tmp_path / "hf-home")
    with pytest.raises(ModelUnreachable):
        _load()


@pytest.mark.parametrize("status", [None, 401, 403])
def test_a_repo_the_hub_refuses_is_a_plain_load_error(hub: HubEndpoint, status: int | None) -> None:
    """Not found (None: the repo is not there, a 404), or not allowed: the hub answered, and
    will answer the same at the next warmup."""
    hub.fail_status = status
    with pytest.raises(ModelLoadError) as raised:
        _load()
    assert not isinstance(raised.value, ModelUnreachable)
    assert REPO in str(raised.value)
