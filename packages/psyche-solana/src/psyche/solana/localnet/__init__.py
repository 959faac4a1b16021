"""A local Solana endpoint for tests and for users without a validator.

`Ledger` keeps accounts in solders' LiteSVM, which runs the system and SPL programs for real, and
runs the Psyche programs' instructions with their Python ports (this package's
`coordinator_program`, `authorizer_program`, `treasurer_program`) against accounts in the exact
on-chain byte layouts. `LocalnetServer` serves it over loopback JSON-RPC (HTTP) and websocket
subscriptions, the subset of the Solana RPC API that clients of Psyche use, so solana-py,
anchorpy and `psyche.solana`'s own client talk to it unmodified.

The Psyche program logic here is the Python port, not the deployed SBF binary: it shows that the
bytes clients send are the ones the programs expect and that the client follows the
coordinator, not how the deployed binary behaves at the edges.

Run it standalone with `python -m psyche.solana.localnet --port 8899` (websocket on 8900).
"""
