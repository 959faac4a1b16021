"""Authenticated TCP between run members, and what a listening socket lets peers hold.

The transport of Psyche's own request/response protocols (upstream `shared/network/src/tcp.rs`
and its limits): the centralized coordinator and its clients, the TCP data server, and the
admission and allowlist of `psyche.network`'s blob side channel and libp2p host.

* `TcpServer` / `TcpClient`: length-delimited frames, an ed25519 challenge handshake (the
  connection's identity is the signer's key), payloads through a `Codec` (`PostcardCodec` by
  default), a `Screen` that judges a frame before it is decoded.
* `ConnectionLimits` / `Admission` / `ByteBudget`: pending and authenticated connections capped
  per address and in total, frame and idle timeouts, the bytes of large frames in flight.
* `Allowlist` (`AllowDynamic`, `AllowAll`): who may talk to a node, set from the coordinator.

Guarantees: nothing a peer sends makes a server allocate more than the bytes that arrive or
decode anything before the sender has proved its key; every slot is released whatever raises;
what strangers cause is logged at most a few lines per kind (`psyche.core.drop_log`). This is
the package's public face: other packages import these names from `psyche.transport`, never
from its modules (an import-linter contract in the root pyproject.toml).
"""

from psyche.transport.allowlist import AllowAll, AllowDynamic, Allowlist
from psyche.transport.connection_limits import (
    MIB,
    Admission,
    ByteBudget,
    ConnectionLimits,
    Refused,
    peer_address,
)
from psyche.transport.tcp import (
    CHALLENGE_LENGTH,
    CLIENT_MAX_FRAME_LENGTH,
    HANDSHAKE_FRAME_LENGTH,
    SERVER_MAX_FRAME_LENGTH,
    ClientNotification,
    Codec,
    ConnectionClosed,
    Disconnected,
    FramedStream,
    FrameTimeout,
    FrameTooLarge,
    IdleTimeout,
    LoginRefused,
    Message,
    PostcardCodec,
    Screen,
    SendStalled,
    TcpClient,
    TcpProtocolError,
    TcpServer,
    encode_challenge,
    encode_challenge_response,
    encode_else,
    parse_address,
    resize_bytearray,
    split_envelope,
    verify_challenge_response,
)

__all__ = [
    "CHALLENGE_LENGTH",
    "CLIENT_MAX_FRAME_LENGTH",
    "HANDSHAKE_FRAME_LENGTH",
    "MIB",
    "SERVER_MAX_FRAME_LENGTH",
    "Admission",
    "AllowAll",
    "AllowDynamic",
    "Allowlist",
    "ByteBudget",
    "ClientNotification",
    "Codec",
    "ConnectionClosed",
    "ConnectionLimits",
    "Disconnected",
    "FrameTimeout",
    "FrameTooLarge",
    "FramedStream",
    "IdleTimeout",
    "LoginRefused",
    "Message",
    "PostcardCodec",
    "Refused",
    "Screen",
    "SendStalled",
    "TcpClient",
    "TcpProtocolError",
    "TcpServer",
    "encode_challenge",
    "encode_challenge_response",
    "encode_else",
    "parse_address",
    "peer_address",
    "resize_bytearray",
    "split_envelope",
    "verify_challenge_response",
]
