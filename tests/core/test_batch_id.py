from __future__ import annotations

import pytest

from psyche.core.batch_id import BatchId
from psyche.core.interval_tree import ClosedInterval
from psyche.core.serde import from_bytes, from_obj, to_bytes, to_obj


def test_display() -> None:
    assert str(BatchId(5, 5)) == "B5"
    assert str(BatchId(0, 24)) == "B[0, 24]"
    assert repr(BatchId(0, 24)) == "B[0, 24]"


def test_from_str() -> None:
    assert BatchId.from_str("B[1,5]") == BatchId(1, 5)
    assert BatchId.from_str("[1,5]") == BatchId(1, 5)
    assert BatchId.from_str("BBB[+1,5]") == BatchId(1, 5)
    assert BatchId.from_str("B[0,18446744073709551615]") == BatchId(0, 2**64 - 1)
    # no validation of the order, like upstream's struct literal
    assert BatchId.from_str("B[9,2]") == BatchId(9, 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("B5", "Missing '[' in input"),
        ("B[1 5]", "Missing ',' in input"),
        ("B[1,5", "Missing ']' in input"),
        ("B[1, 5]", "Failed to parse end value"),  # its own display form (upstream quirk)
        ("B[ 1,5]", "Failed to parse start value"),
        ("B[x,5]", "Failed to parse start value"),
        ("B[,5]", "Failed to parse start value"),
        ("B[1,]", "Failed to parse end value"),
        ("B[1_0,5]", "Failed to parse start value"),
        ("B[\u0661,5]", "Failed to parse start value"),  # a non-ASCII digit
        ("B[-1,5]", "Failed to parse start value"),
        ("B[+,5]", "Failed to parse start value"),
        ("B[1,18446744073709551616]", "Failed to parse end value"),
        ("B[x],", "Failed to parse start value"),
        ("B,[1]", "',' before '['"),
        ("B[1]2,", "Failed to parse start value"),
        ("B][1,", "']' before ','"),
    ],
)
def test_from_str_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        BatchId.from_str(text)


def test_wire_form_is_the_inner_interval() -> None:
    batch = BatchId(0, 24)
    assert to_bytes(batch) == to_bytes(ClosedInterval(0, 24)) == bytes([0, 24])
    assert from_bytes(bytes([0, 24]), BatchId) == batch
    assert to_obj(batch) == {"start": 0, "end": 24}
    assert from_obj({"start": 0, "end": 24}, BatchId) == batch


def test_order_hash_iter_len() -> None:
    batches = [BatchId(3, 4), BatchId(1, 9), BatchId(1, 2)]
    assert sorted(batches) == [BatchId(1, 2), BatchId(1, 9), BatchId(3, 4)]
    assert len({BatchId(1, 2), BatchId(1, 2), BatchId(1, 3)}) == 2
    assert list(BatchId(3, 5)) == [3, 4, 5]
    assert len(BatchId(3, 5)) == 3
    assert len(BatchId(7, 7)) == 1
    assert BatchId.from_interval(ClosedInterval(1, 2)).interval == ClosedInterval(1, 2)
    assert BatchId(1, 2) != ClosedInterval(1, 2)
    with pytest.raises(ValueError, match="has end < start"):
        len(BatchId(5, 4))
