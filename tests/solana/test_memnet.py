"""Upstream's in-memory ("memnet") program tests, replayed against the local endpoint.

Each scenario follows upstream's `solana-tooling/tests/suites/memnet_*.rs` step by step, over
JSON-RPC with solana-py's client. The Psyche programs are the Python ports here (see
`psyche.solana.localnet`); the system and SPL programs run in LiteSVM.
"""

from __future__ import annotations

import dataclasses

import pytest
from solders.account import Account
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.token.state import TokenAccount
from spl.token.constants import TOKEN_PROGRAM_ID
from spl.token.instructions import (
    MintToParams,
    create_associated_token_account,
    get_associated_token_address,
    mint_to,
)

from psyche.coordinator import RunState, Witness, WitnessMetadata
from psyche.coordinator.committee_selection import CommitteeSelection, WitnessProof
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.model import LLM, Checkpoint, HubRepo, Model
from psyche.core.definitions import Distro, OptimizerDefinition
from psyche.core.node_identity import NodeIdentity
from psyche.solana import pda
from psyche.solana.instructions import INSTRUCTIONS
from psyche.solana.instructions import authorizer as authorizer_ix
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.instructions import treasurer as treasurer_ix
from psyche.solana.state import (
    COORDINATOR_ACCOUNT_SPACE,
    Authorization,
    SolanaClient,
    coordinator_account_from_bytes,
    coordinator_account_to_bytes,
    decode_anchor_account,
)

from .conftest import Endpoint

FEE = 5000
WAITING_FOR_MEMBERS_EXTRA_SECONDS = 10


def _model() -> Model:
    return Model.LLM(
        dataclasses.replace(
            LLM.dummy(),
            max_seq_len=4096,
            checkpoint=Checkpoint.Dummy(HubRepo.dummy()),
            optimizer=OptimizerDefinition.Distro(
                Distro(
                    compression_decay=1.0,
                    compression_topk=1,
                    compression_chunk=1,
                    quantize_1bit=False,
                )
            ),
        )
    )


def _config(**changes: int) -> CoordinatorConfig:
    base = CoordinatorConfig(
        warmup_time=10,
        cooldown_time=999,
        max_round_train_time=15,
        round_witness_time=10,
        global_batch_size_warmup_tokens=0,
        epoch_time=30,
        total_steps=100,
        init_min_clients=1,
        min_clients=1,
        witness_nodes=1,
        global_batch_size_start=1,
        global_batch_size_end=1,
        verification_percent=0,
        waiting_for_members_extra_time=3,
    )
    return dataclasses.replace(base, **changes)


def _state(endpoint: Endpoint, account: Pubkey):  # type: ignore[no-untyped-def]
    return coordinator_account_from_bytes(bytes(endpoint.account(account).data)).state


def _init_run(
    endpoint: Endpoint, payer: Keypair, run_id: str, main: Keypair, join: Keypair
) -> tuple[Pubkey, Pubkey]:
    ids = endpoint.ledger.program_ids
    account = endpoint.new_exempt(payer, COORDINATOR_ACCOUNT_SPACE, ids.coordinator_key)
    endpoint.process(
        [
            coordinator_ix.coordinator_init_coordinator(
                payer.pubkey(), run_id, "test", account, main.pubkey(), join.pubkey()
            )
        ],
        payer,
    )
    return pda.find_coordinator_instance(run_id), account


def _tick(
    endpoint: Endpoint, payer: Keypair, ticker: Keypair, instance: Pubkey, account: Pubkey
) -> None:
    endpoint.process(
        [coordinator_ix.coordinator_tick(instance, account, ticker.pubkey())], payer, [ticker]
    )


