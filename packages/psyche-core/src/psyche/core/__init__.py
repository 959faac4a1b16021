"""Deterministic primitives shared by every Psyche component: identities, intervals, shuffles, bloom filters, merkle trees, LR schedules and the postcard codec."""
