"""A joiner facing providers of another model version: how often it asks them again (a fake
clock), and that the configuration it plans the download from is of the version it wants (real
nodes, both answer orders)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from psyche.modeling.sharing import TENSOR_CODEC, model_hash
from psyche.network.connection import NetworkConnection
from psyche.network.connection_monitor import ConnectionMonitor
from psyche.network.model_download import ModelDownload
from psyche.network.model_sharing import results_version
from psyche.network.peer_manager import (
    MAX_OTHER_VERSION_RETRY_SECS,
    NO_PEER_SLEEP_SECS,
    NOT_SERVING_RETRY_SECS,
    OtherModelVersion,
    PeerManager,
    PeersUnreachable,
    blob_ticket_param_request_task,
)
from psyche.network.testing import open_nodes, serve_model
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr, blob_hash
from psyche.network.transmittable import (
    ModelRequestType,
    SharableModelError,
    SharableModelFailure,
    TicketResult,
)

from .model_providers import (
    CONFIG_JSON,
    TOKENIZER_JSON,
    introduce_all,
    make_parameters,
    provider_model,
)

NEWER, OLDER, HONEST = (bytes([i]) * 32 for i in range(1, 4))
WANTED = 20
CONFIG = ModelRequestType.Config()


def _ticket(provider: bytes) -> BlobTicket:
    return BlobTicket(EndpointAddr(provider, []), BlobFormat.Raw, blob_hash(b"config"), 6)


def test_a_peer_of_a_newer_version_is_asked_ever_less_often() -> None:
    """A peer that keeps naming a newer model rests 2, 4, 8, 16, 32, 32 s between its
    answers (the clock is trio's fake one: the times are the peer manager's, not the
    machine's), while a peer that is only "not serving now" is still asked every 2 s and
    answers in the end. Before, the newer model's peer was asked every 2 s, for ever."""
    serves_at = 120.0

    async def main() -> None:
        manager = PeerManager(ConnectionMonitor())
        manager.set_peers([NEWER, HONEST])
        asked: dict[bytes, list[float]] = {NEWER: [], HONEST: []}

        async def request(peer: bytes, request: ModelRequestType) -> BlobTicket:
            asked[peer].append(trio.current_time())
            if peer == NEWER:
                raise OtherModelVersion(WANTED + 10, WANTED)
            if trio.current_time() < serves_at:
                raise SharableModelFailure(SharableModelError.ParametersNotInitialized())
            return _ticket(peer)

        ticket, _, peer = await blob_ticket_param_request_task(CONFIG, request, manager)
        assert (ticket, peer) == (_ticket(HONEST), HONEST)
        gaps = [b - a for a, b in zip(asked[NEWER], asked[NEWER][1:], strict=False)]
        expected = [
            min(NOT_SERVING_RETRY_SECS * 2**i, MAX_OTHER_VERSION_RETRY_SECS) for i in range(6)
        ]
        assert len(gaps) >= len(expected)
        for gap, rest in zip(gaps, expected, strict=False):
            # asked once its rest is over, at the next look for a free peer
            assert rest <= gap <= rest + NO_PEER_SLEEP_SECS
        assert max(gaps) <= MAX_OTHER_VERSION_RETRY_SECS + NO_PEER_SLEEP_SECS
        honest_gaps = [b - a for a, b in zip(asked[HONEST], asked[HONEST][1:], strict=False)]
        assert max(honest_gaps) <= NOT_SERVING_RETRY_SECS + NO_PEER_SLEEP_SECS
        assert manager.errors_per_peer == {NEWER: 0, HONEST: 0}  # neither failed

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_peer_of_an_older_version_is_asked_nothing_more_until_the_peers_are_set_again() -> None:
    """A peer that answered with an older model is asked once, not again while an honest peer
    still says "not serving now"; alone (or beside failed peers), it exhausts the peer manager
    at once instead of being asked every 2 s; `set_peers` (a new download, or a restart when a
    serving window ended) asks it again."""

    async def main() -> None:
        exhausted: list[int] = []
        manager = PeerManager(ConnectionMonitor(), on_exhausted=lambda: exhausted.append(1))
        manager.set_peers([OLDER, HONEST])
        asked: list[bytes] = []

        async def request(peer: bytes, request: ModelRequestType) -> BlobTicket:
            asked.append(peer)
            if peer == OLDER:
                raise OtherModelVersion(WANTED - 10, WANTED)
            if trio.current_time() < 60:
                raise SharableModelFailure(SharableModelError.ParametersNotInitialized())
            return _ticket(peer)

        _, _, peer = await blob_ticket_param_request_task(CONFIG, request, manager)
        assert peer == HONEST
        assert asked.count(OLDER) == 1
        assert asked.count(HONEST) > 20  # every 2 s for 60 s
        assert not exhausted

        manager.set_peers([OLDER])
        asked.clear()
        start = trio.current_time()
        with pytest.raises(PeersUnreachable):
            await blob_ticket_param_request_task(CONFIG, request, manager)
        assert asked == [OLDER]
        assert exhausted == [1]
        assert trio.current_time() == start  # no wait: nothing would change in this window

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


OLD_CONFIG_JSON = '{"architectures": ["LlamaForCausalLM"], "hidden_size": 32}'


@pytest.mark.parametrize("first", ["stale", "current"])
def test_the_configuration_is_of_the_wanted_version(
    monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    """One peer still serves the last warmup's model (version 10, another configuration), the
    other the one the joiner joins with (version 20). Whichever is asked first for the
    configuration, the joiner plans the download from version 20's and ends with version 20's
    parameters; the stale peer, once it answered (with the configuration or a ticket batch),
    is asked nothing more. Before, the configuration came unversioned from whichever peer was
    asked first: with the stale peer first, version 10's configuration."""
    before, after = make_parameters(7), make_parameters(8)

    async def main() -> None:
        async with (
            open_nodes(3, model_codec=TENSOR_CODEC) as (stale, current, joiner),
            trio.open_nursery() as nursery,
        ):
            for provider, parameters, version, config in (
                (stale, before, 10, OLD_CONFIG_JSON),
                (current, after, 20, CONFIG_JSON),
            ):
                model = provider_model(parameters)
                model.update_parameters(parameters, version)
                model.update_config(config, TOKENIZER_JSON)
                nursery.start_soon(serve_model, provider, model)
            await introduce_all(joiner, [stale, current])
            asked = _record_answers(monkeypatch, joiner)
            leader, other = (stale, current) if first == "stale" else (current, stale)
            download = ModelDownload(
                joiner, [leader.endpoint_id, other.endpoint_id], expected_version=WANTED
            )
            with trio.fail_after(120):
                got = await download.run()
            assert asked[0] == ("config", leader.endpoint_id, 10 if first == "stale" else 20)
            assert got.config.config == CONFIG_JSON
            assert model_hash(got.parameters) == model_hash(after)
            assert [a for a in asked if a[1] == stale.endpoint_id] == [
                ("config" if first == "stale" else "batch", stale.endpoint_id, 10)
            ]
            assert download.restarts == 0
            nursery.cancel_scope.cancel()

    trio.run(main)


def _record_answers(
    monkeypatch: pytest.MonkeyPatch, joiner: NetworkConnection
) -> list[tuple[str, bytes, int | None]]:
    """Each of the joiner's ticket answers, as they come: (kind, peer, version)."""
    ask_one, ask_many = joiner.request_model_blob_ticket, joiner.request_model_blob_tickets
    answers: list[tuple[str, bytes, int | None]] = []

    async def one(peer: bytes, request: ModelRequestType) -> tuple[BlobTicket, int | None]:
        ticket, version = await ask_one(peer, request)
        answers.append(("config", peer, version))
        return ticket, version

    async def many(peer: bytes, names: list[str]) -> list[TicketResult]:
        results = await ask_many(peer, names)
        answers.append(("batch", peer, results_version(results)))
        return results

    monkeypatch.setattr(joiner, "request_model_blob_ticket", one)
    monkeypatch.setattr(joiner, "request_model_blob_tickets", many)
    return answers
