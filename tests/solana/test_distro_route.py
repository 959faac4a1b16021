"""The DisTrO apply route as a run setting in the Solana account: `OptimizerDefinition::
DistroSparse` (tag 4, a port extension) carries `Distro`'s settings in the same 28 bytes of the
optimizer union, so the account keeps upstream's size and every offset, a run on upstream's route
keeps upstream's bytes, and a run on the sparse route differs from it in the variant's tag alone.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
from solders.pubkey import Pubkey

from psyche.coordinator.model import Model
from psyche.core.definitions import Distro, OptimizerDefinition
from psyche.core.serde import from_bytes, to_bytes
from psyche.solana.borsh import from_borsh, to_borsh
from psyche.solana.commands.args import ClusterOptions
from psyche.solana.commands.authorization import (
    EVERYONE,
    JoinAuthorizationCreateOptions,
    run_join_authorization_create,
)
from psyche.solana.commands.predownload import fetch_coordinator
from psyche.solana.commands.run import (
    CreateRunOptions,
    UpdateConfigOptions,
    run_create_run,
    run_update_config,
)
from psyche.solana.commands.view import ShowOptions, run_show
from psyche.solana.localnet.server import LocalnetThread
from psyche.solana.state import (
    COORDINATOR_ACCOUNT_SPACE,
    REPR_C,
    coordinator_account_from_bytes,
    coordinator_account_to_bytes,
)

from .cli_helpers import RUN_CONFIG, funded_wallet

SETTINGS = Distro(
    clip_grad_norm=1.0,
    weight_decay=None,
    compression_decay=0.999,
    compression_topk=8,
    compression_chunk=64,
    quantize_1bit=True,
)
UPSTREAM = OptimizerDefinition.Distro(SETTINGS)
SPARSE = OptimizerDefinition.DistroSparse(SETTINGS)


def test_the_sparse_route_is_distro_with_another_tag_in_every_binary_form() -> None:
    """Upstream's tag 2 keeps its bytes; tag 4 is followed by the very same bytes."""
    assert REPR_C.layout(OptimizerDefinition).size == 32  # the union Distro sizes
    upstream = REPR_C.encode(UPSTREAM, OptimizerDefinition)
    sparse = REPR_C.encode(SPARSE, OptimizerDefinition)
    assert upstream[:4] == struct.pack("<I", 2)
    assert sparse[:4] == struct.pack("<I", 4)
    assert upstream[4:] == sparse[4:]
    assert REPR_C.decode(sparse, OptimizerDefinition) == SPARSE
    for encode, decode in ((to_borsh, from_borsh), (to_bytes, from_bytes)):
        up, sp = encode(UPSTREAM, OptimizerDefinition), encode(SPARSE, OptimizerDefinition)
        assert (up[0], sp[0]) == (2, 4)
        assert up[1:] == sp[1:]
        assert decode(sp, OptimizerDefinition) == SPARSE
        assert decode(up, OptimizerDefinition) == UPSTREAM


def test_the_settings_of_either_route() -> None:
    assert UPSTREAM.distro() == (SETTINGS, False)
    assert SPARSE.distro() == (SETTINGS, True)
    assert OptimizerDefinition.Dummy().distro() is None


SPARSE_CONFIG = RUN_CONFIG.replace(
    "[model.LLM.optimizer.Distro]", "[model.LLM.optimizer.DistroSparse]"
)


def test_a_run_on_the_sparse_route_round_trips_through_the_account(
    net: LocalnetThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """update-config with a sparse-route config: the program stores it, `json-dump-run` shows it,
    every client reads it back, and the account's bytes are a run on upstream's route's but for
    the optimizer's tag (byte for byte: size, every other field, padding)."""
    cluster = ClusterOptions(rpc=net.rpc_url, ws_rpc=net.ws_url)
    wallet = tmp_path / "owner.json"
    funded_wallet(net, wallet)
    config = tmp_path / "config.toml"
    # quantize_1bit = false is refused for the sparse route (tests/coordinator): 1-bit here
    config.write_text(SPARSE_CONFIG.replace("quantize_1bit = false", "quantize_1bit = true"))
    signed = {"cluster": cluster, "wallet_private_key_path": wallet}
    assert (
        run_join_authorization_create(JoinAuthorizationCreateOptions(**signed, authorizer=EVERYONE))
        == 0
    )
    assert run_create_run(CreateRunOptions(**signed, run_id="sparse", client_version="test")) == 0
    update = UpdateConfigOptions(**signed, run_id="sparse", config_path=config, vocab_size=32768)
    assert run_update_config(update) == 0
    capsys.readouterr()

    assert run_show(ShowOptions(cluster=cluster, run_id="sparse", json=True)) == 0
    dumped = json.loads(capsys.readouterr().out)["coordinator_account"]
    optimizer = dumped["setup"]["model"]["LLM"]["optimizer"]
    assert list(optimizer) == ["DistroSparse"]
    assert optimizer["DistroSparse"]["compression_topk"] == 2
    assert optimizer["DistroSparse"]["quantize_1bit"] is True

    coordinator = fetch_coordinator(cluster, "sparse")
    read = coordinator.model.value.optimizer
    assert isinstance(read, OptimizerDefinition.DistroSparse)
    settings, sparse = read.distro()
    assert sparse
    assert settings.compression_chunk == 64

    stored = net.ledger.get_account(Pubkey.from_string(dumped["address"]))
    assert stored is not None
    data = bytes(stored.data)
    assert len(data) == COORDINATOR_ACCOUNT_SPACE == 119160  # upstream's size
    account = coordinator_account_from_bytes(data)
    assert coordinator_account_to_bytes(account) == data
    # the same account on upstream's route
    coordinator = account.state.coordinator
    llm = replace(coordinator.model.value, optimizer=OptimizerDefinition.Distro(settings))
    state = replace(account.state, coordinator=replace(coordinator, model=Model.LLM(llm)))
    upstream = coordinator_account_to_bytes(replace(account, state=state))
    changed = [i for i in range(len(data)) if data[i] != upstream[i]]
    assert len(changed) == 1  # the tag's low byte: 4 against upstream's 2
    assert (data[changed[0]], upstream[changed[0]]) == (4, 2)
    assert data[changed[0] + 1 : changed[0] + 4] == bytes(3)
