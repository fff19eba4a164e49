"""OpenAI response bodies (whole and streamed) from GenerateChunks, and the per-request accumulator (pure).

Logprob tokens get their text and bytes from the chunks' token_pieces, which the tokenizer decodes. A model without
a tokenizer (random:<preset>) sends none: its tokens are then named `token_id:<id>` (vLLM's convention), with the
bytes of that name.
"""
from __future__ import annotations

import codecs
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import ApiError
from services.gateway.tool_calls import Content, Event, ToolCall, ToolCallParser, new_tool_call_id, parse_tool_calls
from services.gateway.tool_request import ToolPolicy
from shared.messages import GenerateChunk, TokenLogprobEntry, TokenPiece


@dataclass
class SampleOutput:
    """Everything one sample (choice) has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    pieces: dict[int, TokenPiece] = field(default_factory=dict)  # every token its logprobs name, by id
    logprobs: list[TokenLogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None  # with prompt logprobs (echo with logprobs, or prompt_logprobs)
    prompt_logprobs: list[TokenLogprobEntry | None] | None = None  # one per prompt token, None first


class RequestOutput:
    """Accumulates the GenerateChunks of one call's samples, for whole responses and usage: n samples of each of
    num_prompts prompts, sample i of prompt p at index p * n + i (a chunk's index is that global index)."""

    def __init__(self, n: int, num_prompts: int = 1) -> None:
        self.n = n
        self.samples = [SampleOutput() for _ in range(n * num_prompts)]
        self._num_prompt_tokens = [0] * num_prompts  # per prompt: every sample reports the same count
        self._num_cached_tokens = [0] * num_prompts
        self.echoes: list[str] = []  # with echo: each choice's prompt text, by choice index

    def echo(self, prompt: int, text: str) -> None:
        """Start each sample of prompt with text (echo); call for every prompt, in order, before any chunk."""
        for sample in self.samples[prompt * self.n:(prompt + 1) * self.n]:
            sample.text = text
            self.echoes.append(text)

    def add(self, chunk: GenerateChunk) -> bool:
        """Fold chunk in; False (and nothing changes) when its index is out of range or already finished."""
        if not 0 <= chunk.index < len(self.samples) or self.samples[chunk.index].finish_reason is not None:
            return False
        sample = self.samples[chunk.index]
        sample.text += chunk.text
        sample.token_ids.extend(chunk.token_ids)
        sample.pieces.update(_pieces(chunk))
        sample.logprobs.extend(chunk.logprobs or [])
        sample.finish_reason = chunk.finish_reason
        if chunk.prompt_logprobs is not None:
            sample.prompt_token_ids, sample.prompt_logprobs = chunk.prompt_token_ids, chunk.prompt_logprobs
        prompt = chunk.index // self.n
        self._num_prompt_tokens[prompt] = max(self._num_prompt_tokens[prompt], chunk.num_prompt_tokens)
        self._num_cached_tokens[prompt] = max(self._num_cached_tokens[prompt], chunk.num_cached_tokens)
        return True

    def is_prompt_finished(self, prompt: int) -> bool:
        return all(s.finish_reason is not None for s in self.samples[prompt * self.n:(prompt + 1) * self.n])

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self._num_prompt_tokens)

    @property
    def num_cached_tokens(self) -> int:
        return sum(self._num_cached_tokens)

    @property
    def is_finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    def usage(self) -> dict[str, Any]:
        return usage_body(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)


def usage_body(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def chat_response(request_id: str, model: str, created: int, output: RequestOutput, has_logprobs: bool,
                  tool_policy: ToolPolicy | None = None, tool_call_parser: str = "auto",
                  has_prompt_logprobs: bool = False) -> dict[str, Any]:
    """The whole chat answer; with a tool policy each choice's text is parsed into content and tool_calls.
    has_prompt_logprobs: vLLM's prompt_logprobs, in each choice and (as vLLM's chat puts it) beside the choices."""
    choices = []
    for i, s in enumerate(output.samples):
        message: dict[str, Any] = {"role": "assistant", "content": s.text, "refusal": None}
        finish_reason = s.finish_reason
        if tool_policy is not None:
            content, calls = parse_tool_calls(s.text, tool_policy.names, new_tool_call_id, tool_call_parser)
            _check_required(tool_policy, len(calls), i, s.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = [_tool_call_body(call) for call in calls]
                finish_reason = _tool_finish_reason(finish_reason)
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(s.logprobs, s.pieces) if has_logprobs else None,
                        "finish_reason": finish_reason})
        if has_prompt_logprobs:
            choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(s.prompt_token_ids, s.prompt_logprobs, s.pieces)
    body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": output.usage()}
    if has_prompt_logprobs:
        body["prompt_logprobs"] = choices[0]["prompt_logprobs"] if choices else None
    return body


