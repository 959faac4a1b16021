"""The `psyche-client` command: join a centralized run and train."""
