"""One generated sequence's state inside the engine: its tokens, its pages, and how far its KV is computed."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from services.gpu_worker.prompt_logprobs import PromptLogprobs
from services.gpu_worker.request import FinishReason, SamplingParams, TokenLogprob
from services.gpu_worker.sampler import SamplingRow, needs_history
from services.gpu_worker.spec.adaptive import DraftBudget


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    IMPORTING = "importing"  # PD decode side: pages allocated, the prompt's KV being pulled from a prefill worker


@dataclass(eq=False)
class Sequence:
    """token_ids = prompt + outputs. KV exists for token_ids[:num_computed]; pages cover at least that.

        token_ids:   |<------ prompt ------>|<-- outputs -->|
        KV computed: |<----- num_computed ----->|
        page_ids:    |  p0  |  p1  |  p2  |  p3  |            (page_size tokens each)

    A decoding sequence has num_computed == len(token_ids) - 1: its last sampled token is fed next step.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival: float
    generator: torch.Generator | None = None
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    cache_node: object | None = None  # the locked radix node covering this sequence's cached prefix
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    num_preemptions: int = 0
    is_forked: bool = False  # n > 1 siblings already made from this one
    was_admitted: bool = False
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full pages (see batch_policy)
    is_prefill_only: bool = False  # PD prefill side: after the first token, hold the prompt's pages (a lease)
    # Overlap mode: the last num_pending entries of token_ids are placeholders for tokens sampled on the
    # device and not yet seen by the host; pending_row is the newest one's row in its step's token tensor.
    num_pending: int = 0
    pending_row: int = -1
    stops_when_resolved: bool = False  # its pending token ends it whatever its value (length, PD hold, max_tokens 0)
    matcher: object | None = None  # structured output: its llguidance matcher, advanced by each resolved token
    # params.prompt_logprobs: filled during prefill (shared with n > 1 siblings); sent once, on the first output
    prompt_logprobs: PromptLogprobs | None = None
    has_sent_prompt_logprobs: bool = False
    # Speculative decoding (spec/): this step's draft tokens to follow token_ids (never in token_ids: only verified
    # tokens are), set before scheduling and cleared after the step; and how many to ask for (adaptive k)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_budget: DraftBudget | None = None

    def sampling_row(self) -> SamplingRow:
        """The sampler's view; the token history is copied (per step, per row) only for penalties, which read it."""
        if not needs_history(self.params):
            return SamplingRow(self.params, (), (), self.generator)
        return SamplingRow(self.params, self.token_ids[: self.num_prompt_tokens], self.output_token_ids, self.generator)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has (all but the pending placeholders)."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_reusable_tokens(self) -> int:
        """Leading tokens whose KV the prefix cache may serve: all but the last (its logits give the next token), and
        for prompt logprobs none from the first position whose logits are still needed (cached KV has no logits)."""
        num = len(self.token_ids) - 1
        if self.prompt_logprobs is not None and not self.prompt_logprobs.is_complete:
            num = min(num, self.prompt_logprobs.num_leading())
        return num

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