def test_coordinator_init_free(endpoint: Endpoint) -> None:
    payer, main, join = Keypair(), Keypair(), Keypair()
    endpoint.airdrop(payer.pubkey(), 5_000_000_000)
    payer_start = endpoint.balance(payer.pubkey())
    main_start = endpoint.balance(main.pubkey())
    instance, account = _init_run(endpoint, payer, "this is a dummy run_id", main, join)
    payer_after = endpoint.balance(payer.pubkey())
    assert payer_after < payer_start
    assert endpoint.balance(main.pubkey()) == main_start
    assert endpoint.account(instance) is not None
    assert endpoint.account(account) is not None

    spill = Pubkey.new_unique()
    spill_before = endpoint.balance(spill)
    endpoint.process(
        [
            coordinator_ix.SPECS["free_coordinator"].build(
                endpoint.ledger.program_ids.coordinator,
                {
                    "authority": main.pubkey(),
                    "spill": spill,
                    "coordinator_instance": instance,
                    "coordinator_account": account,
                },
                coordinator_ix.FreeCoordinatorArgs(),
            )
        ],
        payer,
        [main],
    )
    assert endpoint.balance(payer.pubkey()) == payer_after - FEE * 2
    assert endpoint.balance(main.pubkey()) == main_start
    assert endpoint.balance(spill) > spill_before
    assert endpoint.account(instance) is None
    assert endpoint.account(account) is None


def test_coordinator_full_round(endpoint: Endpoint) -> None:
    payer, main, join, client, ticker = (Keypair() for _ in range(5))
    endpoint.airdrop(payer.pubkey(), 5_000_000_000)
    warmup_time = round_witness_time = 10
    run_id = "This is a random run id!"
    instance, account = _init_run(endpoint, payer, run_id, main, join)
    assert _state(endpoint, account).coordinator.run_state is RunState.Uninitialized

    endpoint.process(
        [
            coordinator_ix.coordinator_update(
                run_id, account, main.pubkey(), config=_config(), model=_model()
            )
        ],
        payer,
        [main],
    )
    assert _state(endpoint, account).coordinator.run_state is RunState.Uninitialized
    # Can't tick yet because paused/uninitialized
    assert (
        endpoint.process_err(
            [coordinator_ix.coordinator_tick(instance, account, ticker.pubkey())], payer, [ticker]
        ).anchor_error
        == "CoordinatorErrorHalted"
    )

    client_id = NodeIdentity(bytes(client.pubkey()), bytes(32))
    authorization = endpoint.authorize(payer, join, client.pubkey())
    # Whitelisted with the wrong account, can't join
    wrong = INSTRUCTIONS["coordinator"]["join_run"].build(
        endpoint.ledger.program_ids.coordinator,
        {
            "user": payer.pubkey(),
            "authorization": authorization,
            "coordinator_instance": instance,
            "coordinator_account": account,
        },
        coordinator_ix.JoinRunArgs(coordinator_ix.JoinRunParams(client_id)),
    )
    assert endpoint.process_err([wrong], payer).anchor_error == "ConstraintRaw"
    endpoint.process(
        [coordinator_ix.coordinator_join_run(instance, account, authorization, client_id)],
        payer,
        [client],
    )
    assert _state(endpoint, account).coordinator.run_state is RunState.Uninitialized
    endpoint.process_err(
        [coordinator_ix.coordinator_tick(instance, account, ticker.pubkey())], payer, [ticker]
    )

    endpoint.process(
        [coordinator_ix.coordinator_set_paused(run_id, account, main.pubkey(), False)],
        payer,
        [main],
    )
    # Rejoin after a while: a no-op
    endpoint.process(
        [coordinator_ix.coordinator_join_run(instance, account, authorization, client_id)],
        payer,
        [client],
    )
    endpoint.forward_clock(WAITING_FOR_MEMBERS_EXTRA_SECONDS)
    _tick(endpoint, payer, ticker, instance, account)
    assert _state(endpoint, account).coordinator.run_state is RunState.Warmup
    endpoint.forward_clock(warmup_time)
    _tick(endpoint, payer, ticker, instance, account)
    coordinator = _state(endpoint, account).coordinator
    assert coordinator.run_state is RunState.RoundTrain
    assert coordinator.current_round().height == 0
    assert coordinator.progress.step == 1

    witness = Witness(WitnessProof(0, 0, True))
    witness_ix = coordinator_ix.coordinator_witness
    assert (
        endpoint.process_err(
            [witness_ix(instance, account, ticker.pubkey(), witness, WitnessMetadata())],
            payer,
            [ticker],
        ).anchor_error
        == "SignerNotAClient"
    )
    endpoint.process(
        [witness_ix(instance, account, client.pubkey(), witness, WitnessMetadata())],
        payer,
        [client],
    )
    assert _state(endpoint, account).coordinator.run_state is RunState.RoundWitness
    endpoint.forward_clock(round_witness_time)
    _tick(endpoint, payer, ticker, instance, account)
    assert _state(endpoint, account).coordinator.run_state is RunState.RoundTrain


