"""Which hub failures a model load reports as `ModelUnreachable` (the client leaves the epoch
and joins again at the next warmup) and which as a plain `ModelLoadError` (the client ends in
one line): a real hub stand-in on loopback (`hub_endpoint.py`) answering with an HTTP error, a
loopback port that refuses connections, and a host name whose lookup fails (in a child process
cut off from every network, `tests/no_network.py`: no DNS query leaves the machine).

Before: only a refused or dropped connection or a timeout was transient; a hub answering 500 or
503, or a DNS failure, ended the client like a repo that is not there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psyche.client.setup.model_loading import ModelUnreachable, check_device, load_hub_checkpoint
from psyche.modeling.causal_lm import ModelLoadError

from .. import no_network
from .hub_endpoint import HubEndpoint, point_huggingface_hub_at

REPO = "psyche-tests/tiny-llama"
NO_SUCH_HOST = "psyche-hub.invalid"
WHY_NOT = no_network.unavailable()

LOOK_UP_AND_LOAD = """
import json, socket, sys
from psyche.client.setup.model_loading import ModelUnreachable, check_device, load_hub_checkpoint
from psyche.modeling.causal_lm import ModelLoadError

repo, host = sys.argv[1:]
try:
    socket.getaddrinfo(host, 443)
    lookup = None
except socket.gaierror as error:
    lookup = repr(error)
try:
    load_hub_checkpoint(repo, None, "HfAuto", check_device("cpu"))
    load = None
except ModelLoadError as error:
    load = {"unreachable": isinstance(error, ModelUnreachable), "message": str(error)}
print(json.dumps({"lookup": lookup, "load": load}))
"""
"""Run with REPO and a host name in a process of its own: what the host name's lookup raised and
what loading REPO (its hub at that host, through the environment) raised, as one JSON line."""


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


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no network-less child here: {WHY_NOT}")
def test_a_hub_name_that_does_not_resolve_is_unreachable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The lookup and the load run in a child with no network (`no_network`): the system
    resolver cannot reach its name server, so the lookup fails at once with a real
    `socket.gaierror` and no query leaves the machine (here, a resolver that is slow to answer
    cannot stall the test either)."""
    point_huggingface_hub_at(monkeypatch, f"http://{NO_SUCH_HOST}", tmp_path / "hf-home")
    child = subprocess.run(
        no_network.argv([sys.executable, "-c", LOOK_UP_AND_LOAD, REPO, NO_SUCH_HOST]),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    outcome = json.loads(child.stdout.splitlines()[-1])
    assert outcome["lookup"] is not None  # the premise: the name does not resolve there
    load = outcome["load"]
    assert load is not None, outcome  # the load failed
    assert load["unreachable"], load
    assert REPO in load["message"]


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
