"""A stand-in for `psyche-client train` in the local testnet's tests: it joins the run with the key
from RAW_IDENTITY_SECRET_KEY and prints every state it receives (it does not train). Like the
real client it exits 0 once the run is Finished; `--exit-with N` makes it exit N at once."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import trio

from psyche.centralized.client import BackendDisconnected, CentralizedBackend
from psyche.coordinator import RunState
from psyche.core.identity import SecretKey


def journal(event: str, key: str) -> None:
    """One line `event key pane` appended to `standin-journal.log` in the working directory
    (`pane`: tmux's `$TMUX_PANE`, `-` outside tmux): what a test reads instead of a terminal's
    screen, which a narrow pane may redraw over."""
    with open("standin-journal.log", "a") as f:
        f.write(f"{event} {key} {os.environ.get('TMUX_PANE', '-')}\n")


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["train"])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--server-addr", required=True)
    parser.add_argument("--logs", default="console")
    parser.add_argument("--exit-with", type=int)
    args, rest = parser.parse_known_args()
    key = SecretKey.from_hex(os.environ["RAW_IDENTITY_SECRET_KEY"])
    print(f"standin key={key.public_key.hex()} logs={args.logs} extra={rest}", flush=True)
    journal("start", key.public_key.hex())
    if args.exit_with is not None:
        return int(args.exit_with)
    code = 0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop() -> None:
                async for signum in signals:
                    print(f"standin got {signal.Signals(signum).name}", flush=True)
                    journal(signal.Signals(signum).name, key.public_key.hex())
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop)
            async with CentralizedBackend.connect(args.server_addr, key, args.run_id) as backend:
                last = None
                while True:
                    try:
                        state = await backend.wait_for_new_state()
                    except BackendDisconnected as e:
                        print(f"standin lost the server: {e}", flush=True)
                        code = 1
                        break
                    summary = (state.run_state.name, state.progress.step, state.progress.epoch)
                    if summary != last:
                        last = summary
                        print(
                            f"standin state={summary[0]} step={summary[1]} epoch={summary[2]} "
                            f"clients={len(state.epoch_state.clients)}",
                            flush=True,
                        )
                    if state.run_state is RunState.Finished:
                        print("standin: the run is finished", flush=True)
                        break
            nursery.cancel_scope.cancel()
    return code


if __name__ == "__main__":
    sys.exit(trio.run(main))
