"""A client's checkpoints: the end of an epoch (`cooldown`), the files on disk and their manifest
(`store`), which to keep (`keep_policy`), uploads to the hub or GCS (`upload`, `gcs`)."""
