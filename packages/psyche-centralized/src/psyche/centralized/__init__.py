"""Centralized Psyche backend: TCP coordinator server and its client."""