@pytest.mark.parametrize("num_clients", [12, pytest.param(240, marks=pytest.mark.slow)])
def test_coordinator_rewards(endpoint: Endpoint, num_clients: int) -> None:
    """`memnet_coordinator_rewards` (upstream uses 240 clients; 12 is the quick variant)."""
    payer, main, join, ticker = (Keypair() for _ in range(4))
    endpoint.airdrop(payer.pubkey(), 500_000_000_000)
    clients = [Keypair() for _ in range(num_clients)]
    earned_per_epoch = 444_444
    run_id = "This is a random run id!"
    instance, account = _init_run(endpoint, payer, run_id, main, join)
    config = _config(
        cooldown_time=88,
        witness_nodes=0,
        global_batch_size_end=len(clients),
        waiting_for_members_extra_time=WAITING_FOR_MEMBERS_EXTRA_SECONDS,
    )
    endpoint.process(
        [
            coordinator_ix.coordinator_update(
                run_id, account, main.pubkey(), config=config, model=_model()
            )
        ],
        payer,
        [main],
    )
    endpoint.process(
        [
            coordinator_ix.coordinator_set_future_epoch_rates(
                run_id, account, main.pubkey(), earned_per_epoch, None
            )
        ],
        payer,
        [main],
    )
    endpoint.process(
        [coordinator_ix.coordinator_set_paused(run_id, account, main.pubkey(), False)],
        payer,
        [main],
    )
    for client in clients:
        authorization = endpoint.authorize(payer, join, client.pubkey(), preflight=False)
        identity = NodeIdentity(bytes(client.pubkey()), bytes(32))
        endpoint.process(
            [coordinator_ix.coordinator_join_run(instance, account, authorization, identity)],
            payer,
            [client],
            preflight=False,
        )
    endpoint.forward_clock(WAITING_FOR_MEMBERS_EXTRA_SECONDS)
    _tick(endpoint, payer, ticker, instance, account)
    endpoint.forward_clock(10)
    _tick(endpoint, payer, ticker, instance, account)
    for _ in range(4):
        coordinator = _state(endpoint, account).coordinator
        selection = CommitteeSelection.from_coordinator(coordinator, 0)
        signers = [c.id.signer for c in coordinator.epoch_state.clients]
        for client in clients:
            proof = selection.get_witness(signers.index(bytes(client.pubkey())))
            if proof.position >= 32:
                continue
            endpoint.process(
                [
                    coordinator_ix.coordinator_witness(
                        instance, account, client.pubkey(), Witness(proof), WitnessMetadata()
                    )
                ],
                payer,
                [client],
                preflight=False,
            )
        endpoint.forward_clock(10)
        _tick(endpoint, payer, ticker, instance, account)
    endpoint.forward_clock(88)
    _tick(endpoint, payer, ticker, instance, account)
    state = _state(endpoint, account)
    assert state.coordinator.progress.epoch == 1
    for client in clients:
        found = next(
            c for c in state.clients_state.clients if c.id.signer == bytes(client.pubkey())
        )
        assert found.earned == earned_per_epoch // len(clients)


