"""The local endpoint speaks Solana's JSON-RPC and websocket protocols: solana-py and anchorpy use it
unmodified, and malformed requests are rejected without taking it down."""

from __future__ import annotations

import asyncio
import json
import socket
import warnings

import based58
import httpx
import pytest
from anchorpy import Context, Program, Provider, Wallet
from solana.rpc.async_api import AsyncClient
from solana.rpc.core import RPCException
from solana.rpc.types import MemcmpOpts, TxOpts
from solders import system_program
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.rpc.responses import AccountNotification, SignatureNotification
from solders.signature import Signature
from solders.transaction import Transaction

from psyche.solana import pda
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.state import (
    COORDINATOR_ACCOUNT_DISCRIMINATOR,
    COORDINATOR_ACCOUNT_SPACE,
    JOIN_RUN_AUTHORIZATION_SCOPE,
    coordinator_account_from_bytes,
)

from .anchorpy_idl import load_anchorpy_idl
from .conftest import Endpoint

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # solana-py imports websockets.legacy
    from solana.rpc.websocket_api import connect

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:sumtypes"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:websockets"),
]


def _create_run(endpoint: Endpoint, payer: Keypair, run_id: str) -> Pubkey:
    ids = endpoint.ledger.program_ids
    account = endpoint.new_exempt(payer, COORDINATOR_ACCOUNT_SPACE, ids.coordinator_key)
    endpoint.process(
        [
            coordinator_ix.coordinator_init_coordinator(
                payer.pubkey(), run_id, "test", account, payer.pubkey(), payer.pubkey()
            )
        ],
        payer,
    )
    return account


def test_solana_py_reads_and_writes(endpoint: Endpoint) -> None:
    client = endpoint.client
    payer = Keypair()
    assert client.is_connected()
    endpoint.airdrop(payer.pubkey(), 2_000_000_000)
    assert client.get_balance(payer.pubkey()).value == 2_000_000_000
    account = _create_run(endpoint, payer, "compat")

    for encoding in ("base64", "base64+zstd"):
        info = client.get_account_info(account, encoding=encoding).value
        assert info.owner == endpoint.ledger.program_ids.coordinator_key
        decoded = coordinator_account_from_bytes(bytes(info.data))
        assert decoded.state.coordinator.run_id == "compat"
    many = client.get_multiple_accounts([account, Pubkey.new_unique()]).value
    assert many[0] is not None
    assert many[1] is None

    program = endpoint.ledger.program_ids.coordinator_key
    discriminator = based58.b58encode(COORDINATOR_ACCOUNT_DISCRIMINATOR).decode()
    found = client.get_program_accounts(
        program, filters=[COORDINATOR_ACCOUNT_SPACE, MemcmpOpts(offset=0, bytes=discriminator)]
    ).value
    assert [a.pubkey for a in found] == [account]
    assert (
        client.get_program_accounts(
            program, filters=[MemcmpOpts(offset=1, bytes=discriminator)]
        ).value
        == []
    )
    assert client.get_program_accounts(program, filters=[COORDINATOR_ACCOUNT_SPACE + 1]).value == []

    # A transfer, its status and its logs
    dest = Pubkey.new_unique()
    blockhash = client.get_latest_blockhash().value.blockhash
    transfer = system_program.transfer(
        system_program.TransferParams(
            from_pubkey=payer.pubkey(), to_pubkey=dest, lamports=1_000_000
        )
    )
    tx = Transaction([payer], Message([transfer], payer.pubkey()), blockhash)
    simulated = client.simulate_transaction(tx).value
    assert simulated.err is None
    assert simulated.logs
    signature = client.send_transaction(tx, opts=TxOpts(skip_confirmation=False)).value
    status = client.get_signature_statuses([signature]).value[0]
    assert status is not None
    assert status.err is None
    fetched = client.get_transaction(signature).value
    assert fetched is not None
    assert any("invoke [1]" in line for line in fetched.transaction.meta.log_messages)
    assert client.get_balance(dest).value == 1_000_000

    # The same transaction again is rejected (already processed)
    with pytest.raises(RPCException, match="already been processed"):
        client.send_raw_transaction(bytes(tx))
    # A failed preflight carries the simulation's error and logs
    too_much = system_program.transfer(
        system_program.TransferParams(from_pubkey=payer.pubkey(), to_pubkey=dest, lamports=10**15)
    )
    blockhash = client.get_latest_blockhash().value.blockhash
    with pytest.raises(RPCException) as info:
        client.send_transaction(
            Transaction([payer], Message([too_much], payer.pubkey()), blockhash)
        )
    failure = info.value.args[0]
    assert "custom program error: 0x1" in failure.message
    assert failure.data.err is not None
    assert failure.data.logs


def test_bad_signature_and_stale_blockhash(endpoint: Endpoint) -> None:
    payer = Keypair()
    endpoint.airdrop(payer.pubkey(), 10**9)
    client = endpoint.client
    blockhash = client.get_latest_blockhash().value.blockhash
    transfer = system_program.transfer(
        system_program.TransferParams(
            from_pubkey=payer.pubkey(), to_pubkey=Pubkey.new_unique(), lamports=5000
        )
    )
    tx = Transaction([payer], Message([transfer], payer.pubkey()), blockhash)
    forged = Transaction.populate(tx.message, [Signature.new_unique()])
    with pytest.raises(RPCException, match="SignatureVerificationFailure"):
        client.send_raw_transaction(bytes(forged))
    from solders.hash import Hash

    stale = Transaction([payer], Message([transfer], payer.pubkey()), Hash.new_unique())
    with pytest.raises(RPCException, match="Blockhash not found"):
        client.send_raw_transaction(bytes(stale))


