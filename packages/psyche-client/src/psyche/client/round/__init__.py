"""One round of training, read forward (upstream `state/`): `fetch` (the round's batches),
`train` (apply round N - 2, train, publish), `payloads` (peers' results: download, check,
screen), `witness` and `warmup` (what this client attests), `apply`, all on a round's `state`;
`broadcast` is what clients gossip, and `steps` follows the coordinator's run state from one
step to the next (`StepStateMachine`, its transitions a table in `transitions`)."""
