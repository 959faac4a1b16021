"""The `psyche-train` command: train a model on local data with AdamW or DisTrO."""
