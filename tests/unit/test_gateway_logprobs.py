"""Logprob bodies from the tokenizer's token pieces: alternatives by text and bytes, chat and completions."""
from __future__ import annotations

from services.gateway.responses import (RequestOutput, chat_chunk, chat_response, completion_chunk,
                                        completion_response)
from shared.messages import GenerateChunk, TokenLogprobEntry, TokenPiece

MODEL = "m"
# 😀 is f0 9f 98 80, split over two byte tokens here; " Yes" and "No" are alternatives.
PIECES = [TokenPiece(10, "bytes:\\xf0\\x9f", b"\xf0\x9f"), TokenPiece(11, "bytes:\\x98\\x80", b"\x98\x80"),
          TokenPiece(20, " Yes", b" Yes"), TokenPiece(21, "No", b"No")]
ENTRIES = [TokenLogprobEntry(10, -0.5, [(10, -0.5), (20, -1.5)]),
           TokenLogprobEntry(11, -0.25, [(11, -0.25), (21, -2.0)])]


def chunk(text: str, ids: list[int], entries: list[TokenLogprobEntry], pieces: list[TokenPiece] | None,
          finish: str | None = "stop") -> GenerateChunk:
    texts = [p.text for i in ids for p in PIECES if p.token_id == i]
    return GenerateChunk("r1", 0, text, ids, logprobs=entries, token_texts=texts, finish_reason=finish,
                         num_prompt_tokens=3, token_pieces=pieces)


def test_chat_alternatives_have_text_and_bytes() -> None:
    output = RequestOutput(1)
    assert output.add(chunk("😀", [10, 11], ENTRIES, PIECES))
    content = chat_response("r1", MODEL, 1, output, has_logprobs=True)["choices"][0]["logprobs"]["content"]
    assert content == [
        {"token": "bytes:\\xf0\\x9f", "logprob": -0.5, "bytes": [0xF0, 0x9F],
         "top_logprobs": [{"token": "bytes:\\xf0\\x9f", "logprob": -0.5, "bytes": [0xF0, 0x9F]},
                          {"token": " Yes", "logprob": -1.5, "bytes": list(b" Yes")}]},
        {"token": "bytes:\\x98\\x80", "logprob": -0.25, "bytes": [0x98, 0x80],
         "top_logprobs": [{"token": "bytes:\\x98\\x80", "logprob": -0.25, "bytes": [0x98, 0x80]},
                          {"token": "No", "logprob": -2.0, "bytes": list(b"No")}]}]
    assert bytes(b for item in content for b in item["bytes"]).decode() == "😀"


def test_chat_stream_chunk_reads_its_own_pieces() -> None:
    body = chat_chunk("r1", MODEL, 1, chunk("", [10], ENTRIES[:1], PIECES[:1] + PIECES[2:3], None),
                      has_logprobs=True, include_usage=False)
    [item] = body["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["bytes"]) for t in item["top_logprobs"]] == [("bytes:\\xf0\\x9f", [0xF0, 0x9F]),
                                                                      (" Yes", list(b" Yes"))]


def test_completion_alternatives_and_offsets_count_characters() -> None:
    output = RequestOutput(1)
    output.add(chunk("😀", [10, 11], ENTRIES, PIECES))
    logprobs = completion_response("r1", MODEL, 1, output, has_logprobs=True)["choices"][0]["logprobs"]
    assert logprobs == {"tokens": ["bytes:\\xf0\\x9f", "bytes:\\x98\\x80"], "token_logprobs": [-0.5, -0.25],
                        "top_logprobs": [{"bytes:\\xf0\\x9f": -0.5, " Yes": -1.5},
                                         {"bytes:\\x98\\x80": -0.25, "No": -2.0}],
                        "text_offset": [0, 0]}
    streamed = completion_chunk("r1", MODEL, 1, chunk("x", [20, 21], [TokenLogprobEntry(20, -1.0),
                                                                      TokenLogprobEntry(21, -1.0)], PIECES),
                                has_logprobs=True, text_offset=7, include_usage=False)
    assert streamed["choices"][0]["logprobs"]["text_offset"] == [7, 11]


def test_without_pieces_tokens_are_named_by_id() -> None:
    """A model without a tokenizer (random:<preset>), or an older tokenizer for the alternatives."""
    output = RequestOutput(1)
    output.add(GenerateChunk("r1", 0, "", [10], logprobs=ENTRIES[:1], finish_reason="length"))
    [item] = chat_response("r1", MODEL, 1, output, has_logprobs=True)["choices"][0]["logprobs"]["content"]
    assert (item["token"], item["bytes"]) == ("token_id:10", list(b"token_id:10"))
    assert [t["token"] for t in item["top_logprobs"]] == ["token_id:10", "token_id:20"]
    older = RequestOutput(1)
    older.add(chunk("", [10], ENTRIES[:1], None))
    [item] = chat_response("r1", MODEL, 1, older, has_logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in item["top_logprobs"]] == ["bytes:\\xf0\\x9f", "token_id:20"]
