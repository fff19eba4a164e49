"""Token pieces (each token's own bytes and its OpenAI text) with the real bundled tokenizer."""
from __future__ import annotations

import pytest

from services.tokenizer.model_files import load_tokenizer
from services.tokenizer.token_pieces import TokenPieces, byte_level_alphabet, piece_text
from shared.messages import TokenPiece

EMOJI_TEXT = "héllo 😀🎉 世界 ∑ done"
EMOJI_IDS = [88, 2756, 31394, 40303, 218, 10813, 232, 227, 216, 7906, 240, 178, 239, 230, 19995, 235, 2294]
IM_END = 2


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("bundled")


@pytest.fixture(scope="module")
def pieces(tok) -> TokenPieces:
    return TokenPieces(tok)


def test_piece_text_is_utf8_or_escaped_bytes() -> None:
    assert piece_text(b" Paris") == " Paris"
    assert piece_text("é".encode()) == "é"
    assert piece_text(b"\xf0\x9f") == "bytes:\\xf0\\x9f"
    assert piece_text(b" \xe4") == "bytes: \\xe4"


def test_byte_level_alphabet_covers_every_byte_once() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert (alphabet["Ġ"], alphabet["A"], alphabet["Ā"], alphabet["Ä"]) == (32, 65, 0, 0xC4)


def test_known_tokens(pieces: TokenPieces) -> None:
    assert pieces.piece(19556) == TokenPiece(19556, "Hello", b"Hello")
    assert pieces.piece(905) == TokenPiece(905, " world", b" world")
    assert pieces.piece(IM_END) == TokenPiece(IM_END, "<|im_end|>", b"<|im_end|>")
    assert pieces.piece(218) == TokenPiece(218, "bytes:\\x80", b"\x80")


def test_split_characters_join_to_the_text(pieces: TokenPieces) -> None:
    assert b"".join(pieces.piece(i).raw for i in EMOJI_IDS).decode() == EMOJI_TEXT
    assert [p.token_id for p in pieces.pieces([88, 218, 88, 2, 218])] == [88, 218, 2]


def test_every_token_agrees_with_decode(tok, pieces: TokenPieces) -> None:
    num_partial = 0
    for token_id in range(len(tok)):
        piece, decoded = pieces.piece(token_id), tok.decode([token_id], skip_special_tokens=False)
        if piece.text.startswith("bytes:"):
            num_partial += 1
            assert "\ufffd" in decoded and piece.raw.decode("utf-8", "replace") == decoded, token_id
        else:
            assert (piece.text, piece.raw) == (decoded, decoded.encode()), token_id
    assert num_partial > 100  # the byte tokens that are no character on their own


def test_hidden_tokens_are_the_ones_decoded_text_skips(pieces: TokenPieces) -> None:
    assert [pieces.is_hidden(i) for i in (0, 1, IM_END)] == [True, True, True]
    assert [pieces.is_hidden(i) for i in (19556, 218)] == [False, False]
