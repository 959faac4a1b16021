"""The `psyche-solana-client` commands as library functions (upstream run-manager `commands/`):
each is an options dataclass, whose fields declare its flags and environment variables
(`args.arg`), and a `run_*` function that does what the command does, prints what it did and
returns the exit status; a failure the user meets is a one-line `psyche.core.cli.UserError`.
The command only parses (`psyche.cli.solana_client`); Python code calls the same functions:

    from psyche.solana.commands.args import ClusterOptions
    from psyche.solana.commands.view import ShowOptions, run_show

    run_show(ShowOptions(cluster=ClusterOptions(rpc=url, ws_rpc=ws_url), run_id="my-run"))

Modules, by job: `run` (create, close, update-config, pause, reward rates, tick, checkpoint),
`authorization` (join authorizations, can-join), `view` (show, json-dump-user, list-runs),
`treasury` (top up, claim), `results` (the run-down service), `wallet` (keys, airdrop),
`predownload` (its Solana half); `args` (declarations, the cluster's and wallet's options),
`shell` (the backend, trio and one-line errors around every command), `render` (what they
print). The options modules import nothing heavy, so `--help` stays fast. The local endpoint's
command is `psyche.solana.localnet.__main__`.
"""
