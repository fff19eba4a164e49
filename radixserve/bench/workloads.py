"""The canonical workloads W0–W6, custom lengths and JSONL traces, as requests of exact token lengths (pure).

Prompts are token ids for /v1/completions by default (any model, random:* included), or text made
with a tokenizer and re-encoded to check its length (completions, or chat messages with --chat).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

Prompt = list[int] | str

ALIASES = {"hf-parity": "w0", "decode-heavy": "w1", "shared-prefix": "w2", "online": "w3", "pd-mix": "w4",
           "multi-turn": "w5", "sustained": "w6"}
WORKLOADS = ("w0", "w1", "w2", "w3", "w4", "w5", "w6", "custom")
MIN_ID_TOKEN = 1000  # random token ids start here, above the special tokens of common vocabularies


@dataclass(frozen=True)
class Settings:
    """Workload sizes; None fields take the workload's defaults (see DEFAULTS)."""

    num_requests: int | None = None
    input_len: int | None = None  # W2: the question's tokens; W3: the mean; W5: each user turn's
    output_len: int | None = None  # W3: the mean
    num_groups: int | None = None
    per_group: int | None = None
    prefix_len: int | None = None  # W2 / W5 / W6 shared system prompt tokens
    variant: str = "shared"  # W2: shared | random system prompts
    long_input_len: int | None = None
    long_output_len: int | None = None
    long_fraction: float | None = None
    num_sessions: int | None = None
    turns: int | None = None
    sigma: float = 0.8  # W3 / W6 log-normal shape (larger: longer tail)


DEFAULTS: dict[str, dict[str, Any]] = {
    "w0": dict(num_requests=128, input_len=512, output_len=256),
    "w1": dict(num_requests=1000, input_len=1000, output_len=1000),
    "w2": dict(num_groups=64, per_group=16, prefix_len=2048, input_len=128, output_len=256),
    "w3": dict(num_requests=200, input_len=250, output_len=200),
    "w4": dict(num_requests=100, input_len=256, output_len=256, long_input_len=8192, long_output_len=256,
               long_fraction=0.1),
    "w5": dict(num_sessions=32, turns=5, prefix_len=1024, input_len=128, output_len=128),
    "w6": dict(num_groups=32, prefix_len=1024, input_len=250, output_len=200),
    "custom": dict(num_requests=100, input_len=128, output_len=128),
}


def resolve(workload: str, settings: Settings) -> Settings:
    """settings with every None field set from the workload's defaults."""
    defaults = DEFAULTS[workload]
    return replace(settings, **{k: v for k, v in defaults.items() if getattr(settings, k) is None})


@dataclass
class RequestSpec:
    """One request: a completions prompt (ids or text) or chat messages, with an exact max_tokens."""

    max_tokens: int
    prompt: Prompt | None = None
    messages: list[dict[str, str]] | None = None
    num_prompt_tokens: int = 0  # the client's count (chat: content tokens, before the template)
    arrival_s: float | None = None  # a trace's own schedule, relative to its first request


@dataclass
class SessionSpec:
    """W5: a shared system prompt, then turns of user text; each turn's prompt carries the history.

    NOTE: with token-id prompts the client cannot read the answer's ids back, so the history carries
    `answer_standins` (random ids of the answer's exact length) instead of the answer itself.
    """

    system: Prompt
    user_turns: list[Prompt]
    max_tokens: int
    answer_standins: list[list[int]] = field(default_factory=list)


@dataclass
class Workload:
    name: str
    requests: list[RequestSpec] = field(default_factory=list)
    sessions: list[SessionSpec] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.requests) + sum(len(s.user_turns) for s in self.sessions)


class IdPrompts:
    """Random token-id prompts: exact by construction."""

    is_text = False

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= MIN_ID_TOKEN:
            raise ValueError(f"vocab_size must exceed {MIN_ID_TOKEN}")
        self.vocab_size = vocab_size

    def make(self, num_tokens: int, rng: np.random.Generator) -> list[int]:
        return rng.integers(MIN_ID_TOKEN, self.vocab_size, size=num_tokens).tolist()

    def count(self, prompt: Prompt) -> int:
        return len(prompt)

    def join(self, parts: list[Prompt]) -> Prompt:
        return [t for part in parts for t in part]