def test_authorizer_full_cycle(endpoint: Endpoint) -> None:
    payer, grantor, grantee = Keypair(), Keypair(), Keypair()
    endpoint.airdrop(payer.pubkey(), 5_000_000_000)
    scope = bytes([1, 2, 3, 4, 5, 6, 7])
    delegates = [Pubkey.new_unique() for _ in range(66)]
    address = pda.find_authorization(grantor.pubkey(), grantee.pubkey(), scope)
    assert endpoint.account(address) is None

    def state() -> Authorization:
        return decode_anchor_account(bytes(endpoint.account(address).data), Authorization)

    def grantee_update(clear: bool, added: list[Pubkey]) -> None:
        endpoint.process(
            [
                authorizer_ix.authorizer_authorization_grantee_update(
                    payer.pubkey(), grantor.pubkey(), grantee.pubkey(), scope, clear, added
                )
            ],
            payer,
            [grantee],
        )

    def grantor_update(active: bool) -> None:
        endpoint.process(
            [
                authorizer_ix.authorizer_authorization_grantor_update(
                    grantor.pubkey(), grantee.pubkey(), scope, active
                )
            ],
            payer,
            [grantor],
        )

    def check(active: bool, expected: list[Pubkey]) -> Authorization:
        auth = state()
        assert auth.grantor == bytes(grantor.pubkey())
        assert auth.grantee == bytes(grantee.pubkey())
        assert auth.scope == scope
        assert auth.active is active
        assert auth.delegates == [bytes(d) for d in expected]
        assert len(endpoint.account(address).data) == Authorization.space_with_discriminator(
            len(scope), len(expected)
        )
        return auth

    endpoint.process(
        [
            authorizer_ix.authorizer_authorization_create(
                payer.pubkey(), grantor.pubkey(), grantee.pubkey(), scope
            )
        ],
        payer,
        [grantor],
    )
    auth = check(False, [])
    assert not auth.is_valid_for(grantor.pubkey(), grantee.pubkey(), scope)
    assert not auth.is_valid_for(grantor.pubkey(), delegates[1], scope)

    grantee_update(False, delegates[:5])
    auth = check(False, delegates[:5])
    assert not auth.is_valid_for(grantor.pubkey(), delegates[1], scope)

    grantee_update(True, delegates[10:30])
    grantee_update(False, delegates[30:50])
    auth = check(False, delegates[10:50])
    assert not auth.is_valid_for(grantor.pubkey(), delegates[40], scope)

    grantor_update(True)
    auth = check(True, delegates[10:50])
    assert auth.is_valid_for(grantor.pubkey(), grantee.pubkey(), scope)
    assert not auth.is_valid_for(grantor.pubkey(), delegates[3], scope)
    assert auth.is_valid_for(grantor.pubkey(), delegates[45], scope)

    grantee_update(True, delegates[3:5])
    auth = check(True, delegates[3:5])
    assert auth.is_valid_for(grantor.pubkey(), delegates[3], scope)
    assert not auth.is_valid_for(grantor.pubkey(), delegates[45], scope)

    grantor_update(False)
    auth = check(False, delegates[3:5])
    for key in (grantee.pubkey(), delegates[3], delegates[45]):
        assert not auth.is_valid_for(grantor.pubkey(), key, scope)

    close = authorizer_ix.authorizer_authorization_close(
        grantor.pubkey(), grantee.pubkey(), scope, payer.pubkey()
    )
    # Delegates keep it open (30 days after the grantor's last update).
    assert endpoint.process_err([close], payer, [grantor]).anchor_error == (
        "AuthorizationClosingConditionsNotReachedYet"
    )
    grantee_update(True, [])
    rent_before = endpoint.balance(payer.pubkey())
    endpoint.process([close], payer, [grantor])
    assert endpoint.account(address) is None
    assert endpoint.balance(payer.pubkey()) > rent_before - 2 * FEE


def _ata(endpoint: Endpoint, payer: Keypair, owner: Pubkey, mint: Pubkey) -> Pubkey:
    address = get_associated_token_address(owner, mint)
    if endpoint.account(address) is None:
        endpoint.process([create_associated_token_account(payer.pubkey(), owner, mint)], payer)
    return address


def _amount(endpoint: Endpoint, address: Pubkey) -> int:
    return TokenAccount.from_bytes(bytes(endpoint.account(address).data)).amount


def _run_create(
    endpoint: Endpoint,
    payer: Keypair,
    mint: Pubkey,
    account: Pubkey,
    index: int,
    run_id: str,
    main: Pubkey,
    join: Pubkey,
) -> Pubkey:
    endpoint.process(
        [
            treasurer_ix.treasurer_run_create(
                payer.pubkey(), run_id, "latest", index, mint, account, main, join
            )
        ],
        payer,
    )
    return pda.find_run(index)


