"""What a person (or a tracker) sees of a client: log lines and events (`logs`), each round's
report and its observers (`telemetry`), the progress of long waits (`progress`), run statistics
and the witness metadata (`stats`), the terminal dashboard (`tui`), per-epoch event files
(`event_files`) and evaluations between rounds (`evals`, `eval_worker`)."""
