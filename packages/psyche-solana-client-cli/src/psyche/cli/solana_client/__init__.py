"""The `psyche-solana-client` command: manage and train runs on Solana."""
