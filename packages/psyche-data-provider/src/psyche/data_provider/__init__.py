"""Training data providers for Psyche: local token files, HTTP/GCS, weighted mixes, preprocessed parquet and the TCP data server."""
