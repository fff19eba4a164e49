"""radixserve bench SSE parsing: framing across splits, usage chunks, empty deltas, errors, [DONE]."""
from __future__ import annotations

from radixserve.bench.sse import EventKind, SseParser, interpret, usage_counts


def _feed_all(parser: SseParser, pieces: list[bytes]) -> list[str]:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.close()


def test_events_split_at_every_byte():
    stream = 'data: {"a": 1}\n\ndata: {"b": "é"}\n\ndata: [DONE]\n\n'.encode()
    assert _feed_all(SseParser(), [stream[i:i + 1] for i in range(len(stream))]) == \
        ['{"a": 1}', '{"b": "é"}', "[DONE]"]


def test_crlf_cr_comments_fields_and_multiline_data():
    stream = b": keep-alive\r\n\r\nevent: message\r\nid: 3\r\ndata: first\r\ndata:second\r\n\r\ndata: x\r\rdata: y\n\n"
    assert _feed_all(SseParser(), [stream]) == ["first\nsecond", "x", "y"]


def test_crlf_split_between_cr_and_lf():
    parser = SseParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n\r") == []
    assert parser.feed(b"\n") == ["a"]


def test_last_event_without_blank_line_comes_from_close():
    parser = SseParser()
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == ["[DONE]"]


def test_interpret_completion_and_chat_chunks():
    event = interpret('{"choices": [{"index": 0, "text": "Hi", "finish_reason": null}], "usage": null}')
    assert (event.kind, event.text, event.usage) == (EventKind.CONTENT, "Hi", None)
    event = interpret('{"choices": [{"index": 0, "delta": {"content": "yo"}, "finish_reason": "length"}]}')
    assert (event.kind, event.text, event.finish_reason) == (EventKind.CONTENT, "yo", "length")


def test_interpret_empty_deltas_role_chunk_and_null_content():
    for payload in ('{"choices": [{"index": 0, "delta": {}}]}',
                    '{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}',
                    '{"choices": [{"index": 0, "delta": {"content": null}}]}',
                    '{"choices": [{"index": 0, "text": ""}]}'):
        event = interpret(payload)
        assert (event.kind, event.text) == (EventKind.CONTENT, "")


def test_interpret_usage_chunk_with_empty_choices():
    event = interpret('{"id": "x", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, '
                      '"total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 8}}}')
    assert event.kind is EventKind.USAGE
    assert usage_counts(event.usage) == (9, 4, 8)
    assert usage_counts({"prompt_tokens": 9, "completion_tokens": 4, "prompt_tokens_details": None}) == (9, 4, None)
    assert interpret('{"choices": [], "usage": null}').kind is EventKind.OTHER


def test_interpret_errors_and_done():
    event = interpret('{"error": {"message": "Too many requests", "type": "rate_limit_error", "code": 429}}')
    assert (event.kind, event.error) == (EventKind.ERROR, "Too many requests")
    assert interpret('{"error": "plain"}').error == "plain"
    assert interpret("[DONE]").kind is EventKind.DONE
    assert interpret("not json").kind is EventKind.ERROR
    assert interpret("[1, 2]").kind is EventKind.ERROR