def test_websocket_subscriptions_with_solana_py(endpoint: Endpoint) -> None:
    payer = Keypair()
    endpoint.airdrop(payer.pubkey(), 10**9)
    watched = Pubkey.new_unique()

    async def main() -> None:
        async with connect(endpoint.net.ws_url) as ws:
            await ws.account_subscribe(watched, encoding="base64+zstd")
            await ws.recv()  # subscription id
            client = AsyncClient(endpoint.net.rpc_url)
            try:
                blockhash = (await client.get_latest_blockhash()).value.blockhash
                tx = Transaction(
                    [payer],
                    Message(
                        [
                            system_program.transfer(
                                system_program.TransferParams(
                                    from_pubkey=payer.pubkey(),
                                    to_pubkey=watched,
                                    lamports=3_000_000,
                                )
                            )
                        ],
                        payer.pubkey(),
                    ),
                    blockhash,
                )
                signature = (await client.send_transaction(tx)).value
                await ws.signature_subscribe(signature)
                seen_account = seen_signature = False
                while not (seen_account and seen_signature):
                    for message in await asyncio.wait_for(ws.recv(), 5):
                        if isinstance(message, AccountNotification):
                            assert message.result.value.lamports == 3_000_000
                            seen_account = True
                        elif isinstance(message, SignatureNotification):
                            assert message.result.value.err is None
                            seen_signature = True
            finally:
                await client.close()

    asyncio.run(main())


def test_anchorpy_program_against_the_endpoint(endpoint: Endpoint) -> None:
    """anchorpy, reading the committed IDL, sends instructions and fetches accounts."""
    payer = Keypair()
    endpoint.airdrop(payer.pubkey(), 10**10)
    ids = endpoint.ledger.program_ids

    async def main() -> None:
        client = AsyncClient(endpoint.net.rpc_url)
        provider = Provider(client, Wallet(payer), TxOpts(skip_confirmation=False))
        try:
            authorizer = Program(load_anchorpy_idl("authorizer"), ids.authorizer_key, provider)
            grantee = Pubkey.default()
            address = pda.find_authorization(payer.pubkey(), grantee, JOIN_RUN_AUTHORIZATION_SCOPE)
            await authorizer.rpc["authorization_create"](
                {"grantee": grantee, "scope": JOIN_RUN_AUTHORIZATION_SCOPE},
                ctx=Context(
                    accounts={
                        "payer": payer.pubkey(),
                        "grantor": payer.pubkey(),
                        "authorization": address,
                        "system_program": system_program.ID,
                    }
                ),
            )
            await authorizer.rpc["authorization_grantor_update"](
                {"active": True},
                ctx=Context(accounts={"grantor": payer.pubkey(), "authorization": address}),
            )
            fetched = await authorizer.account["Authorization"].fetch(address)
            assert fetched.active is True
            assert bytes(fetched.scope) == JOIN_RUN_AUTHORIZATION_SCOPE
            assert fetched.grantee == grantee
        finally:
            await client.close()

    asyncio.run(main())


def test_malformed_requests_are_rejected(endpoint: Endpoint) -> None:
    url = endpoint.net.rpc_url
    with httpx.Client(timeout=10) as http:
        assert http.post(url, content=b"{not json").json()["error"]["code"] == -32700
        body = {"jsonrpc": "2.0", "id": 1, "method": "noSuchMethod", "params": []}
        assert http.post(url, json=body).json()["error"]["code"] == -32601
        body = {"jsonrpc": "2.0", "id": 2, "method": "getBalance", "params": ["not a key"]}
        assert http.post(url, json=body).json()["error"]["code"] == -32602
        body = {
            "jsonrpc": "2.0",
            "id": 3,
            "method": "sendTransaction",
            "params": ["!!", {"encoding": "base64"}],
        }
        assert http.post(url, json=body).json()["error"]["code"] == -32602
        body = {
            "jsonrpc": "2.0",
            "id": 4,
            "method": "sendTransaction",
            "params": ["AAAA" * 500, {"encoding": "base64"}],
        }
        assert http.post(url, json=body).json()["error"]["code"] == -32602
        assert http.post(url, json=[]).json()["error"]["code"] == -32600
        batch = [{"jsonrpc": "2.0", "id": i, "method": "getSlot"} for i in range(3)]
        assert [r["id"] for r in http.post(url, json=batch).json()] == [0, 1, 2]
        assert http.get(url).status_code == 405
        assert http.get(url + "/health").text == "ok"
        assert http.post(url, content=b"x" * (2 << 20)).status_code == 413
    # Garbage on the socket: the connection is dropped, the server keeps serving.
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"\x16\x03\x01 garbage that is not HTTP\r\n\r\n")
        raw.recv(1024)
    with httpx.Client(timeout=10) as http:
        body = {"jsonrpc": "2.0", "id": 9, "method": "getHealth"}
        assert http.post(url, json=body).json()["result"] == "ok"

    async def bad_websocket_messages() -> None:
        import websockets

        async with websockets.connect(endpoint.net.ws_url) as ws:
            await ws.send("not json")
            assert json.loads(await ws.recv())["error"]["code"] == -32700
            await ws.send(
                json.dumps(
                    {"jsonrpc": "2.0", "id": 1, "method": "accountSubscribe", "params": ["bad key"]}
                )
            )
            assert json.loads(await ws.recv())["error"]["code"] == -32602
            await ws.send(json.dumps({"jsonrpc": "2.0", "id": 2, "method": "getSlot"}))
            assert isinstance(json.loads(await ws.recv())["result"], int)

    asyncio.run(bad_websocket_messages())
