"""KV event wire types: msgpack round-trips, union decoding by tag, garbage rejected."""
from __future__ import annotations

import msgspec
import pytest

from shared.messages import (PROTOCOL_VERSION, AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent,
                             decode, encode)

EXAMPLES = [
    BlocksStored([2**64 - 1, 0, 12345], None, list(range(12)), 4),
    BlocksStored([7], 2**63 + 5, [4294967295, 1, 2, 3], 4),
    BlocksRemoved([1, 2**64 - 1]),
    BlocksRemoved([]),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_by_type(msg: msgspec.Struct) -> None:
    assert decode(encode(msg), type(msg)) == msg


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_decodes_from_union(msg: msgspec.Struct) -> None:
    decoded = decode(encode(msg), KVEvent)
    assert type(decoded) is type(msg)
    assert decoded == msg
    assert decoded.version == PROTOCOL_VERSION


def test_structs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        BlocksRemoved([1]).block_hashes = [2]  # type: ignore[misc]


@pytest.mark.parametrize("data", [b"", b"\xff\x00garbage", b"\xc1", encode({"type": "Nope"}),
                                  encode({"block_hashes": [1]}), encode([1, 2, 3])])
def test_garbage_raises_decode_error(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode(data, KVEvent)


def test_wrong_field_type_raises_decode_error() -> None:
    data = encode({"type": "BlocksRemoved", "block_hashes": ["x"]})
    with pytest.raises(msgspec.DecodeError):
        decode(data, KVEvent)
