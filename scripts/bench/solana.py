"""Solana hot paths against baselines measured in the same run.

    .venv/bin/python scripts/bench/solana.py            # ~20 s
    .venv/bin/python scripts/bench/solana.py --quick    # smaller, for a smoke test

Cases (best of several passes each; ratio = case / baseline, lower is better for times):

* decode: `coordinator_account_from_bytes` of a full account (256 clients, 4 rounds of 32
  witnesses) vs postcard decoding of the same `Coordinator` (the centralized protocol's codec);
  the account also holds the 256 Solana clients, so it decodes more than the baseline.
* encode: `coordinator_account_to_bytes` vs postcard encoding of the same `Coordinator`.
* nonce: reading the nonce of a notification (what de-duplication does first) vs a full decode.
* ledger: transactions per second through the local endpoint's ledger: a coordinator tick (the
  Python program decodes, ticks and re-encodes the account) vs a system transfer run by LiteSVM
  through the same path.
* rpc: a tick sent and confirmed over loopback JSON-RPC vs one `getSlot` round trip.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import trio
from solders import system_program
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.transaction import Transaction

from psyche.core.serde import from_bytes, to_bytes
from psyche.solana import admin
from psyche.solana.backend import Cluster, SolanaBackend
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.localnet.ledger import Ledger, ManualClock
from psyche.solana.localnet.server import start_localnet
from psyche.solana.retry import RetryPolicy
from psyche.solana.state import (
    coordinator_account_from_bytes,
    coordinator_account_nonce,
    coordinator_account_to_bytes,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "solana"))


def best_time(fn: Callable[[], object], repeat: int, passes: int = 5) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def report(name: str, case: float, baseline: float, unit: str = "s") -> None:
    print(
        f"{name:8s} case {case * 1e3:9.3f} ms  baseline {baseline * 1e3:9.3f} ms  "
        f"ratio {case / baseline:6.2f}"
    )


def full_account():  # type: ignore[no-untyped-def]
    from test_codecs import _populated_account  # the tests' full account builder

    return _populated_account(random.Random(1))


def bench_codecs(repeat: int) -> None:
    from psyche.coordinator.coordinator import Coordinator

    account = full_account()
    data = coordinator_account_to_bytes(account)
    postcard = to_bytes(account.state.coordinator, Coordinator)
    report(
        "decode",
        best_time(lambda: coordinator_account_from_bytes(data), repeat),
        best_time(lambda: from_bytes(postcard, Coordinator), repeat),
    )
    report(
        "encode",
        best_time(lambda: coordinator_account_to_bytes(account), repeat),
        best_time(lambda: to_bytes(account.state.coordinator, Coordinator), repeat),
    )
    report(
        "nonce",
        best_time(lambda: coordinator_account_nonce(data), repeat * 20),
        best_time(lambda: coordinator_account_from_bytes(data), repeat),
    )


def _send(ledger: Ledger, instructions: list, signers: list[Keypair]) -> None:  # type: ignore[type-arg]
    blockhash, _ = ledger.latest_blockhash()
    tx = Transaction(signers, Message(instructions, signers[0].pubkey()), blockhash)
    ledger.process_transaction(bytes(tx))


def bench_ledger(count: int) -> None:
    async def setup(ledger: Ledger) -> tuple[Keypair, Pubkey]:
        async with trio.open_nursery() as nursery:
            net = await start_localnet(nursery, ledger)
            owner = Keypair()
            ledger.airdrop(owner.pubkey(), 10**12)
            backend = SolanaBackend(Cluster(net.rpc_url, net.ws_url), owner)
            from scripted import config, create_run

            account = await create_run(backend, config(init_min_clients=1, min_clients=1))
            await backend.aclose()
            nursery.cancel_scope.cancel()
        return owner, account

    ledger = Ledger(clock=ManualClock(1_700_000_000))
    owner, account = trio.run(setup, ledger)
    instance = admin.pda.find_coordinator_instance("e2e")
    tick = coordinator_ix.coordinator_tick(instance, account, owner.pubkey())
    destination = Pubkey.new_unique()
    transfer = system_program.transfer(
        system_program.TransferParams(from_pubkey=owner.pubkey(), to_pubkey=destination, lamports=1)
    )
    start = time.perf_counter()
    for _ in range(count):
        _send(ledger, [tick], [owner])
    ticks = (time.perf_counter() - start) / count
    start = time.perf_counter()
    for _ in range(count):
        _send(ledger, [transfer], [owner])
    transfers = (time.perf_counter() - start) / count
    report("ledger", ticks, transfers)
    print(f"         {1 / ticks:8.0f} ticks/s, {1 / transfers:8.0f} transfers/s")


def bench_rpc(count: int) -> None:
    async def main() -> tuple[float, float]:
        ledger = Ledger(clock=ManualClock(1_700_000_000))
        async with trio.open_nursery() as nursery:
            net = await start_localnet(nursery, ledger)
            owner = Keypair()
            ledger.airdrop(owner.pubkey(), 10**12)
            backend = SolanaBackend(
                Cluster(net.rpc_url, net.ws_url), owner, retry_policy=RetryPolicy(0.01, 1, 1, 0.01)
            )
            from scripted import config, create_run

            await create_run(backend, config(init_min_clients=1, min_clients=1))
            run = await admin.load_run(backend, "e2e")
            start = time.perf_counter()
            for _ in range(count):
                await admin.tick(backend, run)
            ticks = (time.perf_counter() - start) / count
            client = backend.clients[0]
            start = time.perf_counter()
            for _ in range(count):
                await client.get_slot()
            slots = (time.perf_counter() - start) / count
            await backend.aclose()
            nursery.cancel_scope.cancel()
        return ticks, slots

    ticks, slots = trio.run(main)
    report("rpc", ticks, slots)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeat, count = (3, 20) if args.quick else (20, 200)
    bench_codecs(repeat)
    bench_ledger(count)
    bench_rpc(count)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
