"""Solana backend for Psyche: program bindings, account codecs and the on-chain client backend."""
