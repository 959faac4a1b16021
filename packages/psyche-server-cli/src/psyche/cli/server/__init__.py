"""The `psyche-server` command: validate configs and run a centralized coordinator."""
