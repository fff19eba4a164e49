"""The gateway's request-body decoding: gzip, deflate (zlib or raw) and identity read; anything else an exact
OpenAI-shaped error (415 naming what is accepted, 400 for data that lies, 413 past the limit)."""
from __future__ import annotations

import gzip
import zlib

import pytest

from services.gateway.content_encoding import decode_body
from services.gateway.protocol import ApiError

BODY = b'{"model": "m", "prompt": "hello"}'


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize("data, header", [
    (BODY, None), (BODY, ""), (BODY, "identity"), (gzip.compress(BODY), "gzip"), (gzip.compress(BODY), "X-Gzip"),
    (zlib.compress(BODY), "deflate"), (_raw_deflate(BODY), "deflate"),
    (gzip.compress(BODY[:10]) + gzip.compress(BODY[10:]), "gzip"),  # two gzip members
    (gzip.compress(zlib.compress(BODY)), "deflate, gzip"),  # gzip applied last, so undone first
])
def test_decodes(data: bytes, header: str | None) -> None:
    assert decode_body(data, header, 1000) == BODY


@pytest.mark.parametrize("header", ["br", "zstd", "gzip, br", "x-bogus"])
def test_unsupported_encoding_is_415_naming_the_accepted_ones(header: str) -> None:
    with pytest.raises(ApiError) as info:
        decode_body(BODY, header, 1000)
    assert (info.value.status, info.value.code, info.value.headers) == (
        415, "unsupported_content_encoding", {"Accept-Encoding": "gzip, deflate, identity"})
    assert info.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("data, header, fragment", [
    (BODY, "gzip", "incorrect header check"), (gzip.compress(BODY)[:-12], "gzip", "the data ends early"),
    (zlib.compress(BODY) + b"junk", "deflate", "data follows its end"), (b"", "deflate", "the data ends early"),
])
def test_data_that_is_not_what_it_claims_is_400(data: bytes, header: str, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        decode_body(data, header, 1000)
    assert (info.value.status, info.value.code) == (400, "invalid_body")
    assert fragment in info.value.message


def test_a_body_that_inflates_past_the_limit_is_413() -> None:
    bomb = gzip.compress(b"0" * 100_000)
    assert len(bomb) < 1000
    with pytest.raises(ApiError) as info:
        decode_body(bomb, "gzip", 1000)
    assert (info.value.status, info.value.code) == (413, "request_too_large")
    assert decode_body(gzip.compress(b"0" * 1000), "gzip", 1000) == b"0" * 1000
