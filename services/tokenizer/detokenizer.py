"""Per-sample detokenizer state: incremental decoding that never emits broken UTF-8, and stop strings."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
NUM_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, for tokenizers that strip a leading space


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Decodes one token at a time over a sliding window, as vLLM and TGI do.

    tokens:  [ ...... | prefix_offset ...... | read_offset ...... new ]
    The text of tokens[prefix_offset:read_offset] was already emitted; each new token re-decodes
    tokens[prefix_offset:] and emits what lies past that text, unless it ends in U+FFFD (an incomplete
    UTF-8 sequence split across tokens): then the token waits for the next one.
    """

    def __init__(self, decoder: Decoder, skip_special_tokens: bool = True,
                 context_ids: Sequence[int] = ()) -> None:
        self._decoder = decoder
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(context_ids[-NUM_CONTEXT_TOKENS:]) if context_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._decoder.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one token; return the new text it completes ('' while a character is still partial)."""
        self._token_ids.append(token_id)
        return self._advance(is_final=False)

    def flush(self) -> str:
        """Emit whatever is pending, U+FFFD included (the output ended inside a character)."""
        return self._advance(is_final=True)

    def _advance(self, is_final: bool) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        new_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not is_final):
            return ""
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        return delta


class StopStringMatcher:
    """Finds stop strings in the accumulated output; holds back a tail that could begin one.

    feed() returns the text that is safe to emit now. After a hit, the output ends just before the
    stop string, and nothing more is emitted.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self.text = ""
        self._num_emitted = 0
        self.is_stopped = False

    def feed(self, delta: str) -> str:
        if self.is_stopped or not delta:
            return ""
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        hit = self._find_stop(search_from)
        if hit is not None:
            self.is_stopped = True
            self.text = self.text[:hit]
            return self._emit_upto(hit)
        return self._emit_upto(len(self.text) - self._num_held_back())

    def flush(self) -> str:
        """The held-back tail, once the output is known to end here."""
        return "" if self.is_stopped else self._emit_upto(len(self.text))

    def _emit_upto(self, end: int) -> str:
        out = self.text[self._num_emitted:end] if end > self._num_emitted else ""
        self._num_emitted = max(self._num_emitted, end)
        return out

    def _find_stop(self, search_from: int) -> int | None:
        hits = [i for i in (self.text.find(s, search_from) for s in self._stops) if i >= 0]
        return min(hits, default=None)

    def _num_held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        longest = min(self._max_stop_len - 1, len(self.text))
        for size in range(longest, 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0


@dataclass(frozen=True)
class SampleStep:
    """What one batch of tokens of a sample produced: text to emit, tokens consumed, whether it stopped."""

    text: str
    num_tokens: int
    is_stopped: bool


class SampleDetokenizer:
    """One sample's output: incremental text plus stop strings; finished after a stop or the final step."""

    def __init__(self, decoder: Decoder | None, stops: Sequence[str] = (), skip_special_tokens: bool = True,
                 context_ids: Sequence[int] = ()) -> None:
        self._detok = (IncrementalDetokenizer(decoder, skip_special_tokens, context_ids)
                       if decoder is not None else None)
        self._matcher = StopStringMatcher(stops)
        self.num_tokens = 0
        self.is_finished = False

    @property
    def is_stopped(self) -> bool:
        """True when a stop string ended this sample."""
        return self._matcher.is_stopped

    @property
    def text(self) -> str:
        """All output text so far (trimmed at the stop string after a hit; held-back tail included)."""
        return self._matcher.text

    def step(self, token_ids: Sequence[int], is_final: bool) -> SampleStep:
        """Consume token_ids (up to the one that completes a stop string); is_final ends the sample."""
        if self.is_finished:
            return SampleStep("", 0, False)
        pieces: list[str] = []
        num_used = 0
        for token_id in token_ids:
            num_used += 1
            pieces.append(self._matcher.feed(self._detok.add_token(token_id) if self._detok else ""))
            if self._matcher.is_stopped:
                break
        if is_final and not self._matcher.is_stopped:
            pieces.append(self._matcher.feed(self._detok.flush() if self._detok else ""))
            pieces.append(self._matcher.flush())
        self.num_tokens += num_used
        self.is_finished = is_final or self._matcher.is_stopped
        return SampleStep("".join(pieces), num_used, self._matcher.is_stopped)
