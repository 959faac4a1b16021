"""Which Solana cluster to talk to: an RPC endpoint and its websocket twin (`Cluster`), and the
well-known ones. Light (no solders, no trio), so command-line declarations can name the
defaults without loading the backend (`psyche.solana.backend` re-exports these names)."""

from __future__ import annotations

from dataclasses import dataclass

LOCALNET_RPC = "http://127.0.0.1:8899"
LOCALNET_WS_RPC = "ws://127.0.0.1:8900"
DEVNET_RPC = "https://api.devnet.solana.com"
DEVNET_WS_RPC = "wss://api.devnet.solana.com"


@dataclass(frozen=True)
class Cluster:
    """An RPC endpoint and its websocket twin."""

    rpc: str = LOCALNET_RPC
    ws_rpc: str = LOCALNET_WS_RPC

    def __post_init__(self) -> None:
        # Upstream trims surrounding quotes (values often come from .env files).
        object.__setattr__(self, "rpc", self.rpc.strip().strip('"'))
        object.__setattr__(self, "ws_rpc", self.ws_rpc.strip().strip('"'))


__all__ = ["DEVNET_RPC", "DEVNET_WS_RPC", "LOCALNET_RPC", "LOCALNET_WS_RPC", "Cluster"]
