"""Verification of draft tokens against the target model's logits, for a batch (speculative decoding's core).

The target scores a row's k draft tokens x_1..x_k in one pass: logits position j (0-based) is the distribution of
the token after the sequence + x_1..x_j, so a row has k + 1 positions, the last one the "bonus" position after all
k drafts. Rows are padded to the batch's largest k: logits [B, K+1, V], row b using its first k_b + 1 positions.

    greedy rows (temperature 0): keep drafts while x_j equals the target's argmax at position j - 1; then append
        the argmax at the first mismatch (or at the bonus position): exactly what plain greedy decoding emits.
    sampled rows: speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept x_j with
        probability min(1, p(x_j) / q(x_j)); at the first rejection sample from norm(max(0, p - q)), after k
        accepted sample the bonus token from p. Each emitted token is then distributed exactly as p, whatever q is.
        q is the proposer's distribution; a proposer without one (n-gram lookup) proposes deterministically, so q
        is the one-hot of x_j: accept with probability p(x_j), and the residual is p without x_j, renormalised.

p is what plain sampling would sample from: the sampler's own penalties (over the sequence's history including
the drafts before the position), temperature, top-k, top-p and min-p (sampler.apply_penalties, apply_filters).
Seeded rows draw every random number from their own generator (k uniforms, then one exponential race over V),
so their output does not depend on what else is in the batch. Logprobs follow the sampler: the appended tokens'
log-probabilities under the raw logits, with the top alternatives when the row's params ask for logprobs.

Structured output (a grammar's token mask) is not applied here: the engine must mask the logits of each position
with the grammar advanced over the drafts before it, as it does for one position in plain decoding.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.gpu_worker.request import TokenLogprob
from services.gpu_worker.sampler import (GREEDY_EPS, SamplingRow, _exponential_noise, apply_filters,
                                         apply_penalties, changes_logits, needs_history)
from services.gpu_worker.staging import to_device


@dataclass
class SpecRow:
    """One sequence's draft tokens to verify."""

    sampling: SamplingRow  # its params, prompt, output before the drafts, and generator (as for the sampler)
    proposal: Sequence[int]  # the k draft tokens (k may be 0: plain decoding)
    draft_probs: torch.Tensor | None = None  # [k, V] the proposer's distributions q; None: deterministic (one-hot)


@dataclass
class Verified:
    """What one row appends: the accepted drafts, then one token of the target's own."""

    num_accepted: int
    token_ids: list[int]  # proposal[:num_accepted] + [corrected or bonus token]
    logprobs: list[TokenLogprob] | None  # one per appended token (raw-logit logprobs); None: not asked for


def _accept(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p/q): u < p/q for u ~ U[0, 1), written without the division."""
    return u * q_x < p_x


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row; p itself where that is all zero (q == 0 at the bonus position, or p == q)."""
    r = (p - q).clamp_min(0.0)  # [b, V]
    total = r.sum(dim=-1, keepdim=True)  # [b, 1]
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def _is_greedy(row: SpecRow) -> bool:
    return row.sampling.params.temperature < GREEDY_EPS


def _position_rows(rows: list[SpecRow]) -> list[SamplingRow]:
    """One SamplingRow per scored position (j = 0..k), its history extended by the drafts before it."""
    out = []
    for r in rows:
        s = r.sampling
        for j in range(len(r.proposal) + 1):
            output = list(s.output_token_ids) + list(r.proposal[:j]) if needs_history(s.params) else s.output_token_ids
            out.append(SamplingRow(s.params, s.prompt_token_ids, output, s.generator))
    return out


def _uniforms(counts: list[int], width: int, gens: list[torch.Generator | None],
              device: torch.device) -> torch.Tensor:
    """U[0, 1) per draft: seeded rows draw their k from their own generator, the others share one draw."""
    u = torch.rand(len(counts), width, device=device)  # [b, K]
    for i, (k, gen) in enumerate(zip(counts, gens)):
        if gen is not None and k > 0:
            u[i, :k] = torch.rand(k, device=device, generator=gen)
    return u


def _q_at_drafts(rows: list[SpecRow], drafts: torch.Tensor) -> torch.Tensor:
    """q(x_j) for each draft [b, K]: 1 for deterministic (one-hot) proposers."""
    q_x = torch.ones(drafts.shape, device=drafts.device)  # [b, K]
    for i, r in enumerate(rows):
        if r.draft_probs is not None and len(r.proposal):
            k = len(r.proposal)
            q = r.draft_probs.to(drafts.device, torch.float32)  # [k, V]
            q_x[i, :k] = q.gather(1, drafts[i, :k].unsqueeze(1)).squeeze(1)
    return q_x


def _q_at_stop(rows: list[SpecRow], drafts: torch.Tensor, nums: torch.Tensor, vocab: int) -> torch.Tensor:
    """q at each row's stopping position [b, V]: the rejected draft's distribution, all zero at the bonus position."""
    b, width = drafts.shape
    rejected = nums < to_device([len(r.proposal) for r in rows], torch.long, drafts.device)  # [b]
    q_stop = torch.zeros(b, vocab, device=drafts.device)  # [b, V]
    if width:
        stop_token = drafts.gather(1, nums.clamp_max(width - 1).unsqueeze(1))  # [b, 1]
        q_stop.scatter_(1, stop_token, rejected.float().unsqueeze(1))  # one-hot of the rejected draft
    for i, r in enumerate(rows):
        if r.draft_probs is not None and len(r.proposal):
            q_stop[i] = r.draft_probs[nums[i].clamp_max(len(r.proposal) - 1)].to(q_stop) * rejected[i]
    return q_stop


