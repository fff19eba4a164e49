"""Draft-model proposals: a second, small Engine on a model with the target's vocabulary decodes k greedy tokens
after each sequence.

Each step every speculating sequence becomes one request to the draft engine (prompt: the sequence's verified
tokens, greedy, max_tokens k), all of them run to completion together. The draft engine's own radix prefix cache
keeps the KV of what it saw last step, so a proposal prefills only the tokens verified since (the accepted drafts
and the target's token, back to a page boundary) and then decodes k steps: per verify step the draft model runs
about k + 1 forwards. Nothing is kept per sequence beyond that cache, so forget() has nothing to drop.

The drafts are greedy, a deterministic proposal, so rejection sampling treats them as one-hot q (verify.py) and
sampled outputs keep the target's distribution.
"""
from __future__ import annotations

from typing import Any

from services.gpu_worker.engine_config import AUTO_TOKENS_PER_SEQ, EngineConfig
from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.model.loader import LoadedModel, load_model
from services.gpu_worker.request import SamplingParams
from services.gpu_worker.spec.proposer import ProposalRequest


def check_same_vocabulary(target: ModelConfig, draft: ModelConfig, target_tokenizer: Any = None,
                          draft_tokenizer: Any = None) -> None:
    """ValueError unless the draft model's token ids mean what the target's do (same vocab_size, and the same
    tokenizer vocabulary when both models have a tokenizer)."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"the draft model {draft.model_id!r} has a vocabulary of {draft.vocab_size} tokens, the "
                         f"target {target.model_id!r} {target.vocab_size}: a draft model must share the target's "
                         "tokenizer")
    if target_tokenizer is not None and draft_tokenizer is not None \
            and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"the draft model {draft.model_id!r} has another tokenizer than the target "
                         f"{target.model_id!r} (same size, different tokens): a draft model must share the "
                         "target's tokenizer")


def draft_num_pages(target: EngineConfig, target_num_pages: int) -> int:
    """The draft engine's pool: as many pages as the target's, at most room for speculative_max_batch_size sequences
    of AUTO_TOKENS_PER_SEQ tokens (its memory comes out of what the target's pool left free)."""
    cap = 1 + target.speculative_max_batch_size * AUTO_TOKENS_PER_SEQ // target.page_size
    return min(target_num_pages, cap)


class DraftProposer:
    """Proposer (proposer.Proposer) of a draft model's greedy continuations, run on its own Engine."""

    def __init__(self, target: EngineConfig, target_model: ModelConfig, target_tokenizer: Any,
                 target_num_pages: int, engine_class: type) -> None:
        """engine_class: the Engine class, passed in by engine.py (which imports this package, so no import back)."""
        assert target.speculative_draft_model is not None
        config = EngineConfig(model=target.speculative_draft_model, device=target.resolved_device(),
                              dtype=target.dtype, page_size=target.page_size,
                              num_pages=draft_num_pages(target, target_num_pages), seed=target.seed,
                              attention_backend=target.attention_backend, enable_cuda_graphs=target.enable_cuda_graphs)
        loaded: LoadedModel = load_model(config.model, dtype=config.resolved_dtype(),
                                         device=config.resolved_device(), seed=config.seed)
        check_same_vocabulary(target_model, loaded.config, target_tokenizer, loaded.tokenizer)
        self.engine = engine_class(config, loaded)  # an engine.Engine
        loaded.state_dict.clear()  # the engine's model holds its own copy of the weights
        self.num_requests = 0  # proposals asked of the draft engine

    def _fits(self, request: ProposalRequest) -> bool:
        """The draft engine takes the sequence and its k drafts (a longer context than the draft model's: none)."""
        num_tokens = len(request.token_ids)
        return (request.k > 0 and num_tokens < self.engine.max_seq_len
                and num_tokens + request.k <= self.engine.max_model_len)

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        fits = [self._fits(r) for r in requests]
        wanted = [r for r, fit in zip(requests, fits) if fit]
        self.num_requests += len(wanted)
        params = [SamplingParams(max_tokens=r.k, temperature=0.0, ignore_eos=True) for r in wanted]
        results = iter(self.engine.generate([list(r.token_ids) for r in wanted], params))  # all at once, in order
        return [next(results).samples[0].token_ids if fit else [] for fit in fits]

    def forget(self, request_id: str, index: int = 0) -> None:
        """Nothing is kept per sequence: the draft engine's prefix cache holds the KV, and evicts it as needed."""
