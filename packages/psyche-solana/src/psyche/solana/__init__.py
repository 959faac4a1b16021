"""Psyche on Solana: program bindings, account codecs, the client backend and a local endpoint.

Modules (import what you need; this package imports nothing heavy by itself):

* `program_ids`, `pda`, `anchor`: program ids (overridable), PDAs, Anchor discriminators/errors;
* `borsh`, `repr_c`, `state`: the two byte formats and the on-chain accounts
  (`coordinator_account_from_bytes` reads the zero-copy `CoordinatorAccount`);
* `instructions`, `idl`: every instruction of the coordinator, authorizer and treasurer programs
  (one module each, over `instructions.spec`), and their Anchor IDLs (legacy format, read by
  anchorpy);
* `keypair`: solana-keygen keypairs, `RAW_WALLET_PRIVATE_KEY`, the derived P2P identity;
* `rpc`, `retry`, `subscription`, `backend`, `follower`: the trio client, upstream's retry rules,
  account subscriptions, `SolanaBackend` (reads and transactions over the RPC endpoints) and
  `follow_run`'s `SolanaBackendRunner` (the client's `Backend`) with `follow_membership`;
* `admin`: the run-management commands behind `psyche-solana-client`;
* `localnet`: a loopback JSON-RPC + websocket endpoint running the programs' Python ports.

See docs/solana.md.
"""
