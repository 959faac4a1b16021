"""The peers' address records a client has read are kept one per listed member, whatever how
often members re-announce (`AddressRecords`, read with every state tick).

The old set of every record ever read grew by one per re-announcement (a relay slot reserved
or lost, a restart on a new port) and was never pruned."""

from __future__ import annotations

from psyche.client.client import AddressRecords
from psyche.coordinator import SOLANA_MAX_NUM_CLIENTS
from psyche.core.identity import SecretKey
from psyche.network.discovery import AddressBook, sign_address_record
from psyche.network.ticket import EndpointAddr, TransportAddr


def _record(key: SecretKey, port: int) -> bytes:
    addr = EndpointAddr(key.public_key, [TransportAddr.Libp2p(f"/ip4/127.0.0.1/tcp/{port}")])
    return sign_address_record(key, addr)


class _CountingBook(AddressBook):
    """The real address book, counting the records it had to verify."""

    def __init__(self) -> None:
        super().__init__()
        self.verified = 0

    def add_record(self, raw: bytes) -> EndpointAddr | None:
        self.verified += 1
        return super().add_record(raw)


def test_re_announcements_replace_a_members_record() -> None:
    members = [SecretKey.generate() for _ in range(3)]
    book = _CountingBook()
    records = AddressRecords()
    for round_ in range(100):  # every member re-announces a new port, 100 times
        listed = [_record(key, 10_000 + round_) for key in members]
        for _ in range(3):  # the same list comes with several state ticks
            records.learn(listed, book.add_record)
        assert set(records.by_member) == {key.public_key for key in members}
        assert sorted(records.by_member.values()) == sorted(listed)
        newest = book.get(members[0].public_key)
        assert newest is not None
        assert newest.libp2p_addrs() == [f"/ip4/127.0.0.1/tcp/{10_000 + round_}"]
    assert book.verified == 300  # each record checked once, not once per tick


def test_a_member_no_longer_listed_is_forgotten_and_refused_records_are_not_rechecked() -> None:
    a, b = SecretKey.generate(), SecretKey.generate()
    signed = sign_address_record(a, EndpointAddr(a.public_key, []))
    forged = signed[:-1] + bytes([signed[-1] ^ 1])  # the signature's last byte changed
    book = _CountingBook()
    records = AddressRecords()
    for _ in range(5):
        records.learn([_record(a, 1), _record(b, 2), forged], book.add_record)
    assert book.verified == 3
    assert records.refused == {forged}
    records.learn([_record(b, 2)], book.add_record)
    assert list(records.by_member) == [b.public_key]
    assert not records.refused


def test_what_is_kept_never_exceeds_the_most_members_a_run_can_have() -> None:
    keys = [SecretKey.generate() for _ in range(SOLANA_MAX_NUM_CLIENTS + 5)]
    book = _CountingBook()
    records = AddressRecords()
    records.learn([_record(key, 1) for key in keys], book.add_record)
    assert len(records.by_member) == SOLANA_MAX_NUM_CLIENTS
    assert book.verified == SOLANA_MAX_NUM_CLIENTS
