"""The engine: the requests' lifecycle behind one step() call — admission and batching (batch_policy.py), the prefix
cache, sampling, stop checks, n > 1 forks, PD holds and imports — over a ModelRunner (model_runner.py: the model,
its paged KV cache, attention backend, CUDA graphs and forward pass).

Used offline (`Engine.generate`) by tests and benchmarks, and wrapped by the gpu_worker service.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import msgspec
import torch

from services.gpu_worker.batch_policy import BatchPolicy, StepPlan
from services.gpu_worker.block_pool import BlockPool
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.engine_metrics import EngineMetricsRecorder
from services.gpu_worker.model.loader import LoadedModel
from services.gpu_worker.model_runner import ModelRunner
from services.gpu_worker.prompt_logprobs import PromptLogprobBatch, PromptLogprobs
from services.gpu_worker.radix_cache import RadixCache
from services.gpu_worker.request import FinishReason, SamplingParams, TokenLogprob, TokenOutput
from services.gpu_worker.sampler import SampledBatch, Sampler, make_generator, needs_history
from services.gpu_worker.sequence import SeqStatus, Sequence
from services.gpu_worker.spec.adaptive import DraftCosts
from services.gpu_worker.spec.engine_step import Speculator, make_proposer
from services.gpu_worker.spec.verify import Verified
from services.gpu_worker.staging import to_device
from services.gpu_worker.structured_output import StructuredOutput
from shared.sampling import check_logit_bias_ids, context_length_error

PENDING_TOKEN = -1  # placeholder in token_ids for a token sampled on the device, not yet read by the host


@dataclass
class SequenceResult:
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None


@dataclass
class RequestResult:
    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    samples: list[SequenceResult] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs: None first


@dataclass(frozen=True)
class Handoff:
    """PD prefill side: a prefill-only request sampled its first token; its prompt pages are held."""

    request_id: str
    first_token: int
    first_logprob: TokenLogprob | None
    page_ids: list[int]  # the prompt's pages, in order (the last may be partial)
    num_cached_tokens: int


@dataclass(frozen=True)
class ImportPlan:
    """PD decode side: where an imported prompt's pages live here, and which of them must be pulled.

    page_ids[i] is this worker's page for prompt page i; pages [num_reused_pages:] need the source's data.
    is_recompute: the pool had no room, so the request was queued to prefill locally instead.
    """

    page_ids: list[int]
    num_reused_pages: int
    is_recompute: bool = False

    @property
    def page_indices_to_fill(self) -> list[int]:
        return list(range(self.num_reused_pages, len(self.page_ids)))


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens the host has not read yet (see Engine.step)."""

    sample: SampledBatch | None
    seqs: list[Sequence]  # one per sampled row (new n > 1 siblings included)
    positions: list[int]  # where each row's token goes in its sequence's token_ids
    forks: list[tuple[Sequence, list[Sequence]]]
    uncached: list[Sequence]  # filled a page ending with the previous step's (then pending) token
    needs_history: bool  # a row has penalties: its token must reach the host before the next sampling
    prompt: PromptLogprobBatch | None = None  # prompt logprobs this step computed
    unsampled: list[Sequence] = field(default_factory=list)  # max_tokens 0: prefilled, they end when it resolves
    early_outputs: list[TokenOutput] | None = None  # read by the next step's launch (see _constrain)
    verified: list[tuple[Sequence, Verified]] = field(default_factory=list)  # speculative rows, verified already


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_total_pages: int
    num_cached_pages: int
    num_preemptions: int
    num_steps: int


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.runner = ModelRunner(config, loaded)  # the model, its KV pool, backend and CUDA graphs
        self.pool = BlockPool(self.num_pages)
        cache_cls = RadixCache
        if self.tp is not None:
            from services.gpu_worker.parallel.lockstep_cache import LockstepRadixCache  # rank 0's clock

            cache_cls = LockstepRadixCache
        self.cache = cache_cls(self.pool, config.page_size, self.model_config.model_id,
                               is_enabled=config.enable_prefix_cache)
        self.policy = BatchPolicy(self.pool, self.cache, config.page_size, self.batching.max_num_batched_tokens,
                                  self.batching.max_num_seqs, config.enable_chunked_prefill)
        self.policy.min_admit_batch = config.resolved_min_admit_batch(self.graphs is not None)
        self.policy.max_admit_delay_steps = config.max_admit_delay_steps
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.structured = StructuredOutput(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids),
                                           self.device)
        self._requests: dict[str, list[Sequence]] = {}
        self._held: dict[str, Sequence] = {}  # PD prefill side: prompt pages kept under a lease
        self._importing: dict[str, Sequence] = {}  # PD decode side: pages being filled by a pull
        self._handoffs: list[Handoff] = []
        self._next_seq_id = 0
        self._num_steps = 0
        self.metrics = EngineMetricsRecorder()
        self.is_overlapped = config.resolved_overlap()
        self.speculator = None if config.speculative_method is None else Speculator(
            make_proposer(config, self.model_config, self.tokenizer, self.num_pages, Engine), config.num_speculative_tokens,
            config.speculative_max_batch_size, lambda: self.metrics,
            DraftCosts.for_engine(self.device.type, self.is_overlapped))
        self._launched: LaunchedStep | None = None
        self.warmup_seconds = self.warm_up() if config.resolved_warmup(self.backend.name) else 0.0

    # The runner's parts, under the names the engine's callers use (the service, TP, benchmarks, tests)
    model = property(lambda self: self.runner.model)
    model_config = property(lambda self: self.runner.model_config)
    tokenizer = property(lambda self: self.runner.tokenizer)
    device = property(lambda self: self.runner.device)
    tp = property(lambda self: self.runner.tp)
    kv = property(lambda self: self.runner.kv)
    backend = property(lambda self: self.runner.backend)
    graphs = property(lambda self: self.runner.graphs)
    verify_graphs = property(lambda self: self.runner.verify_graphs)
    batching = property(lambda self: self.runner.batching)
    num_pages = property(lambda self: self.runner.num_pages)
    weights = property(lambda self: self.runner.weights)
    allocator_idle_bytes = property(lambda self: self.runner.allocator_idle_bytes)
    max_model_len = property(lambda self: self.runner.max_model_len)
    max_seq_len = property(lambda self: self.runner.max_seq_len)

    def warm_up(self) -> float:
        """Run a few steps of made-up requests so Triton compiles the eager path's kernels now rather than inside the
        first requests served (each compile takes a second or more on the H200; the CUDA graphs' capture already
        compiled the decode steps'). Prefill chunks above and below the split-K limit, mixed steps, decode steps;
        then the prefix cache and its events, the step count and the graph replay counts are as before. → seconds."""
        start = time.perf_counter()
        if self.max_seq_len < 16:  # a pool too small for the made-up requests
            return 0.0
        longest = min(64, self.batching.max_num_batched_tokens, self.max_seq_len - 8)
        vocab = self.model_config.vocab_size
        prompts = [[1 + (7 * i + j) % (vocab - 1) for j in range(n)]
                   for i, n in enumerate((longest, min(5, longest), longest // 2 + 1))]
        self.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        if self.cache.num_cached_pages:
            self.cache.clear()
        self.cache.drain_events()
        self._num_steps = 0
        self.metrics = EngineMetricsRecorder()
        if self.graphs is not None:
            self.graphs.num_replays = 0
        if self.verify_graphs is not None:
            self.verify_graphs.num_replays = 0
        return time.perf_counter() - start

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    is_prefill_only: bool = False, arrival_s: float | None = None) -> None:
        """Queue a request; raises ValueError for a prompt that can never run.

        is_prefill_only (PD prefill side): after the first token the request stops here and its prompt
        pages are held (see drain_handoffs / release_held), unless that token already ended it.
        arrival_s: when the request arrived (unix time; default now), the start of its queue time.
        """
        params = self._fit_default_max_tokens(prompt_token_ids, params)
        self._validate(request_id, prompt_token_ids, params.max_tokens)
        check_logit_bias_ids(params.logit_bias, self.model_config.vocab_size)
        if is_prefill_only and params.n > 1:
            raise ValueError("a prefill-only request must have n == 1")
        seq = self._new_sequence(request_id, 0, list(prompt_token_ids), params)
        seq.is_prefill_only = is_prefill_only
        if arrival_s is not None:  # NOTE: Sequence.arrival is monotonic; the wire's arrival_s is unix time
            seq.arrival -= max(0.0, time.time() - arrival_s)
        self._requests[request_id] = [seq]
        self.policy.add(seq)

    def drain_handoffs(self) -> list[Handoff]:
        """Prefill-only requests that sampled their first token since the last call (their pages are held)."""
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def release_held(self, request_id: str) -> bool:
        """Free a held prefill-only request's pages (lease released, expired or aborted)."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        self.policy.release(seq)
        return True

    def export_pages(self, page_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these pages, each [num_layers, len(page_ids), page_size, num_kv_heads, head_dim]."""
        return self.runner.export_pages(page_ids)

    def import_request(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                       params: SamplingParams, num_cached_tokens: int = 0) -> ImportPlan:
        """PD decode side: take over a request another worker prefilled.

        Matches this worker's own cache and allocates only the pages it lacks; the caller fills pages
        page_indices_to_fill (a pull) and then calls finish_import. With no room in the pool the request
        is queued to recompute its prompt here instead (is_recompute; nothing to pull).
        """
        params = self._fit_default_max_tokens(prompt_token_ids, params)
        self._validate(request_id, prompt_token_ids, params.max_tokens)
        if params.n > 1:
            raise ValueError("an imported request must have n == 1")
        seq = self._new_sequence(request_id, 0, [*prompt_token_ids, first_token], params)
        seq.num_prompt_tokens = len(prompt_token_ids)
        if seq.matcher is not None:  # the prefill worker's mask chose first_token
            self.structured.accept(seq.matcher, first_token)
        seq.prompt_logprobs = None  # the prefill worker sent them with the first token
        self._requests[request_id] = [seq]
        num_reused = self.policy.reserve_import(seq, time.monotonic())
        seq.num_cached_tokens = num_cached_tokens
        seq.was_admitted = True  # keep num_cached_tokens: the prefill worker's cache served those
        if num_reused is None:
            self.policy.add(seq)
            return ImportPlan([], 0, is_recompute=True)
        self._importing[request_id] = seq
        return ImportPlan(list(seq.page_ids), num_reused)

    def finish_import(self, request_id: str, is_filled: bool) -> bool:
        """The pull ended: join the decode batch (is_filled), or recompute the prompt here (pull failed).

        Returns False when the request was aborted meanwhile (its pages are freed now, not earlier:
        a pull may write into them until it ends).
        """
        seq = self._importing.pop(request_id)
        if seq.finish_reason is not None:
            self.policy.release(seq)
            return False
        if is_filled:
            self.policy.join_imported(seq, time.monotonic())
        else:
            self.policy.release(seq)
            self.policy.add(seq)
        return True

    def _fit_default_max_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """A max_tokens the client did not set is clipped to the context the prompt leaves (OpenAI's behaviour)."""
        room = self.max_model_len - len(prompt_token_ids)
        if params.is_max_tokens_default and 0 < room < params.max_tokens:
            return msgspec.structs.replace(params, max_tokens=room)
        return params

    def _validate(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) + max_tokens > self.max_model_len:  # NOTE: a SamplingError, so a 400 with its code
            raise context_length_error(self.max_model_len, len(prompt_token_ids), max_tokens)
        if len(prompt_token_ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens and does not fit in the KV cache "
                             f"even when it runs alone ({self.max_seq_len} token slots, one kept for output)")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def _new_sequence(self, request_id: str, index: int, token_ids: list[int],
                      params: SamplingParams) -> Sequence:
        seq = Sequence(seq_id=self._next_seq_id, request_id=request_id, index=index, token_ids=token_ids,
                       num_prompt_tokens=len(token_ids), params=params, arrival=time.monotonic(),
                       generator=make_generator(params.seed, index, self.device),
                       logprobs=[] if params.logprobs is not None else None)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = PromptLogprobs.for_prompt(len(token_ids), params.prompt_logprobs)
        if params.output_constraint is not None:  # ValueError (a 400) when it does not compile
            seq.matcher = self.structured.new_matcher(params.output_constraint)
        self._next_seq_id += 1
        return seq

    def abort(self, request_id: str) -> list[TokenOutput]:
        """Stop a request now and free its pages; unknown or finished ids are ignored."""
        outputs = []
        self.release_held(request_id)
        for seq in self._requests.pop(request_id, []):
            if seq.status is SeqStatus.IMPORTING:  # NOTE: pages stay until finish_import (a pull may be writing)
                seq.finish_reason = FinishReason.ABORT
                outputs.append(self._output(seq, []))
            elif not seq.is_finished:
                self.policy.finish(seq, time.monotonic())
                seq.finish_reason = FinishReason.ABORT
                outputs.append(self._output(seq, []))
            _drop_pending(seq)
        return outputs

    def has_unfinished(self) -> bool:
        """Work is left: queued or running sequences, or a launched step with a live row to read."""
        launched = self._launched
        return self.policy.num_unfinished > 0 or (
            launched is not None and any(seq.finish_reason is None for seq in launched.seqs))

    def flush(self) -> list[TokenOutput]:
        """Read the launched step's tokens now (overlap mode), without starting another step."""
        launched, self._launched = self._launched, None
        return [] if launched is None else self._resolve(launched, time.monotonic())

    def step(self) -> list[TokenOutput]:
        """Run one batch of mixed prefill chunks and decodes; return the tokens produced.

        Serial mode: schedule, run, sample, read the tokens, return them. Overlap mode (on by default on
        CUDA): schedule and queue step N+1 on the device *before* reading step N's tokens, so the host's
        work (scheduling, building inputs, bookkeeping, the caller's output handling) runs while the GPU
        computes. Step N's sampled tokens are fed to step N+1 on the device (placeholders on the host); a
        sequence that step N ended (EOS, a stop id) costs one discarded row in step N+1, and one ending by
        length or a PD hold is not scheduled again. Returns the tokens of the step that was read.
        """
        started_s = time.perf_counter()
        now = time.monotonic()
        outputs: list[TokenOutput] = []
        previous = self._launched
        if previous is not None and (previous.needs_history or self._wants_host_tokens()):
            outputs += self._resolve(previous, now)
            previous = self._launched = None
        if self.speculator is not None:
            self.speculator.propose(self.policy.running, self.max_seq_len)
        plan = self.policy.schedule(now)
        self._record_admitted(plan, now)
        launched = self._launch(plan, now) if plan.items else None
        if previous is not None:
            outputs += self._resolve(previous, now)
        if launched is not None:
            for seq in launched.uncached:  # their newest page ends with a token `previous` just resolved
                self.policy.cache_computed(seq, now)
        self._launched = launched
        # NOTE: a step that verified drafts is read at once, even in overlap mode: the next plan needs its accepted
        # counts (how far each sequence's KV got, which pages to keep), so speculating steps do not overlap
        if launched is not None and (not self.is_overlapped or launched.verified):
            outputs += self._resolve(launched, now)
            self._launched = None
        if plan.items:
            self.metrics.on_step(plan.num_tokens, len(plan.items), time.perf_counter() - started_s)
        return outputs

    def _record_admitted(self, plan: StepPlan, now: float) -> None:
        """Count the sequences this plan admits for the first time (prompt, prefix-cache match, queue time)."""
        for seq in plan.admitted:
            if seq.num_preemptions == 0 and seq.num_output_tokens == 0:  # not a re-admission, not a PD import
                self.metrics.on_first_admission(seq.num_prompt_tokens, seq.num_cached_tokens, now - seq.arrival)

    def _wants_host_tokens(self) -> bool:
        """Speculation may draft for a sequence whose last token the launched step has not given the host yet."""
        return self.speculator is not None and self.speculator.wants_host_tokens(self.policy.running)

    def _previous_tokens(self) -> torch.Tensor:
        """The launched step's sampled tokens [B_prev] int64, on the device (the host has not read them yet)."""
        assert self._launched is not None and self._launched.sample is not None, "a placeholder outlived its step"
        return self._launched.sample.tokens

    def _launch(self, plan: StepPlan, now: float) -> LaunchedStep:
        """Queue the forward and the sampling of one step; placeholders stand for its tokens."""
        self._num_steps += 1
        ends = [item for item in plan.items if item.is_sampling]
        unsampled = [item.seq for item in ends if item.seq.params.max_tokens == 0]
        if unsampled:
            ends = [item for item in ends if item.seq.params.max_tokens > 0]
        logits, greedy, prompt = self._forward(plan)
        verified: list[tuple[Sequence, Verified]] = []
        if any(item.num_draft_tokens for item in ends):  # speculative rows: verified now; the rest sample below
            logits, ends, verified = self.speculator.verify(logits, ends)
        if self.speculator is not None:
            self.speculator.end_step()
        uncached = []
        for seq in self.policy.advance(plan):
            if seq.num_computed <= seq.num_known_tokens:
                self.policy.cache_computed(seq, now)
            else:
                uncached.append(seq)
        seqs: list[Sequence] = []
        rows: list[int] = []
        forks: list[tuple[Sequence, list[Sequence]]] = []
        for seq in unsampled:
            seq.stops_when_resolved = True
        for i, item in enumerate(ends):
            group = [item.seq]
            if item.seq.params.n > 1 and item.seq.index == 0 and not item.seq.is_forked:
                children = self._make_children(item.seq)
                forks.append((item.seq, children))
                group += children
            seqs += group
            rows += [i] * len(group)
        if not seqs:
            return LaunchedStep(None, [], [], [], uncached, False, prompt, unsampled, verified=verified)
        if forks:  # NOTE: without siblings the logit rows are the sampled rows already, in order
            logits, greedy = logits[to_device(rows, torch.long, logits.device)], None
        positions = []
        for row, seq in enumerate(seqs):
            positions.append(len(seq.token_ids))
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_pending += 1
            seq.pending_row = row
            seq.stops_when_resolved = (seq.is_prefill_only or seq.num_output_tokens >= seq.params.max_tokens
                                       or seq.num_tokens >= self.max_seq_len)
        if any(seq.matcher is not None for seq in seqs):
            logits, greedy = self._constrain(logits, seqs, now), None
        sample = self.sampler.launch(logits, [s.sampling_row() for s in seqs], greedy)
        return LaunchedStep(sample, seqs, positions, forks, uncached,
                            any(needs_history(s.params) for s in seqs), prompt, unsampled, verified=verified)

    def _resolve(self, launched: LaunchedStep, now: float) -> list[TokenOutput]:
        """Read a launched step's tokens: prompt logprobs, stop checks, n > 1 starts, finishes, PD holds, outputs."""
        if launched.early_outputs is not None:  # read already, by the next step's launch (see _constrain)
            return launched.early_outputs
        if launched.prompt is not None:
            launched.prompt.apply()
        outputs = [out for seq in launched.unsampled if seq.finish_reason is None
                   for out in self._finish_unsampled(seq, now)]
        outputs += [self._apply_verified(seq, result, now) for seq, result in launched.verified
                    if seq.finish_reason is None]
        if launched.sample is None:
            return outputs
        token_ids, logprobs = launched.sample.resolve()
        live: list[tuple[Sequence, int, TokenLogprob | None]] = []
        for seq, position, token_id, logprob in zip(launched.seqs, launched.positions, token_ids, logprobs):
            if seq.finish_reason is not None:  # aborted, or ended by an earlier step's token
                continue
            seq.token_ids[position] = token_id
            seq.num_pending -= 1
            if seq.logprobs is not None and logprob is not None:
                seq.logprobs.append(logprob)
            seq.finish_reason = self._stop_reason(seq, token_id, position + 1)
            if seq.matcher is not None and self.structured.accept(seq.matcher, token_id):
                seq.finish_reason = FinishReason.STOP  # structured output: the grammar is complete
            live.append((seq, token_id, logprob))
        for parent, children in launched.forks:
            if parent.finish_reason is not FinishReason.ABORT:
                self._start_children(parent, [c for c in children if c.finish_reason is None])
        for seq, _, _ in live:
            if seq.finish_reason is not None:
                _drop_pending(seq)  # the token a later step was computing from the ending one
                self.policy.finish(seq, now)
            elif seq.is_prefill_only:
                self._hold(seq, now)
        self.metrics.on_generated(len(live))
        return outputs + [self._output(seq, [t], [lp] if lp is not None else None) for seq, t, lp in live]

    def _apply_verified(self, seq: Sequence, result: Verified, now: float) -> TokenOutput:
        """A speculative row's tokens (accepted drafts, then the target's own), each checked for a stop in order and
        those after a stop dropped; the KV of the drafts kept stays, the rest is rolled back."""
        kept: list[int] = []
        for token_id in result.token_ids:
            seq.token_ids.append(token_id)
            kept.append(token_id)
            seq.finish_reason = self._stop_reason(seq, token_id, seq.num_tokens)
            if seq.finish_reason is not None:
                break
        logprobs = None if result.logprobs is None else result.logprobs[:len(kept)]
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.extend(logprobs)
        self.policy.commit_drafts(seq, min(result.num_accepted, len(kept)), now)
        if seq.finish_reason is not None:
            self.policy.finish(seq, now)
        self.metrics.on_generated(len(kept))
        return self._output(seq, kept, logprobs)

    def _finish_unsampled(self, seq: Sequence, now: float) -> list[TokenOutput]:
        """max_tokens 0: the prompt is computed (its logprobs are in); each of the n samples ends with no token."""
        seq.stops_when_resolved = False
        seq.finish_reason = FinishReason.LENGTH
        self.policy.finish(seq, now)
        first = self._output(seq, [])
        return [first, *(dataclasses.replace(first, index=index) for index in range(1, seq.params.n))]

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None, PromptLogprobBatch | None]:
        """The step's forward on the runner (model_runner.py): sampling rows' logits, a graph's argmax, prompt
        logprobs."""
        return self.runner.forward(plan, self._previous_tokens)

    def _constrain(self, logits: torch.Tensor, seqs: list[Sequence], now: float) -> torch.Tensor:
        """Structured output: mask the constrained rows' logits [B, V] in place. A row's mask needs its sequence's
        previous token, so in overlap mode the launched step is read first (its outputs are kept for step() to return),
        after this step's forward is queued: the bitmask is filled on the CPU while the device runs it."""
        previous = self._launched
        if previous is not None and previous.early_outputs is None:
            previous.early_outputs = self._resolve(previous, now)
        bitmask, rows = self.structured.fill_bitmask([s.matcher if s.finish_reason is None else None for s in seqs])
        return self.structured.apply(logits, bitmask, rows) if rows else logits

    def _hold(self, seq: Sequence, now: float) -> None:
        self.policy.hold(seq, now)
        self._requests.pop(seq.request_id, None)
        self._held[seq.request_id] = seq
        num_prompt_pages = -(-seq.num_prompt_tokens // self.config.page_size)
        first_logprob = seq.logprobs[-1] if seq.logprobs else None
        self._handoffs.append(Handoff(seq.request_id, seq.token_ids[-1], first_logprob,
                                      list(seq.page_ids[:num_prompt_pages]), seq.num_cached_tokens))

    def _make_children(self, parent: Sequence) -> list[Sequence]:
        """A request with n > 1 samples: siblings 1..n-1 share the parent's one prompt pass."""
        parent.is_forked = True
        prompt = parent.token_ids[: parent.num_prompt_tokens]
        children = [self._new_sequence(parent.request_id, i, list(prompt), parent.params)
                    for i in range(1, parent.params.n)]
        for child in children:
            child.prompt_logprobs = parent.prompt_logprobs  # computed once, by the parent's prompt pass
        self._requests[parent.request_id].extend(children)
        return children

    def _start_children(self, parent: Sequence, children: list[Sequence]) -> None:
        copies = self.policy.fork(parent, children)
        if copies:
            self.kv.copy_pages([c.src_page_id for c in copies], [c.dst_page_id for c in copies])

    def _stop_reason(self, seq: Sequence, token_id: int, num_tokens: int) -> FinishReason | None:
        """Why seq ends with token_id as its num_tokens-th token, or None."""
        params = seq.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _output(self, seq: Sequence, token_ids: list[int],
                logprobs: list[TokenLogprob] | None = None) -> TokenOutput:
        """seq's output; its first once its prompt logprobs are complete carries them."""
        prompt_logprobs = None
        wanted = seq.prompt_logprobs
        if wanted is not None and wanted.is_complete and not seq.has_sent_prompt_logprobs:
            seq.has_sent_prompt_logprobs = True
            prompt_logprobs = wanted.as_output()
        return TokenOutput(request_id=seq.request_id, index=seq.index, token_ids=token_ids,
                           logprobs=logprobs if seq.logprobs is not None else None,
                           finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
                           num_cached_tokens=seq.num_cached_tokens, prompt_logprobs=prompt_logprobs)

    def release_finished(self, request_id: str) -> None:
        """Forget a request whose samples have all finished."""
        seqs = self._requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self._requests[request_id]

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.policy.running), num_waiting=len(self.policy.waiting),
                           num_free_pages=self.pool.num_free, num_total_pages=self.num_pages - 1,
                           num_cached_pages=self.cache.num_cached_pages,
                           num_preemptions=self.policy.num_preemptions,
                           num_steps=self._num_steps)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestResult]:
        """Run prompts to completion, all submitted at once; results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._next_seq_id}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.add_request(request_id, prompt, p)
        while any(not s.is_finished for rid in ids for s in self._requests[rid]):
            self.step()
        self.flush()  # a step launched before the last sequence ended holds only discarded rows
        results = [self._result(rid) for rid in ids]
        for rid in ids:
            self.release_finished(rid)
        return results

    def _result(self, request_id: str) -> RequestResult:
        seqs = sorted(self._requests[request_id], key=lambda s: s.index)
        first = seqs[0]
        return RequestResult(request_id, first.token_ids[: first.num_prompt_tokens], first.num_cached_tokens,
                             [SequenceResult(s.output_token_ids, s.finish_reason, s.logprobs) for s in seqs],
                             first.prompt_logprobs.as_output() if first.prompt_logprobs is not None else None)


def _drop_pending(seq: Sequence) -> None:
    """Forget the placeholders of tokens an ended sequence will never get."""
    if seq.num_pending:
        del seq.token_ids[-seq.num_pending:]
        seq.num_pending = 0
    seq.stops_when_resolved = False
