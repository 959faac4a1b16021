"""The peers' address records a client has read are kept one per listed member, whatever how
often members re-announce (`AddressRecords`, read with every state tick), and only the epoch
members' are verified and kept, however many other clients the backend lists first.

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
            records.learn(listed, book.add_record, {k.public_key for k in members})
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
    ids = {a.public_key, b.public_key}
    book = _CountingBook()
    records = AddressRecords()
    for _ in range(5):
        records.learn([_record(a, 1), _record(b, 2), forged], book.add_record, ids)
    assert book.verified == 3
    assert records.refused == {forged}
    records.learn([_record(b, 2)], book.add_record, ids)
    assert list(records.by_member) == [b.public_key]
    assert not records.refused


def test_records_of_non_members_listed_first_keep_no_member_out() -> None:
    """The backend lists 300 clients that are not the epoch's members (pending joiners of a
    permissionless run) before the epoch's full set of members: every member's record is
    learned, and no non-member's is verified. Before, the cap counted every record read, in
    list order: the non-members' filled it and no member's record was ever learned."""
    outsiders = [SecretKey.generate() for _ in range(300)]
    members = [SecretKey.generate() for _ in range(SOLANA_MAX_NUM_CLIENTS)]
    ids = {key.public_key for key in members}
    listed = [_record(key, 1) for key in outsiders] + [_record(key, 2) for key in members]
    book = _CountingBook()
    records = AddressRecords()
    for _ in range(3):
        records.learn(listed, book.add_record, ids)
    assert set(records.by_member) == ids
    assert book.verified == SOLANA_MAX_NUM_CLIENTS  # each member's once; no outsider's
    assert all(key.public_key not in book for key in outsiders)


def test_refused_records_are_bounded_apart_from_members() -> None:
    """A member's forged records (more than `SOLANA_MAX_NUM_CLIENTS` of them) are remembered
    up to that bound, and take no place from the members' good records."""
    member = SecretKey.generate()
    other = SecretKey.generate()
    signed = _record(member, 1)
    forged = [signed[:-2] + i.to_bytes(2, "big") for i in range(SOLANA_MAX_NUM_CLIENTS + 50)]
    book = _CountingBook()
    records = AddressRecords()
    records.learn(
        [*forged, _record(other, 3)], book.add_record, {member.public_key, other.public_key}
    )
    assert len(records.refused) == SOLANA_MAX_NUM_CLIENTS
    assert list(records.by_member) == [other.public_key]
    assert book.get(member.public_key) is None
