"""What the engine is asked to do (SamplingParams) and what it reports back (TokenOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, with OpenAI/vLLM meanings.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    repetition_penalty (HF/CTRL style, 1 = off) divides positive / multiplies negative logits of tokens
    seen in prompt or output; presence/frequency penalties (OpenAI style, 0 = off) apply to output tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus top-k alternatives

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.n < 1:
            raise ValueError("n must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be in [0, 20]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop token id (or, in the tokenizer, a stop string)
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    ABORT = "abort"  # aborted by the caller


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives, from the raw model logits."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TokenOutput:
    """engine → caller: the tokens one sequence produced in one step (usually one)."""

    request_id: str
    index: int  # which of the request's n sequences
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
