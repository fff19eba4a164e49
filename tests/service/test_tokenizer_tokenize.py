"""The tokenizer process (bundled tokenizer) answering TokenizeRequest and DetokenizeRequest, the messages behind
the gateway's /tokenize and /detokenize: chat messages tokenize to exactly the ids a generation of them runs."""
from __future__ import annotations

import pytest

from services.tokenizer.model_files import load_tokenizer
from shared.messages import (DetokenizeReply, DetokenizeRequest, GenerateError, TokenizeReply,
                             TokenizeRequest, encode)
from tests.service.test_tokenizer_service import EMOJI_IDS, MESSAGES, Peers, peers

__all__ = ["peers"]  # test_tokenizer_service's fixture: a tokenizer process of this module's own

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("bundled")


def _ask(peers: Peers, msg: TokenizeRequest | DetokenizeRequest) -> TokenizeReply | DetokenizeReply | GenerateError:
    peers.gateway.sock.send(encode(msg))
    return peers.gateway.take(lambda m: m.request_id == msg.request_id)


def test_text_with_and_without_special_tokens(peers: Peers, tok) -> None:
    text = "The capital of France is"
    reply = _ask(peers, TokenizeRequest("t1", prompt_text=text))
    assert isinstance(reply, TokenizeReply)
    assert reply.token_ids == tok.encode(text) == [504, 3575, 282, 4649, 314]
    assert reply.max_model_len > len(reply.token_ids)
    plain = _ask(peers, TokenizeRequest("t2", prompt_text="<|im_start|>x", add_special_tokens=False))
    assert plain.token_ids == tok.encode("<|im_start|>x", add_special_tokens=False)
    assert _ask(peers, TokenizeRequest("t3", prompt_text="")).token_ids == []


def test_chat_messages_tokenize_as_a_generation_runs_them(peers: Peers) -> None:
    reply = _ask(peers, TokenizeRequest("t4", messages=MESSAGES, add_special_tokens=False))
    peers.generate("gen-4", messages=MESSAGES)
    assert reply.token_ids == peers.tokenized("gen-4").prompt_token_ids


def test_detokenize_keeps_special_tokens(peers: Peers, tok) -> None:
    ids = [1, *tok.encode("Hi 😀"), 2]
    reply = _ask(peers, DetokenizeRequest("d1", ids))
    assert reply == DetokenizeReply("d1", "<|im_start|>Hi 😀<|im_end|>")
    assert _ask(peers, DetokenizeRequest("d2", EMOJI_IDS)).text == tok.decode(EMOJI_IDS)


@pytest.mark.parametrize("msg, fragment", [
    (DetokenizeRequest("e1", [5, 10**9]), "token id 1000000000 is outside the vocabulary"),
    (TokenizeRequest("e2"), "one of prompt_text and messages must be set"),
])
def test_bad_input_is_a_400_for_its_gateway(peers: Peers, msg, fragment: str) -> None:
    reply = _ask(peers, msg)
    assert isinstance(reply, GenerateError)
    assert (reply.status, reply.code) == (400, "invalid_request_error")
    assert fragment in reply.message