class TextPrompts:
    """Text of exact token lengths: random whole-word tokens (a leading space each), decoded, re-encoded
    to check the count and re-drawn when a merge changes it."""

    is_text = True
    max_attempts = 50

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.words = np.array(_word_token_ids(tokenizer))
        if len(self.words) < 100:
            raise ValueError("the tokenizer has too few whole-word tokens to build prompts from")

    def make(self, num_tokens: int, rng: np.random.Generator) -> str:
        for _ in range(self.max_attempts):
            text = self.tokenizer.decode(rng.choice(self.words, size=num_tokens).tolist())
            if self.count(text) == num_tokens:
                return text
        raise ValueError(f"could not build a text of exactly {num_tokens} tokens")

    def count(self, prompt: Prompt) -> int:
        return len(self.tokenizer.encode(prompt, add_special_tokens=False))

    def join(self, parts: list[Prompt]) -> Prompt:
        return "".join(parts)


def _word_token_ids(tokenizer: Any) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []))
    ids = []
    for token_id in range(len(tokenizer)):
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if (token_id not in special and isinstance(piece, str) and piece[:1] in ("Ġ", "▁")
                and piece[1:].isascii() and piece[1:].isalpha() and len(piece) >= 3):
            ids.append(token_id)
    return ids


def _exact_join(maker: IdPrompts | TextPrompts, parts: list[Prompt], rng: np.random.Generator,
                redraw_len: int) -> Prompt:
    """parts joined; with text, the last part is redrawn until the whole re-encodes to the parts' sum."""
    target = sum(maker.count(p) for p in parts)
    for _ in range(TextPrompts.max_attempts):
        joined = maker.join(parts)
        if not maker.is_text or maker.count(joined) == target:
            return joined
        parts = [*parts[:-1], maker.make(redraw_len, rng)]
    raise ValueError("could not join prompt parts at an exact token count")


def _request(maker: IdPrompts | TextPrompts, prompt_parts: list[Prompt], max_tokens: int, is_chat: bool,
             rng: np.random.Generator) -> RequestSpec:
    """A completions prompt (parts joined), or chat: the first of two parts is the system message."""
    num_tokens = sum(maker.count(p) for p in prompt_parts)
    if is_chat:
        messages = [{"role": "user", "content": prompt_parts[-1]}]
        if len(prompt_parts) > 1:
            messages.insert(0, {"role": "system", "content": maker.join(prompt_parts[:-1])})
        return RequestSpec(max_tokens, messages=messages, num_prompt_tokens=num_tokens)
    prompt = _exact_join(maker, prompt_parts, rng, maker.count(prompt_parts[-1]))
    return RequestSpec(max_tokens, prompt=prompt, num_prompt_tokens=maker.count(prompt))


def build(workload: str, settings: Settings, maker: IdPrompts | TextPrompts, seed: int, salt: int = 0,
          is_chat: bool = False) -> Workload:
    """The requests of a named workload (w0..w5, custom); settings already resolved.

    Lengths come from `seed` alone and token contents from (seed, salt): runs of one sweep share their
    lengths but never their prompts, so one run cannot warm the server's prefix cache for the next.
    """
    workload = ALIASES.get(workload, workload)
    lengths, rng = np.random.default_rng(seed), np.random.default_rng([seed, salt])
    s = settings
    if workload in ("w0", "w1", "custom"):
        reqs = [_request(maker, [maker.make(s.input_len, rng)], s.output_len, is_chat, rng)
                for _ in range(s.num_requests)]
        return Workload(workload, requests=reqs)
    if workload == "w2":
        return Workload(workload, requests=_shared_prefix(s, maker, rng, is_chat))
    if workload == "w3":
        ins = lognormal_lengths(s.num_requests, s.input_len, s.sigma, lengths)
        outs = lognormal_lengths(s.num_requests, s.output_len, s.sigma, lengths)
        return Workload(workload, requests=[_request(maker, [maker.make(int(i), rng)], int(o), is_chat, rng)
                                            for i, o in zip(ins, outs)])
    if workload == "w4":
        is_long = lengths.random(s.num_requests) < s.long_fraction
        reqs = [_request(maker, [maker.make(s.long_input_len if long else s.input_len, rng)],
                         s.long_output_len if long else s.output_len, is_chat, rng) for long in is_long]
        return Workload(workload, requests=reqs)
    if workload == "w5":
        system = maker.make(s.prefix_len, rng)
        sessions = [SessionSpec(system, [maker.make(s.input_len, rng) for _ in range(s.turns)], s.output_len,
                                [] if maker.is_text else [maker.make(s.output_len, rng) for _ in range(s.turns)])
                    for _ in range(s.num_sessions)]
        return Workload(workload, sessions=sessions)
    if workload == "w6":
        raise ValueError("w6 is a closed loop without a fixed list of requests: use Sustained")
    raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)} or a trace")


