"""Speculative decoding in the engine's step: which sequences get draft tokens, and the verification of their rows.

Per step (engine.py): propose() before scheduling gives each eligible decoding sequence up to k drafts
(Sequence.draft_token_ids; k from its adaptive budget, adaptive.py); the batch policy schedules such a sequence as a
multi-token row (its last token + drafts, pages reserved for all of them) beside plain decodes and prefill chunks;
the runner returns 1 + k logit rows for it (from a verify CUDA graph when every row is a decode: cuda_graphs.py);
verify() scores them (verify.py) and hands the plain rows' logits back to the sampler. The engine then appends the
verified tokens, checking stops token by token, and rolls the rejected drafts' KV back (BatchPolicy.commit_drafts).
Drafts never enter token_ids, so the prefix cache sees only verified tokens.

Not speculated: structured output (a grammar mask per draft position is not built), prompt-logprob requests,
PD prefill-only requests, requests that set `speculative: false`, and every sequence while more than
max_batch_size decode at once (decode is then compute-bound and drafts cost real work).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from services.gpu_worker.batch_policy import ScheduledItem
from services.gpu_worker.engine_config import SPECULATIVE_METHODS as METHODS, EngineConfig
from services.gpu_worker.engine_metrics import EngineMetricsRecorder
from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.sequence import Sequence, SeqStatus
from services.gpu_worker.spec.adaptive import AdaptiveK, DraftBudget, DraftCosts
from services.gpu_worker.spec.draft import DraftProposer
from services.gpu_worker.spec.ngram import NgramProposer
from services.gpu_worker.spec.proposer import ProposalRequest, Proposer
from services.gpu_worker.spec.verify import SpecRow, Verified, verify
from services.gpu_worker.staging import to_device



def make_proposer(config: EngineConfig, target_model: ModelConfig, target_tokenizer: Any,
                  target_num_pages: int, engine_class: type) -> Proposer:
    """The proposer config.speculative_method names, for a target of this model, tokenizer and KV pool
    (engine_class: the Engine class a draft model runs on)."""
    if config.speculative_method == "ngram":
        return NgramProposer()
    if config.speculative_method == "draft":
        return DraftProposer(config, target_model, target_tokenizer, target_num_pages, engine_class)
    raise ValueError(f"speculative_method must be one of {', '.join(METHODS)} (or None), "
                     f"not {config.speculative_method!r}")


class Speculator:
    """The engine's speculative-decoding state: a proposer, adaptive k, and the sequences drafted this step."""

    def __init__(self, proposer: Proposer, max_k: int, max_batch_size: int,
                 metrics: Callable[[], EngineMetricsRecorder], costs: DraftCosts,
                 probe_interval_steps: int | None = None) -> None:
        self.proposer = proposer
        self.adaptive = (AdaptiveK(max_k, costs) if probe_interval_steps is None
                         else AdaptiveK(max_k, costs, probe_interval_steps))
        self.max_batch_size = max_batch_size
        self._metrics = metrics  # the engine's recorder (replaced after warm-up)
        self._drafted: list[Sequence] = []
        self._plan: dict[int, int] | None = None  # this step's draft count by seq_id, until propose() uses it

    def _budget(self, seq: Sequence) -> DraftBudget:
        if seq.draft_budget is None:
            seq.draft_budget = self.adaptive.new_budget()
        return seq.draft_budget

    @staticmethod
    def may_speculate(seq: Sequence) -> bool:
        """A running decode that speculation may serve (its last token may still be on the device)."""
        p = seq.params
        return (p.speculative and seq.status is SeqStatus.RUNNING and seq.num_uncomputed == 1
                and not seq.stops_when_resolved and seq.matcher is None and seq.prompt_logprobs is None
                and not seq.is_prefill_only)

    def _candidates(self, running: list[Sequence]) -> tuple[list[Sequence], int]:
        """The decodes that may draft, and the number of decodes in the step."""
        decoding = [seq for seq in running if seq.num_uncomputed == 1]
        if len(decoding) > self.max_batch_size:
            return [], len(decoding)
        return [seq for seq in decoding if self.may_speculate(seq)], len(decoding)

    def _planned(self, running: list[Sequence]) -> dict[int, int]:
        """This step's draft counts (adaptive.py), decided once a step: before the engine reads the launched step's
        tokens (wants_host_tokens) or, where it reads them anyway, in propose."""
        if self._plan is None:
            candidates, num_decoding = self._candidates(running)
            ks = self.adaptive.plan([self._budget(seq) for seq in candidates], num_decoding)
            self._plan = {seq.seq_id: k for seq, k in zip(candidates, ks) if k > 0}
        return self._plan

    def wants_host_tokens(self, running: list[Sequence]) -> bool:
        """Some sequence drafts this step: the engine reads the launched step's tokens before proposing (the
        proposer looks at each sequence's last token). False while no sequence expects drafts to pay for the step's
        cost, or every candidate waits (adaptive.py), so such a step overlaps as a plain one does."""
        return bool(self._planned(running))

    def propose(self, running: list[Sequence], max_seq_len: int) -> None:
        """Set this step's drafts: at most the planned k per sequence, fewer where max_tokens or the context ends
        sooner (every verified row appends up to k + 1 tokens)."""
        self.end_step()
        planned, self._plan = self._planned(running), None
        requests, seqs = [], []
        for seq in self._candidates(running)[0]:
            k = min(planned.get(seq.seq_id, 0), seq.params.max_tokens - seq.num_output_tokens - 1,
                    max_seq_len - seq.num_tokens)
            if k > 0 and not seq.num_pending:
                requests.append(ProposalRequest(seq.token_ids, k, seq.request_id, seq.index))
                seqs.append(seq)
        if not requests:
            return
        for seq, request, drafts in zip(seqs, requests, self.proposer.propose(requests)):
            self.adaptive.on_proposed(self._budget(seq), len(drafts))  # nothing found, again and again: back off
            if drafts:
                seq.draft_token_ids = list(drafts[:request.k])
                self._drafted.append(seq)

    def end_step(self) -> None:
        """Forget this step's drafts (verified, or never scheduled)."""
        for seq in self._drafted:
            seq.draft_token_ids = []
        self._drafted = []

    def verify(self, logits: torch.Tensor, ends: list[ScheduledItem],
               ) -> tuple[torch.Tensor, list[ScheduledItem], list[tuple[Sequence, Verified]]]:
        """Split a step's sampling logits [sum of 1 + num_draft_tokens over ends, V] (ends' rows in order): verify the
        drafted rows → the plain rows' logits [B_p, V], their items, and each drafted row's sequence and result."""
        plain_rows: list[int] = []
        plain: list[ScheduledItem] = []
        drafted: list[tuple[ScheduledItem, int]] = []  # (item, its first logit row)
        row = 0
        for item in ends:
            if item.num_draft_tokens:
                drafted.append((item, row))
            else:
                plain_rows.append(row)
                plain.append(item)
            row += 1 + item.num_draft_tokens
        width = 1 + max(item.num_draft_tokens for item, _ in drafted)
        index = [[start + min(j, item.num_draft_tokens) for j in range(width)] for item, start in drafted]
        scored = logits[to_device(index, torch.long, logits.device)]  # [B_d, K+1, V]; short rows repeat their last
        rows = [SpecRow(item.seq.sampling_row(), item.seq.draft_token_ids[:item.num_draft_tokens])
                for item, _ in drafted]
        results = verify(scored, rows)
        metrics = self._metrics()
        for (item, _), result in zip(drafted, results):
            self.adaptive.update(self._budget(item.seq), item.num_draft_tokens, result.num_accepted)
            metrics.on_spec_verified(item.num_draft_tokens, result.num_accepted)
        plain_logits = logits[to_device(plain_rows, torch.long, logits.device)]  # [B_p, V]
        return plain_logits, plain, [(item.seq, result) for (item, _), result in zip(drafted, results)]
