"""Logprob bodies from the tokenizer's token pieces: alternatives by text and bytes, chat and completions."""
from __future__ import annotations

from services.gateway.responses import (RequestOutput, ToolCallStream, chat_chunk, chat_response, completion_chunk,
                                        completion_response)
from services.gateway.tool_request import ToolPolicy
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


# prompt " Yes" "No" 😀 (ids 20, 21, 10, 11), each token after the first with its logprob, rank and top 1
PROMPT = [20, 21, 10, 11]
PROMPT_ENTRIES = [None, TokenLogprobEntry(21, -3.0, [(20, -0.1)], rank=4), TokenLogprobEntry(10, -0.2, [(10, -0.2)]),
                  TokenLogprobEntry(11, -0.01, [(11, -0.01)], rank=1)]


def prompt_chunk() -> GenerateChunk:
    return GenerateChunk("r1", 0, "No", [21], logprobs=[TokenLogprobEntry(21, -0.7, [(21, -0.7)])],
                         finish_reason="length", num_prompt_tokens=4, token_pieces=PIECES,
                         prompt_logprobs=PROMPT_ENTRIES, prompt_token_ids=PROMPT)


def test_echo_logprobs_start_with_the_prompts_tokens() -> None:
    output = RequestOutput(1)
    output.echo(0, " YesNo😀")
    assert output.add(prompt_chunk())
    logprobs = completion_response("r1", MODEL, 1, output, has_logprobs=True)["choices"][0]["logprobs"]
    assert logprobs == {"tokens": [" Yes", "No", "bytes:\\xf0\\x9f", "bytes:\\x98\\x80", "No"],
                        "token_logprobs": [None, -3.0, -0.2, -0.01, -0.7],
                        "top_logprobs": [None, {" Yes": -0.1}, {"bytes:\\xf0\\x9f": -0.2},
                                         {"bytes:\\x98\\x80": -0.01}, {"No": -0.7}],
                        "text_offset": [0, 4, 6, 6, 7]}  # 😀's two tokens are one character; then the 7-long echo


def test_vllm_prompt_logprobs_hold_the_prompt_token_then_the_top_k() -> None:
    output = RequestOutput(1)
    assert output.add(prompt_chunk())
    choice = completion_response("r1", MODEL, 1, output, has_logprobs=False, has_prompt_logprobs=True)["choices"][0]
    assert choice["logprobs"] is None
    assert choice["prompt_logprobs"] == [
        None, {"21": {"logprob": -3.0, "rank": 4, "decoded_token": "No"},
               "20": {"logprob": -0.1, "rank": 1, "decoded_token": " Yes"}},
        {"10": {"logprob": -0.2, "rank": None, "decoded_token": "bytes:\\xf0\\x9f"}},
        {"11": {"logprob": -0.01, "rank": 1, "decoded_token": "bytes:\\x98\\x80"}}]
    chat = chat_response("r1", MODEL, 1, output, has_logprobs=False, has_prompt_logprobs=True)
    assert chat["prompt_logprobs"] == chat["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
    streamed = completion_chunk("r1", MODEL, 1, prompt_chunk(), False, 0, False, has_prompt_logprobs=True)
    assert streamed["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
    assert "prompt_logprobs" not in completion_response("r1", MODEL, 1, output, has_logprobs=False)["choices"][0]


def test_streamed_chat_shows_the_prompt_logprobs_once_with_or_without_tools() -> None:
    plain = chat_chunk("r1", MODEL, 1, prompt_chunk(), False, False, has_prompt_logprobs=True)
    tools = ToolCallStream(ToolPolicy(frozenset({"f"}), False), 1)
    [with_tools] = tools.chat_chunks("r1", MODEL, 1, prompt_chunk(), False, False, has_prompt_logprobs=True)
    assert plain["choices"][0]["prompt_logprobs"] == with_tools["choices"][0]["prompt_logprobs"]
    assert with_tools["choices"][0]["prompt_logprobs"][1]["21"]["rank"] == 4
    later = GenerateChunk("r1", 0, "x", [21], finish_reason="stop")
    assert "prompt_logprobs" not in chat_chunk("r1", MODEL, 1, later, False, False, True)["choices"][0]