class Sustained:
    """W6: an endless request source for a closed loop; request i depends on (seed, salt, i) alone.

    Even-numbered requests are one of num_groups shared system prompts (prefix_len tokens) and a question;
    odd-numbered ones are a prompt of their own. Question / prompt and output lengths are chat-like:
    log-normal with means input_len / output_len and shape sigma, capped at 10x the mean.
    """

    def __init__(self, settings: Settings, maker: IdPrompts | TextPrompts, seed: int, salt: int = 0,
                 is_chat: bool = False) -> None:
        self.settings, self.maker, self.seed, self.salt, self.is_chat = settings, maker, seed, salt, is_chat
        rng = np.random.default_rng([seed, 1 + salt])
        self.prefixes = [maker.make(settings.prefix_len, rng) for _ in range(settings.num_groups)]

    def request(self, index: int) -> RequestSpec:
        s = self.settings
        lengths = np.random.default_rng([self.seed, 0, index])
        rng = np.random.default_rng([self.seed, 1 + self.salt, index])
        num_in = int(lognormal_lengths(1, s.input_len, s.sigma, lengths)[0])
        num_out = int(lognormal_lengths(1, s.output_len, s.sigma, lengths)[0])
        parts = [self.maker.make(num_in, rng)]
        if index % 2 == 0:
            parts.insert(0, self.prefixes[int(lengths.integers(s.num_groups))])
        return _request(self.maker, parts, num_out, self.is_chat, rng)


def _shared_prefix(s: Settings, maker: IdPrompts | TextPrompts, rng: np.random.Generator,
                   is_chat: bool) -> list[RequestSpec]:
    """W2: num_groups system prompts × per_group questions, grouped in order (SGLang's generated-shared-prefix);
    the random variant gives every request its own system prompt of the same length."""
    if s.variant not in ("shared", "random"):
        raise ValueError(f"W2 variant must be shared or random, not {s.variant!r}")
    reqs = []
    for _ in range(s.num_groups):
        prefix = maker.make(s.prefix_len, rng)
        for _ in range(s.per_group):
            own = prefix if s.variant == "shared" else maker.make(s.prefix_len, rng)
            reqs.append(_request(maker, [own, maker.make(s.input_len, rng)], s.output_len, is_chat, rng))
    return reqs


def lognormal_lengths(num: int, mean: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Chat-like lengths: log-normal with the given mean (median mean·e^(-σ²/2)), clipped to [1, 10·mean]."""
    mu = math.log(mean) - sigma * sigma / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=num)), 1, 10 * mean).astype(int)


def arrival_times(num: int, rate: float, seed: int, kind: str = "poisson") -> list[float]:
    """Send times in seconds from the run's start: the first at 0, then exponential gaps of mean 1/rate
    (poisson) or gaps of exactly 1/rate (uniform); all 0 for rate inf."""
    if num == 0:
        return []
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0:
        raise ValueError("rate must be positive")
    if kind == "uniform":
        gaps = np.full(num - 1, 1.0 / rate)
    elif kind == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num - 1)
    else:
        raise ValueError(f"arrival kind must be poisson or uniform, not {kind!r}")
    return [0.0, *np.cumsum(gaps).tolist()]


def load_trace(path: str | Path, maker: IdPrompts | TextPrompts | None = None) -> Workload:
    """JSONL, one request a line: {"timestamp": s, "prompt_ids" | "prompt" | "messages": ..., "max_tokens": n}."""
    reqs = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "max_tokens" not in row:
            raise ValueError(f"{path}:{line_no}: max_tokens is required")
        spec = RequestSpec(int(row["max_tokens"]), arrival_s=row.get("timestamp"))
        if "prompt_ids" in row:
            spec.prompt = [int(t) for t in row["prompt_ids"]]
            spec.num_prompt_tokens = len(spec.prompt)
        elif "prompt" in row:
            spec.prompt = str(row["prompt"])
            spec.num_prompt_tokens = maker.count(spec.prompt) if isinstance(maker, TextPrompts) else 0
        elif "messages" in row:
            spec.messages = row["messages"]
        else:
            raise ValueError(f"{path}:{line_no}: needs prompt_ids, prompt or messages")
        reqs.append(spec)
    stamps = [r.arrival_s for r in reqs if r.arrival_s is not None]
    if stamps:
        first = min(stamps)
        for r in reqs:
            r.arrival_s = (r.arrival_s - first) if r.arrival_s is not None else None
        reqs.sort(key=lambda r: math.inf if r.arrival_s is None else r.arrival_s)
    return Workload("trace", requests=reqs)