class ToolCallStream:
    """A streamed chat call with tools: each choice's text goes through its own parser, and each GenerateChunk
    becomes the chunks OpenAI would stream for what it releases: content deltas, and per call a delta with its
    index, id, type and name, then one with its arguments."""

    def __init__(self, policy: ToolPolicy, num_choices: int, parser: str = "auto") -> None:
        self.policy = policy
        self.parsers = [ToolCallParser(policy.names, new_tool_call_id, parser) for _ in range(num_choices)]
        self._num_sent = [0] * num_choices  # calls streamed per choice: the next call's index

    def chat_chunks(self, request_id: str, model: str, created: int, chunk: GenerateChunk, has_logprobs: bool,
                    include_usage: bool, has_prompt_logprobs: bool = False) -> list[dict[str, Any]]:
        """The chunk bodies for chunk (none when it releases nothing and ends nothing)."""
        parser = self.parsers[chunk.index]
        events = parser.feed(chunk.text)
        finish_reason = chunk.finish_reason
        if finish_reason is not None:
            events += parser.finish()
            _check_required(self.policy, parser.num_calls, chunk.index, "")
            finish_reason = _tool_finish_reason(finish_reason) if parser.num_calls else finish_reason
        deltas = [delta for event in events for delta in self._deltas(chunk.index, event)]
        if not deltas and (finish_reason is not None or (has_logprobs and chunk.logprobs)
                           or (has_prompt_logprobs and chunk.prompt_logprobs)):
            deltas = [{}]
        bodies = []
        for i, delta in enumerate(deltas):
            is_first, is_last = i == 0, i == len(deltas) - 1
            logprobs = chat_logprobs(chunk.logprobs or [], _pieces(chunk)) if has_logprobs and is_first else None
            choice = {"index": chunk.index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason if is_last else None}
            _add_prompt_logprobs(choice, chunk, has_prompt_logprobs and is_first)
            bodies.append(_chunk(request_id, "chat.completion.chunk", model, created, choice, include_usage))
        return bodies

    def _deltas(self, index: int, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, Content):
            return [{"content": event.text}]
        call_index = self._num_sent[index]
        self._num_sent[index] += 1
        return [{"tool_calls": [{"index": call_index, "id": event.id, "type": "function",
                                 "function": {"name": event.name, "arguments": ""}}]},
                {"tool_calls": [{"index": call_index, "function": {"arguments": event.arguments}}]}]


