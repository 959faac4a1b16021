"""`psyche-solana-client train` end to end: real processes on loopback, no coordinator server.

A local Solana endpoint (`psyche-solana-client localnet`) holds the run; the test sets it up
with the admin commands (join-authorization-create, create-run, update-config with the tiny CPU
model and its dataset served over HTTP by `psyche.data_provider.static_http`, set-paused
--resume); two `psyche-solana-client train` processes then join, tick, witness and train it
through two epochs. Discovery is serverless: client A starts with no peers at all, client B
with `--bootstrap-peer A`; A learns B's address when B connects (peer exchange).

The clients reach the endpoint through a TCP proxy. In epoch 1, with both clients training,
the proxy goes away for several seconds (the JSON-RPC and websocket connections are cut and new
ones refused) and comes back: the clients keep going and end the epoch with identical models.

One run serves all tests (module fixture); the clients log JSON events (`round_start`,
`client_loss`, `applied_results`, `cooldown_model`, ...).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from psyche.cli.solana_client.main import main as solana_client

from ..timing import MAX_SCALE
from .processes import (
    EVERYONE,
    Processes,
    Proxy,
    create_run,
    free_port,
    json_events,
    p2p_id,
    start_endpoint,
    wait_event,
)
from .support import solana_client_output

# a bound for a hung run, not a timing: the run's own waits stretch up to MAX_SCALE times on a
# busy machine (tests/timing.py), and the module's run is the first test's setup
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240 * MAX_SCALE)]

RUN_ID = "solana-e2e"
CONFIG = {
    "warmup_time": 8,
    "cooldown_time": 3,
    "epoch_time": 16,
    "max_round_train_time": 10,
    "round_witness_time": 1,
    "min_clients": 1,
    "init_min_clients": 2,
    "waiting_for_members_extra_time": 1,
}
OUTAGE_SECS = 6.0


@dataclass
class Run:
    clients: dict[str, list[dict[str, Any]]]
    logs: dict[str, str]
    outage_step: int
    outage: tuple[float, float]
    show: dict[str, Any]
    signers: dict[str, str]
    exit_codes: dict[str, int]

    def of(self, name: str, event: str) -> list[dict[str, Any]]:
        return [e for e in self.clients[name] if e.get("message") == event]


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    group = Processes(tmp_path_factory.mktemp("solana-train"))
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture(scope="module")
def run(processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("solana-run")
    endpoint = start_endpoint(processes, tmp, ("owner", "a", "b"))
    wallets, paths = endpoint.wallets, endpoint.paths
    rpc_port, ws_port, rpc, ws = endpoint.rpc_port, endpoint.ws_port, endpoint.rpc, endpoint.ws

    # ---- the run, set up with the admin commands (in this process, over real RPC)
    cluster = create_run(endpoint, tmp, RUN_ID, CONFIG)
    assert solana_client(["set-paused", "--run-id", RUN_ID, "--resume", *cluster]) == 0

    # ---- two clients, through proxies that can take the endpoint away
    with Proxy(rpc_port) as rpc_proxy, Proxy(ws_port) as ws_proxy:
        a_port = free_port()

        def client(name: str, *extra: str) -> Any:
            return processes.start(
                f"client-{name}",
                [sys.executable, "-m", "psyche.cli.solana_client.main", "train",
                 "--rpc", f"http://127.0.0.1:{rpc_proxy.port}",
                 "--ws-rpc", f"ws://127.0.0.1:{ws_proxy.port}",
                 "-w", str(paths[name]), "--run-id", RUN_ID, "--authorizer", EVERYONE,
                 "--logs", "json", "--device", "cpu", "--bind-p2p-interface", "lo", *extra],
                env={"OMP_NUM_THREADS": "1", "CLIENT_VERSION": "v-e2e"},
            )  # fmt: skip

        clients = {
            "a": client("a", "--bind-p2p-port", str(a_port)),
            "b": client(
                "b", "--bootstrap-peer", f"{p2p_id(RUN_ID, wallets['a'])}@127.0.0.1:{a_port}"
            ),
        }
        # epoch 0 ends with a cooldown on both
        for proc in clients.values():
            wait_event(proc, "cooldown_model", lambda e: e["epoch"] == 0, 150)
        # epoch 1: as soon as its second round starts, the endpoint goes away for a while (the
        # round's witness is sent during the outage)
        start = wait_event(
            clients["a"], "round_start", lambda e: e["epoch"] == 1 and e["round"] >= 1, 90
        )
        outage_step = start["step"]
        outage_start = time.time()
        rpc_proxy.down()
        ws_proxy.down()
        time.sleep(OUTAGE_SECS)
        rpc_proxy.up()
        ws_proxy.up()
        outage = (outage_start, time.time())
        for proc in clients.values():
            wait_event(proc, "cooldown_model", lambda e: e["epoch"] == 1, 90)
        show = json.loads(
            solana_client_output(
                ["show", "--run-id", RUN_ID, "--json", "--rpc", rpc, "--ws-rpc", ws]
            )
        )
        alive = {name: proc.popen.poll() is None for name, proc in clients.items()}
        exit_codes = {name: processes.stop(proc) for name, proc in clients.items()}
    assert all(alive.values()), alive
    return Run(
        {name: json_events(proc.text()) for name, proc in clients.items()},
        {name: proc.text() for name, proc in clients.items()},
        outage_step,
        outage,
        show,
        {name: str(wallets[name].pubkey()) for name in clients},
        exit_codes,
    )


# --------------------------------------------------------------------------------------------


def test_loss_decreases_over_the_first_epoch(run: Run) -> None:
    per_step: dict[int, list[float]] = {}
    for name in ("a", "b"):
        for e in run.of(name, "client_loss"):
            if e["epoch"] == 0 and e["trained"]:
                per_step.setdefault(e["step"], []).append(e["loss"])
    steps = sorted(per_step)
    assert len(steps) >= 4, per_step
    assert all(len(per_step[s]) == 2 for s in steps), per_step
    first = sum(per_step[steps[0]]) / 2
    last = sum(per_step[steps[-1]] + per_step[steps[-2]]) / 4
    assert last < first - 0.1, per_step


def test_models_are_identical_at_every_cooldown(run: Run) -> None:
    for epoch in (0, 1):
        hashes = {
            name: [e["model_hash"] for e in run.of(name, "cooldown_model") if e["epoch"] == epoch]
            for name in ("a", "b")
        }
        assert all(len(h) == 1 for h in hashes.values()), (epoch, hashes)
        assert hashes["a"] == hashes["b"], (epoch, hashes)
    # and both applied the same results in the same order
    applied = {
        name: {e["step"]: e["batches"] for e in run.of(name, "applied_results")}
        for name in ("a", "b")
    }
    common = applied["a"].keys() & applied["b"].keys()
    assert len(common) >= 4
    assert all(applied["a"][s] == applied["b"][s] for s in common)


def test_clients_found_each_other_without_a_server(run: Run) -> None:
    """A had no peer to start from; B knew only A. Each trained batches and applied the
    other's, so results flowed both ways."""
    rounds = [e for e in run.of("a", "round_start") if e["epoch"] == 0 and e["assignments"]]
    owners = {a.split("=")[-1].strip() for r in rounds for a in r["assignments"]}
    assert len(owners) == 2, owners
    for name in ("a", "b"):
        assert run.of(name, "trained_batch"), name
        assert not run.of(name, "payload_rejected")
        assert not run.of(name, "untrained_batch")
    assert "no --bootstrap-peer" in run.logs["a"]
    assert "no --bootstrap-peer" not in run.logs["b"]


