"""The model's output text → content and tool calls, whole or streamed (pure: no I/O).

Formats (`--tool-call-parser`):
- `hermes` (Hermes, Qwen 2.5/3, and our fallback system prompt): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, any number of them, with text around them;
- `llama3_json` (Llama 3.1/3.2/3.3): an output that is one JSON object `{"name": ..., "parameters": {...}}`, or
  several separated by `;`, optionally after `<|python_tag|>`;
- `mistral` (Mistral 7B v0.3, Mixtral, Mistral Nemo…): `[TOOL_CALLS]` then a JSON array of
  `{"name": ..., "arguments": {...}}` objects, after any text; newer tokenizers' `[TOOL_CALLS]name[ARGS]{...}` (one
  marker a call) is read too. `[TOOL_CALLS]` is a special token that the default skip_special_tokens decodes to
  nothing, so an output that starts with a JSON array of objects (`[{`) is read as that array;
- `auto` (the default): all three; an output whose first non-blank character is `{` is read as Llama JSON, one that
  starts with `[{` as Mistral's array, and `<tool_call>` and `[TOOL_CALLS]` are looked for anywhere else.

A call counts only when its JSON is an object with a string name among the offered tools and an object of
arguments; anything else stays content, markup included. Llama JSON and what follows `[TOOL_CALLS]` are all calls or
none: one malformed call leaves the whole as content. A call is emitted once it is complete and valid (after its
`</tool_call>`, or at the end of the output for Llama JSON and Mistral), so a stream never shows half a malformed
call as a call, nor raw markup as content.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_MARKERS = {"hermes": (CALL_START,), "mistral": (MISTRAL_CALLS,), "auto": (CALL_START, MISTRAL_CALLS)}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: arguments is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Content:
    text: str


Event = Content | ToolCall


class ToolCallParser:
    """Feed the output as it arrives; each feed (and finish, at the end) returns what is now known to be content
    or a whole call, in output order. Feeding the whole text at once gives the same events, merged.

    Whitespace between content and a call is dropped (so "Sure.\\n<tool_call>…" has content "Sure."); an output
    with no call keeps its text exactly."""

    def __init__(self, tool_names: Collection[str], new_id: Callable[[], str], parser: str = "auto") -> None:
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; one of {', '.join(TOOL_CALL_PARSERS)}")
        self.tool_names = frozenset(tool_names)
        self.new_id = new_id
        self.parser = parser
        self.num_calls = 0
        self._pending = ""  # text not classified yet
        self._mode = "" if parser != "hermes" else "markup"  # "": undecided; "markup", "plain" or "json" (held)
        self._markers = _MARKERS.get(parser, ())  # what markup mode looks for
        self._is_in_call = False
        self._is_in_mistral_calls = False  # after [TOOL_CALLS]: the rest of the output is held to its end
        self._held_space = ""  # trailing whitespace of emitted content: dropped before a call
        self._space_before_call = ""  # whitespace dropped at the current call's marker, back if it proves malformed
        self._is_after_call = False  # content's leading whitespace after a call is dropped

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        if not self._mode:
            self._mode = self._first_mode(self._pending.lstrip())
            if not self._mode:
                return []
        if self._mode == "plain":
            pending, self._pending = self._pending, ""
            return self._content(pending)
        return self._markup_events() if self._mode == "markup" else []

    def finish(self) -> list[Event]:
        """The events the end of the output decides: a held Llama JSON or Mistral answer, an unclosed call, held
        text."""
        pending, self._pending = self._pending, ""
        if not self._mode:  # the output ended undecided ("[", say): text
            events: list[Event] = self._content(pending)
        elif self._mode == "json":
            stripped = pending.strip()
            calls = self._mistral_calls(stripped) if stripped.startswith("[") else self._json_calls(stripped)
            events = calls if calls is not None else self._content(pending)
        elif self._is_in_mistral_calls:
            self._is_in_mistral_calls = False
            calls = self._mistral_calls(pending)
            events = calls if calls is not None else self._content(self._space_before_call + pending)
            self._space_before_call = ""
        elif self._is_in_call:  # no </tool_call>: a complete call still counts
            self._is_in_call = False
            events = self._closed_call(pending, has_end=False)
        else:
            events = self._content(pending)
        if not self.num_calls and self._held_space:
            events.append(Content(self._held_space))
        self._held_space = ""
        return merge_events(events)

    def _first_mode(self, head: str) -> str:
        """The mode an output that starts (blanks aside) with head is read in; "" while head cannot tell yet."""
        if not head:
            return ""
        if self.parser in ("llama3_json", "auto"):
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                return "json"
            if PYTHON_TAG.startswith(head):
                return ""
        if self.parser in ("mistral", "auto") and head.startswith("["):
            after = head[1:].lstrip()
            if after.startswith("{"):  # an array of objects: the calls, [TOOL_CALLS] decoded away
                return "json"
            if not after or (MISTRAL_CALLS.startswith(head) and head != MISTRAL_CALLS):
                return ""
        return "plain" if self.parser == "llama3_json" else "markup"

    def _markup_events(self) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._is_in_mistral_calls:
                return merge_events(events)
            if self._is_in_call:
                end = self._pending.find(CALL_END)
                if end < 0:
                    return merge_events(events)
                body, self._pending = self._pending[:end], self._pending[end + len(CALL_END):]
                self._is_in_call = False
                events += self._closed_call(body, has_end=True)
                continue
            found = [(at, marker) for marker in self._markers if (at := self._pending.find(marker)) >= 0]
            if not found:
                keep = max((_partial_suffix(self._pending, marker) for marker in self._markers), default=0)
                cut = len(self._pending) - keep
                events += self._content(self._pending[:cut])
                self._pending = self._pending[cut:]
                return merge_events(events)
            start, marker = min(found)
            events += self._content(self._pending[:start])
            self._space_before_call, self._held_space = self._held_space, ""
            if marker == MISTRAL_CALLS:  # kept in _pending: content again if what follows is no calls
                self._pending = self._pending[start:]
                self._is_in_mistral_calls = True
            else:
                self._pending = self._pending[start + len(CALL_START):]
                self._is_in_call = True

    def _closed_call(self, body: str, has_end: bool) -> list[Event]:
        calls = self._calls([_loads(body)])
        if calls is not None:
            return calls
        raw = self._space_before_call + CALL_START + body + (CALL_END if has_end else "")
        self._space_before_call = ""
        return self._content(raw)

    def _json_calls(self, text: str) -> list[Event] | None:
        """Llama JSON: every object between `;`s a valid call, else None (the text is content)."""
        text = text.strip().removeprefix(PYTHON_TAG).strip()
        decoder, at, values = json.JSONDecoder(), 0, []
        while at < len(text):
            try:
                value, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return None
            values.append(value)
            rest = text[at:].lstrip()
            at = len(text) - len(rest.removeprefix(";").lstrip())
            if rest and not rest.startswith(";"):
                return None
        return self._calls(values)

    def _mistral_calls(self, text: str) -> list[Event] | None:
        """`[TOOL_CALLS]` and the rest of the output (or, the marker decoded away, an output that is a JSON array):
        each `[TOOL_CALLS]` followed by an array of calls, one call object, or `name[ARGS]{arguments}`; every call
        valid and nothing else, else None (the text is content)."""
        text = text.strip()
        decoder, values = json.JSONDecoder(), []
        at = len(MISTRAL_CALLS) if text.startswith(MISTRAL_CALLS) else 0
        while True:
            at = _skip_space(text, at)
            try:
                if text.startswith(("[", "{"), at):
                    value, at = decoder.raw_decode(text, at)
                    values += value if isinstance(value, list) else [value]
                else:
                    args_at = text.find(MISTRAL_ARGS, at)
                    if args_at < 0:
                        return None
                    arguments, end = decoder.raw_decode(text, _skip_space(text, args_at + len(MISTRAL_ARGS)))
                    values.append({"name": text[at:args_at].strip(), "arguments": arguments})
                    at = end
            except json.JSONDecodeError:
                return None
            at = _skip_space(text, at)
            if at == len(text):
                return self._calls(values)
            if not text.startswith(MISTRAL_CALLS, at):
                return None
            at += len(MISTRAL_CALLS)

    def _calls(self, values: list[object]) -> list[Event] | None:
        """A call for each value, or None unless there are some and every one is a valid call (no id is spent,
        nothing counted, on values that turn out not to be calls)."""
        checked = [self._checked(value) for value in values]
        if not checked or None in checked:
            return None
        self.num_calls += len(checked)
        self._is_after_call = True
        return [ToolCall(self.new_id(), name, arguments) for name, arguments in checked]

    def _checked(self, value: object) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of a valid call, else None."""
        name = value.get("name") if isinstance(value, dict) else None
        if not isinstance(name, str) or name not in self.tool_names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = _loads(arguments)
        if not isinstance(arguments, dict):
            return None
        return name, json.dumps(arguments, ensure_ascii=False)

    def _content(self, text: str) -> list[Event]:
        if self._is_after_call:
            text = text.lstrip()
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        if not body:
            return []
        self._is_after_call = False
        return [Content(body)]


def parse_tool_calls(text: str, tool_names: Collection[str], new_id: Callable[[], str],
                     parser: str = "auto") -> tuple[str | None, list[ToolCall]]:
    """A whole output → (content, calls); content is None when calls leave no text, else the text outside them."""
    tool_parser = ToolCallParser(tool_names, new_id, parser)
    events = tool_parser.feed(text) + tool_parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e.text for e in events if isinstance(e, Content))
    return (content or None) if calls else content, calls


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _skip_space(text: str, at: int) -> int:
    """The index of the first non-blank character of text from at (its length when there is none)."""
    return len(text) - len(text[at:].lstrip())


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker (held back: it may be the marker's start)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def merge_events(events: list[Event]) -> list[Event]:
    """events with adjacent contents joined."""
    merged: list[Event] = []
    for event in events:
        if isinstance(event, Content) and merged and isinstance(merged[-1], Content):
            merged[-1] = Content(merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged
