"""The Psyche coordinator: run configuration, state machine, committee and data selection."""
