"""Issue 24's items 1, 2 and 4 against a live run, in CI (100 to 120 s): three real clients
and a hostile member train the tiny model while, within a window of 25 seconds (stretched to the
machine's measured speed, tests/timing.py, as is the strangers' 8 s margin before its end: an
attacker still running when the window closes is stopped without its figures, and the client
restart after the flood never happens),

* strangers log in to the coordinator with fresh keys and send 8 MiB `HealthCheck` frames back
  to back for the window but its last 8 s, 20,000 logins at most (item 2: one such stranger
  froze the coordinator's only thread for a second per frame, ten took its RSS from 157 to
  892 MB),
* 2,000 TCP connections that never send a byte reach one client's libp2p port (item 1: every
  evicted pending upgrade leaked a connection slot, and the host refused everyone for good),
  after which another client is killed and its replacement joins, dialing the flooded one,
* the hostile member offers, in each round it trains, a 64 MiB junk result (512 MiB in
  `just chaos`'s `attacks` scenario) and a 4 KiB blob that does not decode (item 4: every
  honest client downloaded and re-downloaded the junk for as long as it ran).

What must hold is work done, never a timing: no process falls over, every honest client
(the flooded one and the replacement included) trains after the attacks, every honest client
ends with the same model and applied the same batches, and each attack was refused: the
strangers' frames at their header, the flood's connections by the host's pending-upgrade cap
(and the replacement then connects to the flooded client directly), the junk result before a
byte of it was asked for, and the undecodable blob after one download. On bbde8f8 the three
tests of the attacks fail (docs/reliability.md, "Issue 24").
`scripts/chaos/run.py --scenarios attacks` runs the long version and measures its throughput.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from ..timing import scaled

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

HONEST = ("client-1", "client-2", "client-3")
CONFIG = {
    "init_min_clients": 4,
    "witness_nodes": 0,
    "epoch_time": 18,
    "warmup_time": 17,
    "max_round_train_time": 4,
    "round_witness_time": 2,
}
"""As test_chaos_short.py's run, for the same reasons (its docstring), but with the longest
warmup the epoch allows: the replacement loses 10 s asking the hostile member for a part of the
model, and the attacks slow its loading (`attack_scenario`)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from scenarios import attack_scenario, run_captured

    scenario = attack_scenario(
        "attacks-short", scaled(25), [3], config=CONFIG, junk_mib=64, barrage_margin=scaled(8)
    )
    return run_captured(scenario, tmp_path_factory.mktemp("attacks"))


