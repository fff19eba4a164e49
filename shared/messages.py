"""Wire types exchanged between services, as tagged msgspec Structs, and their msgpack codec."""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec

PROTOCOL_VERSION = 1

T = TypeVar("T")


class BlocksStored(msgspec.Struct, frozen=True, tag=True):
    """worker → cache_index: these consecutive full pages, chained after parent_hash, entered its radix cache.

    block_hashes[i] covers token_ids[i * page_size:(i + 1) * page_size]; parent_hash is None at the root.
    """

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    page_size: int
    version: int = PROTOCOL_VERSION


class BlocksRemoved(msgspec.Struct, frozen=True, tag=True):
    """worker → cache_index: these pages left the worker's radix cache (evicted)."""

    block_hashes: list[int]
    version: int = PROTOCOL_VERSION


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True):
    """worker → cache_index: the worker's radix cache was emptied; forget everything it held."""

    version: int = PROTOCOL_VERSION


KVEvent = BlocksStored | BlocksRemoved | AllBlocksCleared

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(msg: msgspec.Struct) -> bytes:
    """Serialize one wire message to msgpack bytes."""
    return _encoder.encode(msg)


def decode(data: bytes, type_: type[T] | Any) -> T:
    """Deserialize msgpack bytes as type_ (a Struct or a union); bad input raises msgspec.DecodeError."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders.setdefault(type_, msgspec.msgpack.Decoder(type_))
    return decoder.decode(data)
