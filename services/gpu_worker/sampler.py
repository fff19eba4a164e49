"""The batched sampler: logit bias, penalties, temperature, top-k/top-p/min-p and seeded draws over one step's logits."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.gpu_worker.request import SamplingParams, TokenLogprob
from services.gpu_worker.staging import to_device

# Temperatures below this are treated as greedy (dividing by them would overflow fp32).
GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One sequence that needs a token this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # seeded per sequence when params.seed is set; None: global RNG


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def make_generator(seed: int | None, index: int, device: torch.device | str) -> torch.Generator | None:
    """A generator for sequence `index` of a request seeded with `seed`: distinct streams per index, reproducible."""
    if seed is None:
        return None
    mixed = _splitmix64((_splitmix64(seed & _MASK64) + index) & _MASK64)
    gen = torch.Generator(device=device)
    gen.manual_seed(mixed >> 1)  # manual_seed wants a value that fits in int64
    return gen


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_EPS


def _padded_ids(seqs: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0)
    rows = [list(s) + [pad] * (width - len(s)) for s in seqs]
    return to_device(rows, torch.long, device).reshape(len(seqs), width)  # [b, L]


def _token_counts(seqs: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each sequence; ids outside [0, vocab) are ignored."""
    ids = _padded_ids(seqs, vocab, device)  # [b, L]
    ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32, device=device)  # [b, V+1]
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]  # [b, V]


def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device).unsqueeze(1)  # [b, 1]


def _apply_repetition(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    idx = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not idx:
        return
    device, vocab = logits.device, logits.shape[1]
    seqs = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in idx]
    seen = _token_counts(seqs, vocab, device) > 0  # [b, V]
    penalty = _row_tensor([rows[i].params.repetition_penalty for i in idx], device)  # [b, 1]
    index = to_device(idx, torch.long, device)
    sub = logits[index]  # [b, V]
    penalized = torch.where(sub < 0, sub * penalty, sub / penalty)
    logits[index] = torch.where(seen, penalized, sub)


