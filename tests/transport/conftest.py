"""What the transport tests share: trio as the anyio backend, and the message types (upstream's
tcp.rs test enums: a `Ping` to the server, a `Pong` to the client) with their postcard codecs."""

from __future__ import annotations

import pytest

from psyche.core.serde import DataEnum, variant
from psyche.transport import PostcardCodec


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


class ToServer(DataEnum):
    Ping = variant(str)


class ToClient(DataEnum):
    Pong = variant(str)


CODECS = {"to_server": PostcardCodec(ToServer), "to_client": PostcardCodec(ToClient)}
