"""Who may talk to us: only the current run's clients (set from every coordinator state).

The network checks the allowlist at every entry point: when a libp2p connection completes its
handshake, for each gossip message (forwarder and signer), and on both sides of a blob or
model-sharing transfer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Allowlist(Protocol):
    def allowed(self, peer: bytes) -> bool: ...

    def force_allow(self, peer: bytes) -> None: ...


class AllowAll:
    """Every peer allowed (tests and the inference node)."""

    def allowed(self, peer: bytes) -> bool:
        return True

    def force_allow(self, peer: bytes) -> None:
        pass


class AllowDynamic:
    """An allowed set replaced on each coordinator update, plus peers allowed regardless."""

    def __init__(self, nodes: Iterable[bytes] = ()) -> None:
        self._allowed: frozenset[bytes] = frozenset(bytes(n) for n in nodes)
        self._force_allowed: frozenset[bytes] = frozenset()

    def allowed(self, peer: bytes) -> bool:
        return peer in self._allowed or peer in self._force_allowed

    def force_allow(self, peer: bytes) -> None:
        self._force_allowed = self._force_allowed | {bytes(peer)}

    def add(self, peer: bytes) -> None:
        self._allowed = self._allowed | {bytes(peer)}

    def remove(self, peer: bytes) -> None:
        self._allowed = self._allowed - {bytes(peer)}

    def set(self, nodes: Iterable[bytes]) -> None:
        self._allowed = frozenset(bytes(n) for n in nodes)

    def clear(self) -> None:
        """Forget the allowed set; force-allowed peers stay (as upstream)."""
        self._allowed = frozenset()

    def snapshot(self) -> frozenset[bytes]:
        return self._allowed | self._force_allowed