def _sampled(target: torch.Tensor, rows: list[SpecRow], drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for sampled rows. target: [b, K+1, V] processed probabilities. Returns (nums, tokens) [b]."""
    b, positions, vocab = target.shape
    counts = [len(r.proposal) for r in rows]
    gens = [r.sampling.generator for r in rows]
    valid = torch.arange(positions - 1, device=target.device) < to_device(counts, torch.long, target.device)[:, None]
    p_x = target[:, :-1].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [b, K]
    u = _uniforms(counts, positions - 1, gens, target.device)  # [b, K]
    nums = (_accept(p_x, _q_at_drafts(rows, drafts), u) & valid).long().cumprod(dim=1).sum(dim=1)  # [b]
    q_stop = _q_at_stop(rows, drafts, nums, vocab)  # [b, V]
    p_stop = target.gather(1, nums.view(b, 1, 1).expand(b, 1, vocab)).squeeze(1)  # [b, V]
    final = _residual(p_stop, q_stop)  # [b, V]
    return nums, (final / _exponential_noise(final, gens)).argmax(dim=-1)


def _logprobs(logits: torch.Tensor, appended: torch.Tensor, rows: list[SpecRow],
              nums: list[int]) -> list[list[TokenLogprob] | None]:
    """Raw-logit logprobs of the appended tokens (as the sampler reports them) for rows that ask for them."""
    wanted = [r.sampling.params.logprobs for r in rows]
    out: list[list[TokenLogprob] | None] = [None] * len(rows)
    index = [i for i, k in enumerate(wanted) if k is not None]
    if not index:
        return out
    sel = to_device(index, torch.long, logits.device)
    logprobs = logits[sel].float().log_softmax(dim=-1)  # [b, K+1, V]
    chosen = logprobs.gather(2, appended[sel].unsqueeze(2)).squeeze(2).tolist()  # [b, K+1]
    max_k = min(max(wanted[i] for i in index), logprobs.shape[2])  # type: ignore[type-var]
    top_vals, top_ids = (t.tolist() for t in logprobs.topk(max_k, dim=-1))  # [b, K+1, max_k]
    tokens = appended[sel].tolist()
    for row, i in enumerate(index):
        k = wanted[i]
        out[i] = [TokenLogprob(tokens[row][j], chosen[row][j],
                               [(tid, val) for tid, val in zip(top_ids[row][j][:k], top_vals[row][j][:k])
                                if val != -math.inf])
                  for j in range(nums[i] + 1)]
    return out


def verify(logits: torch.Tensor, rows: list[SpecRow]) -> list[Verified]:
    """Accept each row's drafts against the target logits [B, K+1, V] (row b uses its first k_b + 1 positions)."""
    batch, positions, vocab = logits.shape
    counts = [len(r.proposal) for r in rows]
    if batch != len(rows) or max(counts, default=0) >= positions:
        raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} rows with up to {max(counts, default=0)} "
                         "drafts (need [B, max k + 1, V])")
    device, width = logits.device, positions - 1
    drafts = to_device([list(r.proposal) + [0] * (width - len(r.proposal)) for r in rows], torch.long,
                       device).reshape(batch, width)  # [B, K]
    k = to_device(counts, torch.long, device)  # [B]
    scored = torch.arange(positions, device=device) <= k[:, None]  # [B, K+1] the positions each row uses
    sampled = [i for i, r in enumerate(rows) if not _is_greedy(r)]
    if sampled or any(changes_logits(r.sampling.params) for r in rows):
        pos_rows = _position_rows(rows)
        penalized = apply_penalties(logits[scored], pos_rows)  # [N, V] fp32, N = sum(k + 1), row-major
        argmax = torch.zeros(batch, positions, dtype=torch.long, device=device)  # [B, K+1]
        argmax[scored] = penalized.argmax(dim=-1)
    else:  # greedy rows on raw logits (the common case): no masked gather, whose index the host must first read
        argmax = logits.float().argmax(dim=-1)  # [B, K+1] (as apply_penalties gives it); positions past k unused
    # greedy: the drafts matching the argmax before the first mismatch, then the argmax there
    valid = scored[:, :-1]  # [B, K]
    nums = ((drafts == argmax[:, :-1]) & valid).long().cumprod(dim=1).sum(dim=1)  # [B]
    tokens = argmax.gather(1, nums.unsqueeze(1)).squeeze(1)  # [B]
    if sampled:
        flat = [j for j, r in enumerate(pos_rows) if r.params.temperature >= GREEDY_EPS]
        probs = apply_filters(penalized[to_device(flat, torch.long, device)], [pos_rows[j].params for j in flat])
        target = torch.zeros(len(sampled), positions, vocab, device=device)  # [b, K+1, V]
        index = to_device(sampled, torch.long, device)
        target[scored[index]] = probs.softmax(dim=-1).nan_to_num_(nan=0.0)
        nums[index], tokens[index] = _sampled(target, [rows[i] for i in sampled], drafts[index])
    appended = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1).scatter_(1, nums.unsqueeze(1),
                                                                            tokens.unsqueeze(1))  # [B, K+1]
    num_list, appended_list = nums.tolist(), appended.tolist()
    logprobs = _logprobs(logits, appended, rows, num_list)
    return [Verified(n, appended_list[i][:n + 1], logprobs[i]) for i, n in enumerate(num_list)]