def _tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_finish_reason(finish_reason: str | None) -> str | None:
    """A choice that made calls and stopped by itself finishes with "tool_calls"; one cut by length stays so."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _check_required(policy: ToolPolicy, num_calls: int, index: int, text: str) -> None:
    """tool_choice "required" or named: an output without a valid call is an error (the call grammar was cut short)."""
    if not policy.is_required or num_calls:
        return
    names = ", ".join(sorted(policy.names))
    shown = f" It began: {text[:200]!r}." if text else ""
    raise ApiError(422, f"tool_choice asked for a call to {names}, but the model's output (choice {index}) holds no "
                        "valid tool call: the grammar that enforces calls was cut short (max_tokens ran out, or the "
                        "worker does not support structured output); raise max_tokens, or use tool_choice "
                        f"'auto'.{shown}", type="server_error",
                   code="tool_call_not_generated")


def completion_response(request_id: str, model: str, created: int, output: RequestOutput, has_logprobs: bool,
                        has_prompt_logprobs: bool = False) -> dict[str, Any]:
    """The whole completions answer. With echo and logprobs, each choice's logprobs start with its prompt's tokens
    (the first with null logprob and top_logprobs, as OpenAI's legacy API and vLLM answer)."""
    choices = []
    for i, s in enumerate(output.samples):
        echo = output.echoes[i] if output.echoes else None
        choice = {"index": i, "text": s.text, "logprobs": sample_logprobs(s, echo) if has_logprobs else None,
                  "finish_reason": s.finish_reason}
        if has_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(s.prompt_token_ids, s.prompt_logprobs, s.pieces)
        choices.append(choice)
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": output.usage()}


def sample_logprobs(sample: SampleOutput, echo: str | None) -> dict[str, Any]:
    """A choice's legacy logprobs: its generated tokens', after its prompt's when it echoes the prompt (echo: that
    text; the generated tokens' text_offset starts at its end)."""
    generated = completion_logprobs(sample.logprobs, sample.pieces, len(echo) if echo is not None else 0)
    if echo is None:
        return generated
    prompt = prompt_completion_logprobs(sample.prompt_token_ids or [], sample.prompt_logprobs or [], sample.pieces)
    return {key: prompt[key] + generated[key] for key in generated}


def chat_role_chunk(request_id: str, model: str, created: int, index: int,
                    include_usage: bool) -> dict[str, Any]:
    """The first streamed chunk of a choice: the assistant role and empty content."""
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}
    return _chunk(request_id, "chat.completion.chunk", model, created, choice, include_usage)


def chat_chunk(request_id: str, model: str, created: int, chunk: GenerateChunk, has_logprobs: bool,
               include_usage: bool, has_prompt_logprobs: bool = False) -> dict[str, Any]:
    logprobs = chat_logprobs(chunk.logprobs or [], _pieces(chunk)) if has_logprobs else None
    choice = {"index": chunk.index, "delta": {"content": chunk.text} if chunk.text else {}, "logprobs": logprobs,
              "finish_reason": chunk.finish_reason}
    _add_prompt_logprobs(choice, chunk, has_prompt_logprobs)
    return _chunk(request_id, "chat.completion.chunk", model, created, choice, include_usage)


def _add_prompt_logprobs(choice: dict[str, Any], chunk: GenerateChunk, has_prompt_logprobs: bool) -> None:
    """A streamed choice's chunk that carries the prompt's logprobs (its first) shows them as vLLM does."""
    if has_prompt_logprobs and chunk.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(chunk.prompt_token_ids, chunk.prompt_logprobs,
                                                         _pieces(chunk))


def completion_chunk(request_id: str, model: str, created: int, chunk: GenerateChunk, has_logprobs: bool,
                     text_offset: int, include_usage: bool, has_prompt_logprobs: bool = False) -> dict[str, Any]:
    """A streamed text_completion; text_offset is the choice's text length before this chunk."""
    logprobs = (completion_logprobs(chunk.logprobs or [], _pieces(chunk), text_offset)
                if has_logprobs else None)
    choice = {"index": chunk.index, "text": chunk.text, "logprobs": logprobs, "finish_reason": chunk.finish_reason}
    _add_prompt_logprobs(choice, chunk, has_prompt_logprobs)
    return _chunk(request_id, "text_completion", model, created, choice, include_usage)


def echo_chunk(request_id: str, model: str, created: int, index: int, echo: str, first: GenerateChunk | None,
               include_usage: bool) -> dict[str, Any]:
    """A streamed choice's first event with echo: its prompt text, and with logprobs (first: the choice's first
    chunk, which carries the prompt's logprobs) the prompt tokens' logprobs."""
    logprobs = None
    if first is not None:
        logprobs = prompt_completion_logprobs(first.prompt_token_ids or [], first.prompt_logprobs or [],
                                              _pieces(first))
    choice = {"index": index, "text": echo, "logprobs": logprobs, "finish_reason": None}
    return _chunk(request_id, "text_completion", model, created, choice, include_usage)


