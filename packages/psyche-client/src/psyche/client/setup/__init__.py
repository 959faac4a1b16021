"""Setting a client up: its options (`options.TrainOptions`, every flag of `train`, composing
the settings each component takes), joining a run at warmup (`init`: the model from
`model_loading`, the data provider, the trainer), the client's ranks (`ranks`, `workers`) and
torch's CPU threads (`cpu_threads`)."""
