"""What the engine is asked to do (SamplingParams, the shared Struct) and what it reports back (TokenOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from shared.sampling import SamplingParams as SamplingParams  # one class for gateway, wire and engine


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
    rank: int | None = None  # 1 + the number of tokens more likely than the chosen one (prompt logprobs: known)


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
    # prompt logprobs (params.prompt_logprobs), on each sample's first output: one per prompt token, None first
    prompt_logprobs: list[TokenLogprob | None] | None = None
