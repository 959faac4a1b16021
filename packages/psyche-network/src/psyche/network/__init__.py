"""Peer-to-peer networking for Psyche: signed gossip, content-addressed blobs and model sharing."""