def test_the_run_recorded_both_clients_on_chain(run: Run) -> None:
    account = run.show["coordinator_account"]
    assert set(account["clients"]) == set(run.signers.values()), account["clients"]
    status = account["status"]
    assert status["epoch"] >= 1, status
    assert status["step"] > run.outage_step, status
    # `next_active` went up at the resume and when each epoch's training began; both clients
    # joined epoch 1 (their `active` is that epoch's counter, or the next one's if they already
    # joined epoch 2)
    assert status["next_active"] >= 3, status
    actives = {c["active"] for c in account["clients"].values()}
    assert len(actives) == 1
    assert actives.pop() in (status["next_active"] - 1, status["next_active"])


def test_the_rpc_going_away_mid_epoch_is_survived(run: Run) -> None:
    for name in ("a", "b"):
        logs = run.logs[name]
        assert "solana subscription 1 down" in logs, name
        # the epoch went on after the outage: more rounds trained and applied
        assert [e for e in run.of(name, "trained_batch") if e["step"] > run.outage_step], name
        assert [e for e in run.of(name, "applied_results") if e["step"] > run.outage_step + 2]
        assert not [e for e in run.of(name, "state_change") if e["new"] == "Paused"]
    # a witness that went out during the outage (as a rule the round's: it is sent about a second
    # after the round starts) was sent again once the RPC was back
    start, end = run.outage
    for name in ("a", "b"):
        during = [e for e in run.of(name, "witness_sent") if start <= e["ts"] <= end]
        if during:
            assert "trying again while it can still count" in run.logs[name], name
    # both were still training when stopped, and stopped cleanly on Ctrl+C
    assert run.exit_codes == {"a": 130, "b": 130}, run.exit_codes
