"""The `psyche-local-testnet` command: a server and clients in tmux panes."""