def test_treasurer_create_claim(endpoint: Endpoint) -> None:
    payer, mint_authority, main, join, client1, client2 = (Keypair() for _ in range(6))
    endpoint.airdrop(payer.pubkey(), 5_000_000_000)
    ids = endpoint.ledger.program_ids
    mint1 = endpoint.new_mint(payer, mint_authority.pubkey(), 6)
    mint2 = endpoint.new_mint(payer, mint_authority.pubkey(), 6)
    account1 = endpoint.new_exempt(payer, COORDINATOR_ACCOUNT_SPACE, ids.coordinator_key)
    account2 = endpoint.new_exempt(payer, COORDINATOR_ACCOUNT_SPACE, ids.coordinator_key)
    run1 = _run_create(
        endpoint,
        payer,
        mint1,
        account1,
        41,
        "This is my run's dummy run_id1",
        main.pubkey(),
        join.pubkey(),
    )
    _run_create(
        endpoint,
        payer,
        mint2,
        account2,
        42,
        "This is my run's dummy run_id2",
        main.pubkey(),
        join.pubkey(),
    )
    run1_collateral1 = _ata(endpoint, payer, run1, mint1)
    run2_collateral2 = _ata(endpoint, payer, run1, mint2)  # (sic) upstream uses run1 here too
    for mint, vault in ((mint1, run1_collateral1), (mint2, run2_collateral2)):
        endpoint.process(
            [
                mint_to(
                    MintToParams(
                        TOKEN_PROGRAM_ID, mint, vault, mint_authority.pubkey(), 1_000_000_000_000
                    )
                )
            ],
            payer,
            [mint_authority],
        )
    c1m1 = _ata(endpoint, payer, client1.pubkey(), mint1)
    c1m2 = _ata(endpoint, payer, client1.pubkey(), mint2)
    c2m1 = _ata(endpoint, payer, client2.pubkey(), mint1)
    c2m2 = _ata(endpoint, payer, client2.pubkey(), mint2)
    for client in (client1, client2):
        for index in (41, 42):
            endpoint.process(
                [treasurer_ix.treasurer_participant_create(payer.pubkey(), index, client.pubkey())],
                payer,
                [client],
            )

    def claim(
        user: Keypair,
        user_collateral: Pubkey,
        mint: Pubkey,
        index: int,
        coordinator_account: Pubkey,
        points: int,
    ) -> list:
        instruction = treasurer_ix.treasurer_participant_claim(
            index, mint, coordinator_account, user.pubkey(), points
        )
        # upstream's helper takes the user collateral account explicitly
        metas = list(instruction.accounts)
        metas[1] = type(metas[1])(user_collateral, False, True)
        return [type(instruction)(instruction.program_id, bytes(instruction.data), metas)]

    # Claiming nothing works
    endpoint.process(claim(client1, c1m1, mint1, 41, account1, 0), payer, [client1])
    endpoint.process(claim(client2, c2m1, mint1, 41, account1, 0), payer, [client2])
    endpoint.process(claim(client1, c1m2, mint2, 42, account2, 0), payer, [client1])
    endpoint.process(claim(client2, c2m2, mint2, 42, account2, 0), payer, [client2])
    # Claiming something fails: nothing was earned
    assert (
        endpoint.process_err(
            claim(client1, c1m1, mint1, 41, account1, 1), payer, [client1]
        ).anchor_error
        == "InvalidParameter"
    )
    # Wrong owner, wrong ATA, wrong mint, wrong run, wrong coordinator account
    endpoint.process_err(claim(client2, c1m1, mint1, 41, account1, 0), payer, [client2])
    endpoint.process_err(claim(client1, c2m1, mint1, 41, account1, 0), payer, [client1])
    endpoint.process_err(claim(client1, c1m2, mint1, 41, account1, 0), payer, [client1])
    endpoint.process_err(claim(client1, c1m1, mint2, 41, account1, 0), payer, [client1])
    endpoint.process_err(claim(client1, c1m1, mint1, 42, account1, 0), payer, [client1])
    endpoint.process_err(claim(client1, c1m1, mint1, 41, account2, 0), payer, [client1])
    for address in (c1m1, c2m2, c1m2, c2m1):
        assert _amount(endpoint, address) == 0
    assert _amount(endpoint, run1_collateral1) == 1_000_000_000_000
    assert _amount(endpoint, run2_collateral2) == 1_000_000_000_000