def _fault(run: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [f for f in run["result"].faults if f["kind"] == kind]
    assert len(found) == 1, run["result"].faults
    return found[0]


def test_no_process_falls_over(run: dict[str, Any]) -> None:
    result = run["result"]
    assert not result.unexpected_exits, result.unexpected_exits
    # nor after the window, while the run settled (a joiner that cannot fetch the model exits)
    assert all(run["running"][name] for name in (*HONEST, "server", "adversary")), run["running"]
    for kind in ("health-check-flood", "silent-flood", "sigkill"):
        _fault(run, kind)
    assert not result.partial_files, result.partial_files


def _rejoin(run: dict[str, Any]) -> dict[str, Any]:
    """How the client restarted after the flood came back."""
    name = _fault(run, "sigkill")["target"]
    return next(j for j in run["result"].rejoins if j["client"] == name)


def test_every_honest_client_trains_through_and_after_the_attacks(run: dict[str, Any]) -> None:
    from metrics import of

    barrage = _fault(run, "health-check-flood")
    during = [
        e
        for e in of(run["nodes"]["client-1"][0], "trained_batch")
        if barrage["t"] <= e["ts"] <= barrage["until"]
    ]
    assert during, "client-1 trained nothing while the strangers sent their frames"
    flood = _fault(run, "silent-flood")
    rejoined = _fault(run, "sigkill")
    for name in HONEST:
        events = run["nodes"][name][0]
        trained = [e for e in of(events, "trained_batch") if e["ts"] > rejoined["until"]]
        assert trained, f"{name} trained nothing after the flood of {flood['target']}"
    assert _rejoin(run)["first_trained"] is not None


def test_honest_models_stay_identical(run: dict[str, Any]) -> None:
    result = run["result"]
    assert result.epochs_checked >= 1, result.model_problems  # nothing compared proves nothing
    assert result.models_identical, result.model_problems
    assert not result.applied_problems, result.applied_problems
    assert _rejoin(run)["hash_identical"] is True, result.rejoins


def test_the_flooded_client_refused_the_flood_and_took_the_replacement_in(
    run: dict[str, Any],
) -> None:
    """Item 1: the flood opened all its connections and the flooded host evicted the pending
    ones beyond its cap; afterwards the replacement connected to it directly, and its results
    reached it. On bbde8f8 each eviction leaked a slot of py-libp2p's resource manager and the
    flooded host denied every connection after the flood ("Connection denied by resource
    manager"): the replacement could not reach it ("cannot reach …") and only trained with it
    through the other honest client's gossip, so only the direct connection tells them apart."""
    from cluster import client_short_id
    from metrics import of

    from psyche.core.identity import SecretKey

    nodes = run["nodes"]
    flood = _fault(run, "silent-flood")
    flooded = flood["target"]
    (flood_node,) = [n for n in nodes if n.startswith("silent-flood-")]
    (done,) = of(nodes[flood_node][0], "silent_flood")
    assert done["connections"] == 2000, done
    assert "pending connections full" in nodes[flooded][1]
    assert "denied by resource manager" not in nodes[flooded][1]
    rejoined = _fault(run, "sigkill")
    number = int(flooded.rsplit("-", 1)[1])
    flooded_key = SecretKey.from_bytes(number.to_bytes(32, "big")).public_key.hex()
    replacement = [e for e in nodes[rejoined["target"]][0] if e["ts"] >= rejoined["until"]]
    direct = f"peer {flooded_key[:10]}: connected directly"
    assert any(e.get("message") == direct for e in replacement), (
        f"{rejoined['target']}'s replacement never connected directly to the flooded {flooded}"
    )
    owner = client_short_id(int(rejoined["target"].rsplit("-", 1)[1]))
    events = nodes[flooded][0]
    applied = {e["step"]: set(e["batches"]) for e in of(events, "applied_results")}
    theirs = [
        batch
        for e in of(events, "round_start")
        if e["ts"] > rejoined["until"] and e["step"] + 2 in applied
        for batch, _, who in (a.rpartition("=") for a in e["assignments"])
        if who == owner and batch in applied[e["step"] + 2]
    ]
    assert theirs, f"{flooded} applied nothing {rejoined['target']} trained after the flood"


def test_the_strangers_frames_were_refused_at_their_header(run: dict[str, Any]) -> None:
    """Item 2: every stranger's connection was closed by the server; the frames it refused
    (logged once per 10 s, the rest counted in a summary line) were refused at the header,
    before anything was decoded; members kept training meanwhile (above)."""
    from metrics import of

    nodes = run["nodes"]
    (strangers,) = [n for n in nodes if n.startswith("strangers-")]
    (barrage,) = of(nodes[strangers][0], "barrage")
    assert barrage["logins"] >= 1, barrage
    assert barrage["closed_by_peer"] >= 1, barrage
    server = nodes["server"][1]
    shown = len(re.findall(r"frame of \d+ bytes exceeds the limit", server))
    counted = sum(int(n) for n in re.findall(r"(\d+) FrameTooLarge", server))
    assert shown >= 1, (shown, counted)
    assert shown + counted >= barrage["closed_by_peer"] - 1, (shown, counted)
    assert "Traceback" not in server


def test_the_junk_results_were_refused_and_never_fetched_again(run: dict[str, Any]) -> None:
    """Item 4: the hostile member offered its junk; nobody asked for a byte of the result over
    the run's bound, each undecodable blob was asked for at most once per honest client, and
    none of its batches was applied."""
    from cluster import client_short_id
    from metrics import of
    from scenarios import ADVERSARY_KEY

    nodes = run["nodes"]
    adversary = nodes["adversary"][0]
    offered = {e["mode"] for e in of(adversary, "attack")}
    assert {"junk-result", "garbage-blob"} <= offered, offered
    requests: dict[tuple[str, str], int] = {}
    for e in of(adversary, "blob_requested"):
        requests[(e["mode"], e["blob"])] = requests.get((e["mode"], e["blob"]), 0) + 1
    assert not [key for key in requests if key[0] == "junk-result"], requests
    assert all(n <= len(HONEST) for n in requests.values()), requests
    honest = "\n".join(nodes[name][1] for name in HONEST)
    assert re.search(r"blob of \d+ bytes exceeds the limit of \d+ bytes", honest)
    offender = client_short_id(ADVERSARY_KEY)
    events = nodes["client-1"][0]
    applied = {e["step"]: set(e["batches"]) for e in of(events, "applied_results")}
    for e in of(events, "round_start"):
        for assignment in e["assignments"]:
            batch, _, owner = assignment.rpartition("=")
            if owner == offender and e["step"] + 2 in applied:
                assert batch not in applied[e["step"] + 2], (e["step"], batch)
