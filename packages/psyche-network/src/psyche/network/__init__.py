"""Peer-to-peer networking for Psyche: signed gossip, content-addressed blobs and model sharing.

`NetworkConnection` (in `psyche.network.connection`) is the facade; import names from their
modules. This package imports only `psyche.core` and `psyche.transport`: what gossip and blobs
carry (the client's `Broadcast` and DisTrO results) reaches it as parameters of
`NetworkConnection.open`.
"""