def test_treasurer_create_update(endpoint: Endpoint) -> None:
    payer, main = Keypair(), Keypair()
    endpoint.airdrop(payer.pubkey(), 5_000_000_000)
    ids = endpoint.ledger.program_ids
    index, run_id = 42, "This is my run's dummy run_id"
    params = treasurer_ix.RunUpdateParams(
        config=_config(cooldown_time=88, waiting_for_members_extra_time=10),
        model=_model(),
        epoch_earning_rate_total_shared=66,
        paused=False,
    )
    mint = endpoint.new_mint(payer, Pubkey.new_unique(), 6)
    account = endpoint.new_exempt(payer, COORDINATOR_ACCOUNT_SPACE, ids.coordinator_key)
    join = Pubkey.new_unique()

    def run_create(
        name: str, treasurer_index: int, collateral_mint: Pubkey, coordinator_account: Pubkey
    ) -> Instruction:
        return treasurer_ix.treasurer_run_create(
            payer.pubkey(),
            name,
            "latest",
            treasurer_index,
            collateral_mint,
            coordinator_account,
            main.pubkey(),
            join,
        )

    # No proper coordinator account, no proper mint: both fail
    endpoint.process_err([run_create(run_id, index, mint, Pubkey.new_unique())], payer)
    endpoint.process_err([run_create(run_id, index, Pubkey.new_unique(), account)], payer)
    run = _run_create(endpoint, payer, mint, account, index, run_id, main.pubkey(), join)
    instance = pda.find_coordinator_instance(run_id)
    # The run PDA is the coordinator's main authority.
    assert decode_anchor_account(
        bytes(endpoint.account(instance).data),
        __import__("psyche.solana.state", fromlist=["x"]).CoordinatorInstance,
    ).main_authority == bytes(run)
    wrong = Keypair()
    assert (
        endpoint.process_err(
            [treasurer_ix.treasurer_run_update(run_id, index, account, wrong.pubkey(), params)],
            payer,
            [wrong],
        ).anchor_error
        == "ConstraintRaw"
    )
    endpoint.process(
        [treasurer_ix.treasurer_run_update(run_id, index, account, main.pubkey(), params)],
        payer,
        [main],
    )
    state = _state(endpoint, account)
    assert state.coordinator.run_state is RunState.WaitingForMembers
    assert state.clients_state.future_epoch_rates.earning_rate_total_shared == 66
    # Same coordinator account, same index, same run id: all fail
    endpoint.process_err([run_create("another run id", index + 1, mint, account)], payer)
    account2 = endpoint.new_exempt(payer, COORDINATOR_ACCOUNT_SPACE, ids.coordinator_key)
    endpoint.process_err([run_create("another run id", index, mint, account2)], payer)
    endpoint.process_err([run_create(run_id, index + 1, mint, account2)], payer)
    _run_create(endpoint, payer, mint, account2, index + 1, "another run id", main.pubkey(), join)