def _apply_frequency_presence(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    idx = [i for i, r in enumerate(rows) if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
    if not idx:
        return
    device, vocab = logits.device, logits.shape[1]
    counts = _token_counts([rows[i].output_token_ids for i in idx], vocab, device)  # [b, V]
    freq = _row_tensor([rows[i].params.frequency_penalty for i in idx], device)  # [b, 1]
    pres = _row_tensor([rows[i].params.presence_penalty for i in idx], device)  # [b, 1]
    index = to_device(idx, torch.long, device)
    logits[index] = logits[index] - freq * counts - pres * (counts > 0).float()


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Add each row's logit_bias in place; ids outside the vocabulary are ignored."""
    vocab = logits.shape[1]
    entries = [(i, token_id, bias) for i, r in enumerate(rows) for token_id, bias in r.params.logit_bias
               if token_id < vocab]
    if not entries:
        return
    row_ids, token_ids, biases = zip(*entries)
    index = (to_device(list(row_ids), torch.long, logits.device), to_device(list(token_ids), torch.long, logits.device))
    logits.index_put_(index, to_device(list(biases), torch.float32, logits.device), accumulate=True)


def changes_logits(params: SamplingParams) -> bool:
    """Penalties or a logit bias: the row's argmax may differ from the raw logits' argmax."""
    return needs_history(params) or bool(params.logit_bias)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Logit bias, repetition (over prompt + output) then frequency/presence (over output) penalties; returns new
    fp32 logits."""
    if not any(changes_logits(r.params) for r in rows):
        return logits.float()  # NOTE: no copy when nothing is penalised (callers do not write into it)
    out = logits.float().clone()  # [B, V] fp32
    _apply_logit_bias(out, rows)
    _apply_repetition(out, rows)
    _apply_frequency_presence(out, rows)
    return out


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask all but each row's top-k tokens (ties kept) and its top-p nucleus, in that order (HF semantics)."""
    device, vocab = logits.device, logits.shape[1]
    use_k, use_p = any(k > 0 for k in top_k), any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [b, V] ascending
    if use_k:
        k = to_device([min(k, vocab) if k > 0 else vocab for k in top_k], torch.long, device)  # [b]
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # [b, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if use_p:
        p = to_device(top_p, torch.float32, device).unsqueeze(1)  # [b, 1]
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [b, V]
        drop = (cum <= 1.0 - p) & (p < 1.0)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    if not any(m > 0.0 for m in min_p):
        return logits
    probs = logits.softmax(dim=-1)  # [b, V]
    threshold = _row_tensor(min_p, logits.device) * probs.amax(dim=-1, keepdim=True)  # [b, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _exponential_noise(probs: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise per row: seeded rows from their own generator, the others from one global draw."""
    noise = torch.empty_like(probs)  # [b, V]
    unseeded = [i for i, g in enumerate(gens) if g is None]
    if unseeded:
        index = to_device(unseeded, torch.long, probs.device)
        noise[index] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, gen in enumerate(gens):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, then min-p for non-greedy rows; filtered tokens become -inf. Returns fp32 logits."""
    out = logits.float() / _row_tensor([p.temperature for p in params], logits.device)  # [b, V] fp32
    out = _apply_top_k_top_p(out, [p.top_k for p in params], [p.top_p for p in params])
    return _apply_min_p(out, [p.min_p for p in params])


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Filters, then an exponential race: argmax(probs / Exp(1)) is distributed as Categorical(probs)."""
    probs = apply_filters(logits, [r.params for r in rows]).softmax(dim=-1).nan_to_num_(nan=0.0)  # [b, V]
    return (probs / _exponential_noise(probs, [r.generator for r in rows])).argmax(dim=-1)  # [b]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.is_cuda:  # torch's argmax reduces a row on one block: 27.5 µs for one 128k row on the H200
        from services.gpu_worker.kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def _next_tokens(logits: torch.Tensor, rows: list[SamplingRow], greedy: torch.Tensor | None = None) -> torch.Tensor:
    """greedy: argmax(logits) already on the device (a decode graph's output); sampled rows are written into it."""
    tokens = _argmax(logits) if greedy is None else greedy  # [B]
    sampled = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
    if sampled:
        index = to_device(sampled, torch.long, logits.device)
        tokens[index] = _sample(logits[index], [rows[i] for i in sampled])
    return tokens


def _logprob_tensors(raw: torch.Tensor, tokens: torch.Tensor,
                     rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The chosen tokens' raw-logit log-probabilities [B] and the top max-k alternatives [B, k] (values, ids)."""
    wanted = [r.params.logprobs for r in rows]
    if all(k is None for k in wanted):
        return None
    logprobs = raw.float().log_softmax(dim=-1)  # [B, V] fp32
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [B]
    max_k = min(max(k or 0 for k in wanted), logprobs.shape[1])
    top_vals, top_ids = logprobs.topk(max_k, dim=-1)  # [B, max_k]
    return chosen, top_vals, top_ids


class SampledBatch:
    """One step's sampled tokens, still on the device; resolve() brings them to the host.

    On CUDA the results are copied into pinned host memory behind an event right after sampling, so the
    host can queue the next step's work before it waits for these tokens (the engine's overlap mode).
    `tokens` stays on the device: the next step can feed it as input before the host has seen it.
    """

    def __init__(self, tokens: torch.Tensor, logprobs: tuple[torch.Tensor, ...] | None,
                 wanted: list[int | None]) -> None:
        self.tokens = tokens  # [B] int64 on the device
        self._wanted = wanted
        device_tensors = [tokens] if logprobs is None else [tokens, *logprobs]
        if tokens.device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in device_tensors]
            for host, dev in zip(self._host, device_tensors):
                host.copy_(dev, non_blocking=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = device_tensors, None
        self._resolved: tuple[list[int], list[TokenLogprob | None]] | None = None

    def resolve(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """Wait for this step's tokens (only this step's: later queued work keeps running)."""
        if self._resolved is None:
            if self._event is not None:
                self._event.synchronize()
            token_list = self._host[0].tolist()
            if len(self._host) == 1:
                logprobs: list[TokenLogprob | None] = [None] * len(token_list)
            else:
                chosen, top_vals, top_ids = (t.tolist() for t in self._host[1:])
                # alternatives a structured-output mask ruled out (logprob -inf) are left out: they cannot be
                # sampled, and JSON has no -inf (an encoder writes null where clients expect a number)
                logprobs = [None if k is None else
                            TokenLogprob(token_list[i], chosen[i], [(tid, val) for tid, val in
                                                                    zip(top_ids[i][:k], top_vals[i][:k])
                                                                    if val != -math.inf])
                            for i, k in enumerate(self._wanted)]
            self._resolved = token_list, logprobs
        return self._resolved


def needs_history(params: SamplingParams) -> bool:
    """Penalties read the sequence's earlier tokens, so its last token must be on the host first."""
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


class Sampler:
    """Picks one token per row from one step's logits and reports raw-logit logprobs."""

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow],
               greedy: torch.Tensor | None = None) -> SampledBatch:
        """Queue the sampling of one token per row on the logits' device; nothing waits for the GPU.

        greedy: argmax(logits, dim=-1) [B] int64 computed already (a CUDA graph's output). It is used, and its
        sampled rows overwritten in place, only when no row has penalties or a logit bias (they change the argmax)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        if any(changes_logits(r.params) for r in rows):
            greedy = None
        penalized = apply_penalties(logits, rows)  # [B, V] fp32
        tokens = _next_tokens(penalized, rows, greedy)  # [B]
        return SampledBatch(tokens, _logprob_tensors(logits, tokens, rows), [r.params.logprobs for r in rows])

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """launch() then resolve(): the tokens on the host at once."""
        return self.launch(logits, rows).resolve()
