"""Each vocabulary token's own bytes and its text as OpenAI's logprobs show it, and which tokens the output text
leaves out (pure: the tokenizer is passed in; results are cached per token id)."""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

from shared.messages import TokenPiece

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens
METASPACE = "\u2581"  # SentencePiece's space


def piece_text(raw: bytes) -> str:
    """A token's text: its bytes as UTF-8, or, when they are not valid UTF-8 on their own (part of a character),
    "bytes:" and the bytes with each invalid one written \\xNN, as OpenAI writes them."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + raw.decode("utf-8", "backslashreplace")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (bytes_to_unicode), character → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]
    return dict(zip(chars, printable + others))


class TokenPieces:
    """Token id → TokenPiece (text and raw bytes), for byte-level BPE, SentencePiece and added tokens alike.

    NOTE: raw is the token's own bytes, so an emoji split over four byte tokens gives four one-byte pieces whose
    joined bytes are the emoji; decode([id]) would give U+FFFD for each.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._added = {token_id: str(token) for token_id, token in tokenizer.added_tokens_decoder.items()}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._is_byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        self._pieces: dict[int, TokenPiece] = {}
        self._is_hidden: dict[int, bool] = {}

    def piece(self, token_id: int) -> TokenPiece:
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self._raw(token_id)
            piece = self._pieces[token_id] = TokenPiece(token_id, piece_text(raw), raw)
        return piece

    def pieces(self, token_ids: Iterable[int]) -> list[TokenPiece]:
        """The piece of each distinct id, in first-seen order."""
        return [self.piece(token_id) for token_id in dict.fromkeys(token_ids)]

    def is_hidden(self, token_id: int) -> bool:
        """Whether text decoded with skip_special_tokens leaves the token out (an end-of-turn token, say)."""
        hidden = self._is_hidden.get(token_id)
        if hidden is None:
            decode = self._tokenizer.decode
            hidden = self._is_hidden[token_id] = (decode([token_id], skip_special_tokens=True) == ""
                                                  and decode([token_id], skip_special_tokens=False) != "")
        return hidden

    def _raw(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        alphabet = byte_level_alphabet()
        if not isinstance(token, str):
            return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        if match := BYTE_FALLBACK.fullmatch(token):
            return bytes([int(match[1], 16)])
        if self._is_byte_level and all(c in alphabet for c in token):
            return bytes(alphabet[c] for c in token)
        if METASPACE in token:
            return token.replace(METASPACE, " ").encode()
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