def test_a_failing_transaction_changes_nothing_but_the_fee(endpoint: Endpoint) -> None:
    """All-or-nothing: an instruction after a successful one fails, both are rolled back."""
    payer = Keypair()
    endpoint.airdrop(payer.pubkey(), 5_000_000_000)
    ids = endpoint.ledger.program_ids
    account = endpoint.new_exempt(payer, COORDINATOR_ACCOUNT_SPACE, ids.coordinator_key)
    destination = Pubkey.new_unique()
    from solders import system_program

    transfer = system_program.transfer(
        system_program.TransferParams(
            from_pubkey=payer.pubkey(), to_pubkey=destination, lamports=10**6
        )
    )
    # An over-long run id (the builder refuses it): the program panics deriving the PDA.
    init = INSTRUCTIONS["coordinator"]["init_coordinator"].build(
        ids.coordinator,
        {
            "payer": payer.pubkey(),
            "coordinator_instance": Pubkey.new_unique(),
            "coordinator_account": account,
            "system_program": Pubkey.default(),
        },
        coordinator_ix.InitCoordinatorArgs(
            coordinator_ix.InitCoordinatorParams(
                bytes(payer.pubkey()), bytes(payer.pubkey()), "x" * 33, "v"
            )
        ),
    )
    before = endpoint.balance(payer.pubkey())
    rejected = endpoint.process_err([transfer, init], payer)
    assert "Program failed to complete" in str(rejected) or any(
        "panicked" in line for line in rejected.logs
    )
    assert endpoint.balance(destination) == 0
    assert endpoint.balance(payer.pubkey()) == before  # preflight failed: nothing landed
    # Without preflight the transaction lands, fails, and only the fee is charged.
    from solana.rpc.types import TxOpts
    from solders.message import Message
    from solders.transaction import Transaction

    blockhash = endpoint.client.get_latest_blockhash().value.blockhash
    tx = Transaction([payer], Message([transfer, init], payer.pubkey()), blockhash)
    signature = endpoint.client.send_transaction(tx, opts=TxOpts(skip_preflight=True)).value
    status = endpoint.client.get_signature_statuses([signature]).value[0]
    assert status is not None
    assert status.err is not None
    assert endpoint.balance(destination) == 0
    assert endpoint.balance(payer.pubkey()) == before - FEE
    data = bytes(endpoint.account(account).data)
    assert data == bytes(COORDINATOR_ACCOUNT_SPACE)  # still all zero


def test_treasurer_pays_earned_less_slashed(endpoint: Endpoint) -> None:
    """Beyond upstream (issue 27): a client slashed for losing a verification dispute is paid
    `earned - slashed` (`SolanaClient.claimable`). The coordinator account is given a client
    that earned 100 points and was slashed 30 (what the coordinator program's verification does:
    tests/solana/test_verification.py); the treasurer then pays 70 and refuses a point more."""
    payer, mint_authority, main, join, user = (Keypair() for _ in range(5))
    endpoint.airdrop(payer.pubkey(), 5_000_000_000)
    ids = endpoint.ledger.program_ids
    mint = endpoint.new_mint(payer, mint_authority.pubkey(), 6)
    account = endpoint.new_exempt(payer, COORDINATOR_ACCOUNT_SPACE, ids.coordinator_key)
    run = _run_create(
        endpoint, payer, mint, account, 43, "slashed run", main.pubkey(), join.pubkey()
    )
    vault = _ata(endpoint, payer, run, mint)
    endpoint.process(
        [mint_to(MintToParams(TOKEN_PROGRAM_ID, mint, vault, mint_authority.pubkey(), 1000))],
        payer,
        [mint_authority],
    )
    endpoint.process(
        [treasurer_ix.treasurer_participant_create(payer.pubkey(), 43, user.pubkey())],
        payer,
        [user],
    )
    stored = endpoint.ledger.get_account(account)
    assert stored is not None
    state = coordinator_account_from_bytes(bytes(stored.data))
    client = SolanaClient(NodeIdentity(bytes(user.pubkey()), bytes(32)), earned=100, slashed=30)
    state.state.clients_state.clients.append(client)
    data = coordinator_account_to_bytes(state)
    endpoint.ledger.set_account(
        account, Account(stored.lamports, data, stored.owner, stored.executable, stored.rent_epoch)
    )
    user_collateral = _ata(endpoint, payer, user.pubkey(), mint)

    def claim(points: int) -> list:
        return [treasurer_ix.treasurer_participant_claim(43, mint, account, user.pubkey(), points)]

    assert endpoint.process_err(claim(71), payer, [user]).anchor_error == "InvalidParameter"
    endpoint.process(claim(70), payer, [user])
    assert _amount(endpoint, user_collateral) == 70
    assert endpoint.process_err(claim(1), payer, [user]).anchor_error == "InvalidParameter"
