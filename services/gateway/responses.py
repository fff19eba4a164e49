"""OpenAI response bodies (whole and streamed) from GenerateChunks, and the per-request accumulator (pure)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.messages import GenerateChunk, TokenLogprobEntry


@dataclass
class SampleOutput:
    """Everything one sample (choice) has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None


class RequestOutput:
    """Accumulates the GenerateChunks of one request's n samples, for whole responses and usage."""

    def __init__(self, n: int) -> None:
        self.samples = [SampleOutput() for _ in range(n)]
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    def add(self, chunk: GenerateChunk) -> bool:
        """Fold chunk in; False (and nothing changes) when its index is out of range or already finished."""
        if not 0 <= chunk.index < len(self.samples) or self.samples[chunk.index].finish_reason is not None:
            return False
        sample = self.samples[chunk.index]
        sample.text += chunk.text
        sample.token_ids.extend(chunk.token_ids)
        sample.token_texts.extend(_token_texts(chunk))
        sample.logprobs.extend(chunk.logprobs or [])
        sample.finish_reason = chunk.finish_reason
        self.num_prompt_tokens = max(self.num_prompt_tokens, chunk.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        return True

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


def chat_response(request_id: str, model: str, created: int, output: RequestOutput,
                  has_logprobs: bool) -> dict[str, Any]:
    choices = [{"index": i, "message": {"role": "assistant", "content": s.text, "refusal": None},
                "logprobs": chat_logprobs(s.logprobs, s.token_texts) if has_logprobs else None,
                "finish_reason": s.finish_reason} for i, s in enumerate(output.samples)]
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": output.usage()}


def completion_response(request_id: str, model: str, created: int, output: RequestOutput,
                        has_logprobs: bool) -> dict[str, Any]:
    choices = [{"index": i, "text": s.text,
                "logprobs": completion_logprobs(s.logprobs, s.token_texts, 0) if has_logprobs else None,
                "finish_reason": s.finish_reason} for i, s in enumerate(output.samples)]
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": output.usage()}


def chat_role_chunk(request_id: str, model: str, created: int, index: int,
                    include_usage: bool) -> dict[str, Any]:
    """The first streamed chunk of a choice: the assistant role and empty content."""
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}
    return _chunk(request_id, "chat.completion.chunk", model, created, choice, include_usage)


def chat_chunk(request_id: str, model: str, created: int, chunk: GenerateChunk, has_logprobs: bool,
               include_usage: bool) -> dict[str, Any]:
    logprobs = chat_logprobs(chunk.logprobs or [], _token_texts(chunk)) if has_logprobs else None
    choice = {"index": chunk.index, "delta": {"content": chunk.text} if chunk.text else {}, "logprobs": logprobs,
              "finish_reason": chunk.finish_reason}
    return _chunk(request_id, "chat.completion.chunk", model, created, choice, include_usage)


def completion_chunk(request_id: str, model: str, created: int, chunk: GenerateChunk, has_logprobs: bool,
                     text_offset: int, include_usage: bool) -> dict[str, Any]:
    """A streamed text_completion; text_offset is the choice's text length before this chunk."""
    logprobs = (completion_logprobs(chunk.logprobs or [], _token_texts(chunk), text_offset)
                if has_logprobs else None)
    choice = {"index": chunk.index, "text": chunk.text, "logprobs": logprobs, "finish_reason": chunk.finish_reason}
    return _chunk(request_id, "text_completion", model, created, choice, include_usage)


def usage_chunk(request_id: str, object_: str, model: str, created: int, output: RequestOutput) -> dict[str, Any]:
    """The last streamed chunk when stream_options.include_usage: no choices, the whole request's usage."""
    return {"id": request_id, "object": object_, "created": created, "model": model, "choices": [],
            "usage": output.usage()}


def chat_logprobs(entries: list[TokenLogprobEntry], texts: list[str]) -> dict[str, Any]:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    content = []
    for entry, text in zip(entries, texts):
        top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in _top(entry, text)]
        content.append({"token": text, "logprob": entry.logprob, "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenLogprobEntry], texts: list[str], text_offset: int) -> dict[str, Any]:
    """Legacy completions logprobs: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    offsets = []
    for text in texts[:len(entries)]:
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": texts[:len(entries)], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(_top(e, t)) for e, t in zip(entries, texts)], "text_offset": offsets}


def _top(entry: TokenLogprobEntry, text: str) -> list[tuple[str, float]]:
    """Top alternatives as (text, logprob). NOTE: the wire carries no text for alternatives other than the
    chosen token, so those are named `token_id:<id>` (vLLM's convention)."""
    return [(text if token_id == entry.token_id else f"token_id:{token_id}", lp) for token_id, lp in entry.top]


def _token_texts(chunk: GenerateChunk) -> list[str]:
    if chunk.token_texts is not None:
        return list(chunk.token_texts)
    return [f"token_id:{t}" for t in chunk.token_ids]


def _chunk(request_id: str, object_: str, model: str, created: int, choice: dict[str, Any],
           include_usage: bool) -> dict[str, Any]:
    body = {"id": request_id, "object": object_, "created": created, "model": model, "choices": [choice]}
    if include_usage:
        body["usage"] = None
    return body
