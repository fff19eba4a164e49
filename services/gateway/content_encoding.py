"""Request bodies in a Content-Encoding, decoded by the gateway itself (aiohttp's own decoding is off, so an encoding
it cannot read is an OpenAI-shaped error here, not a plain-text page and a traceback from its parser). Pure."""
from __future__ import annotations

import zlib

from services.gateway.protocol import ApiError

ACCEPTED_ENCODINGS = "gzip, deflate, identity"  # the Accept-Encoding that a 415 names


def decode_body(raw: bytes, content_encoding: str | None, max_size_bytes: int) -> bytes:
    """raw with every coding of the Content-Encoding header undone (the last one listed first); ApiError 415 for
    one we do not read, 400 for data that is not what it claims, 413 when it inflates past max_size_bytes."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding not in ("gzip", "x-gzip", "deflate"):
            raise ApiError(415, f"Unsupported Content-Encoding {coding[:40]!r}: this server reads gzip, deflate and "
                                "identity request bodies.", code="unsupported_content_encoding",
                           headers={"Accept-Encoding": ACCEPTED_ENCODINGS})
        raw = _inflate(raw, coding, max_size_bytes)
    return raw


def _inflate(data: bytes, coding: str, max_size_bytes: int) -> bytes:
    """data inflated; gzip may hold several members, deflate is zlib-wrapped (RFC 9110) or, as some clients send
    it, raw (told apart by the zlib header: method 8, and a check that makes the first two bytes a multiple of 31)."""
    if coding != "deflate":
        return _inflate_members(data, 16 + zlib.MAX_WBITS, coding, max_size_bytes)
    is_zlib = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
    return _inflate_members(data, zlib.MAX_WBITS if is_zlib else -zlib.MAX_WBITS, coding, max_size_bytes)


def _inflate_members(data: bytes, wbits: int, coding: str, max_size_bytes: int) -> bytes:
    out = bytearray()
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(data, max_size_bytes + 1 - len(out))
        except zlib.error as exc:
            raise _not_encoded(coding, str(exc)) from None
        if len(out) > max_size_bytes or inflater.unconsumed_tail:
            raise ApiError(413, f"Request body too large: the limit is {max_size_bytes} bytes (decompressed).",
                           code="request_too_large")
        if not inflater.eof:
            raise _not_encoded(coding, "the data ends early")
        data = inflater.unused_data
        if not data or wbits != 16 + zlib.MAX_WBITS:
            if data:
                raise _not_encoded(coding, "data follows its end")
            return bytes(out)


def _not_encoded(coding: str, reason: str) -> ApiError:
    return ApiError(400, f"We could not read the body of your request as {coding}: {reason}.", code="invalid_body")