def usage_chunk(request_id: str, object_: str, model: str, created: int, output: RequestOutput) -> dict[str, Any]:
    """The last streamed chunk when stream_options.include_usage: no choices, the whole request's usage."""
    return {"id": request_id, "object": object_, "created": created, "model": model, "choices": [],
            "usage": output.usage()}


def chat_logprobs(entries: list[TokenLogprobEntry], pieces: Mapping[int, TokenPiece]) -> dict[str, Any]:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    content = [{**_item(entry.token_id, entry.logprob, pieces),
                "top_logprobs": [_item(token_id, logprob, pieces) for token_id, logprob in entry.top]}
               for entry in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenLogprobEntry], pieces: Mapping[int, TokenPiece],
                        text_offset: int) -> dict[str, Any]:
    """Legacy completions logprobs: parallel lists tokens / token_logprobs / top_logprobs / text_offset.

    A token's text_offset counts the characters its earlier tokens complete, so the bytes of one character split
    over several tokens count once (a whole request's are exact; a stream's chunk starts at text_offset)."""
    return _legacy_logprobs([entry.token_id for entry in entries], entries, pieces, text_offset)


def prompt_completion_logprobs(token_ids: list[int], entries: list[TokenLogprobEntry | None],
                               pieces: Mapping[int, TokenPiece]) -> dict[str, Any]:
    """The legacy logprobs of an echoed prompt: every prompt token, the first with null logprob and top_logprobs."""
    return _legacy_logprobs(token_ids, entries, pieces, 0)


def _legacy_logprobs(token_ids: list[int], entries: list[TokenLogprobEntry | None],
                     pieces: Mapping[int, TokenPiece], text_offset: int) -> dict[str, Any]:
    chosen = [_piece(token_id, pieces) for token_id in token_ids]
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    offsets = []
    for piece in chosen:
        offsets.append(text_offset)
        text_offset += len(utf8.decode(piece.raw))
    return {"tokens": [piece.text for piece in chosen],
            "token_logprobs": [None if entry is None else entry.logprob for entry in entries],
            "top_logprobs": [None if entry is None else
                             {_piece(token_id, pieces).text: logprob for token_id, logprob in entry.top}
                             for entry in entries],
            "text_offset": offsets}


def vllm_prompt_logprobs(token_ids: list[int] | None, entries: list[TokenLogprobEntry | None] | None,
                         pieces: Mapping[int, TokenPiece]) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    holding the prompt token and then the top k (ranked 1..k)."""
    if token_ids is None or entries is None:
        return None
    shown: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            shown.append(None)
            continue
        ranked = {str(entry.token_id): _vllm_logprob(entry.logprob, entry.rank, entry.token_id, pieces)}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            ranked.setdefault(str(token_id), _vllm_logprob(logprob, rank, token_id, pieces))
        shown.append(ranked)
    return shown


def _vllm_logprob(logprob: float, rank: int | None, token_id: int, pieces: Mapping[int, TokenPiece]) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": _piece(token_id, pieces).text}


def _item(token_id: int, logprob: float, pieces: Mapping[int, TokenPiece]) -> dict[str, Any]:
    piece = _piece(token_id, pieces)
    return {"token": piece.text, "logprob": logprob, "bytes": list(piece.raw)}


def _piece(token_id: int, pieces: Mapping[int, TokenPiece]) -> TokenPiece:
    piece = pieces.get(token_id)
    if piece is None:
        name = f"token_id:{token_id}"
        return TokenPiece(token_id, name, name.encode())
    return piece


def _pieces(chunk: GenerateChunk) -> dict[int, TokenPiece]:
    """The chunk's token pieces by id; from an older tokenizer, its chosen tokens' texts (alternatives unnamed)."""
    if chunk.token_pieces is not None:
        return {piece.token_id: piece for piece in chunk.token_pieces}
    return {token_id: TokenPiece(token_id, text, text.encode())
            for token_id, text in zip(chunk.token_ids, chunk.token_texts or ())}


def _chunk(request_id: str, object_: str, model: str, created: int, choice: dict[str, Any],
           include_usage: bool) -> dict[str, Any]:
    body = {"id": request_id, "object": object_, "created": created, "model": model, "choices": [choice]}
    if include_usage:
        body["usage"] = None
    return body
