"""Continuous batching: which sequences run in the next engine step, with how many new tokens each.

Pure core: no tensors, no clocks (time is passed in). Per step it spends a token budget on every
running decode first (one token each), then on unfinished prefill chunks, then admits waiting
sequences, chunking long prompts so they cannot stall decodes. While sequences wait, long prompt chunks
leave part of the budget to admission, so a short request is not stuck behind long prompts. Pages are taken on demand as
sequences grow, never reserved up front for max_tokens. When the pool runs dry it first evicts
unlocked prefix-cache pages, then preempts the newest running sequence (its KV is recomputed later).
Eviction runs in batches: a pool that runs dry frees a little more than asked (EVICT_BATCH_FRACTION of
the pool), so a step of hundreds of growing decodes evicts once, not once per sequence.
"""
from __future__ import annotations

from collections import deque
from enum import Enum
from dataclasses import dataclass, field

from services.gpu_worker.block_pool import BlockPool, OutOfPages
from services.gpu_worker.radix_cache import RadixCache
from services.gpu_worker.sequence import Sequence, SeqStatus
from shared.hashing import hash_blocks

EVICT_BATCH_FRACTION = 1 / 256  # of the pool's pages, freed beyond the shortfall when eviction runs
RUNNING_PER_ADMITTED = 16  # admission in batches asks for one sequence per this many running (see _defers_admission)
LONG_PREFILL_DIVISOR = 4  # a prompt is long past max_num_batched_tokens / this many tokens left to compute


@dataclass
class ScheduledItem:
    seq: Sequence
    num_new_tokens: int
    is_sampling: bool  # this chunk reaches the end of the sequence: a token is sampled from it
    # Speculative decoding: the last num_draft_tokens of num_new_tokens are seq.draft_token_ids[:num_draft_tokens],
    # fed after its last token and scored for verification; their KV stays only where verification accepts them
    num_draft_tokens: int = 0


@dataclass
class StepPlan:
    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the waiting queue by this plan

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items)


@dataclass
class PageCopy:
    """Copy-on-write of a shared partial page when a request forks into n samples."""

    src_page_id: int
    dst_page_id: int


class Deferred(Enum):
    """_admit's answer for a sequence that waits for a page another sequence is computing."""

    WAIT_FOR_PREFIX = "wait_for_prefix"


class BatchPolicy:
    def __init__(self, pool: BlockPool, cache: RadixCache, page_size: int,
                 max_num_batched_tokens: int, max_num_seqs: int, is_chunked_prefill: bool = True,
                 min_admit_batch: int = 1, max_admit_delay_steps: int = 0) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.pool, self.cache, self.page_size = pool, cache, page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.is_chunked_prefill = is_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_evict_batch_pages = int(pool.capacity * EVICT_BATCH_FRACTION)
        # Admission in batches: a step of decodes alone takes new sequences only once min_admit_batch of them can
        # start together, or after max_admit_delay_steps steps of waiting (see _defers_admission)
        self.min_admit_batch, self.max_admit_delay_steps = min_admit_batch, max_admit_delay_steps
        # A prompt with more than this left to compute is long: while sequences wait, long prompt chunks together take
        # at most the step budget less this many tokens (see _reserve_for_waiting)
        self.long_prefill_tokens = max(page_size, max_num_batched_tokens // LONG_PREFILL_DIVISOR)
        self.num_deferred_steps = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        # decodes, then short prompt chunks, then long ones (a stable sort keeps each group's order)
        ordered = sorted(self.running, key=lambda s: (s.num_uncomputed > 1, s.num_uncomputed > self.long_prefill_tokens))
        long_allowance: int | None = None  # set at the first long prompt chunk
        held_back: list[Sequence] = []  # long prompts cut short for the waiting; they get what admission leaves
        num_spare = budget - sum(1 for s in ordered if s.num_uncomputed == 1)  # for drafts: every decode keeps 1
        for seq in ordered:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.stops_when_resolved:
                continue  # preempted earlier in this loop, or ends with the token still on the device
            num_new = min(seq.num_uncomputed, budget)
            num_drafts = 0
            if seq.draft_token_ids and seq.num_uncomputed == 1:
                num_drafts = max(0, min(len(seq.draft_token_ids), num_spare, budget - 1))
                del seq.draft_token_ids[num_drafts:]
                num_spare -= num_drafts
                num_new += num_drafts
                if num_drafts and not self._reserve(seq, num_new):  # drafts never preempt: no pages, no drafts
                    num_new, num_drafts = num_new - num_drafts, 0
                    seq.draft_token_ids.clear()
            if self.is_chunked_prefill and seq.num_uncomputed > self.long_prefill_tokens:
                if long_allowance is None:
                    long_allowance = budget - self._reserve_for_waiting(budget)
                if num_new > long_allowance:
                    num_new = long_allowance
                    held_back.append(seq)
                long_allowance -= num_new
                if num_new == 0:
                    continue
            if self._reserve_or_preempt(seq, num_new, plan, now):
                plan.items.append(ScheduledItem(seq, num_new, num_new - num_drafts == seq.num_uncomputed, num_drafts))
                budget -= num_new
        self._admit_waiting(plan, budget, now)
        if held_back:
            self._give_back(plan, held_back)
        return plan

    def _reserve_for_waiting(self, budget: int) -> int:
        """Tokens of this step that long prompt chunks leave for admitting waiting sequences (issue 31, item 5: a
        short request behind long prompts starts within a few steps instead of after all of them)."""
        return min(self.long_prefill_tokens, budget // 2) if self.waiting else 0

    def _give_back(self, plan: StepPlan, held_back: list[Sequence]) -> None:
        """Budget that admission left unused goes to the long prompt chunks that were cut for it, in order."""
        budget = self.max_num_batched_tokens - plan.num_tokens
        items = {id(item.seq): item for item in plan.items}
        for seq in held_back:
            if budget == 0 or seq.status is not SeqStatus.RUNNING:
                break
            item = items.get(id(seq))
            num_now = item.num_new_tokens if item is not None else 0
            num_new = min(seq.num_uncomputed, num_now + budget)
            if not self._reserve(seq, num_new):
                break
            if item is None:
                item = ScheduledItem(seq, num_new, False)
                plan.items.append(item)
            item.num_new_tokens, item.is_sampling = num_new, num_new == seq.num_uncomputed
            budget -= num_new - num_now

    def _admit_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
        """Admit waiting sequences in arrival order while budget, pages and seats last.

        In-batch prefix sharing: a sequence whose next page another sequence is computing right now
        (the same system prompt, arriving together) waits, and finds that page in the cache a step
        later instead of computing it a second time.
        """
        if self._defers_admission(plan):
            self.num_deferred_steps += 1
            return
        self.num_deferred_steps = 0
        in_flight = self._pages_in_flight()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            item = self._admit(seq, budget, now, is_first=not plan.items, in_flight=in_flight)
            if item is None:
                break
            self.waiting.popleft()
            if item is Deferred.WAIT_FOR_PREFIX:
                deferred.append(seq)
                continue
            plan.items.append(item)
            plan.admitted.append(seq)
            budget -= item.num_new_tokens
            if self.cache.is_enabled:
                in_flight.update(self._block_hashes(seq)[seq.num_computed // self.page_size:])
        self.waiting.extendleft(reversed(deferred))

    def _defers_admission(self, plan: StepPlan) -> bool:
        """Whether a step of decodes alone leaves the waiting sequences for a later step.

        A step with a prompt chunk runs eager; one of decodes alone replays a CUDA graph. On the H200 an eager step of
        Llama-8B costs the host ~36 ms to launch against ~3 ms for a replay, so admitting the one or two sequences
        that finish each step made every step eager and the host the bottleneck (W6 offline: 6,849-8,261 tok/s, the
        host waiting for the GPU 0.3-1.7 % of the time; admitting 16 at once: 11,228-11,309, docs/PERFORMANCE.md).
        So waiting sequences start together, min(min_admit_batch, running / RUNNING_PER_ADMITTED) of them at least,
        or after max_admit_delay_steps steps of waiting; never held when few run (that batch is then 1), when
        nothing runs, or when a prompt chunk is in the step already."""
        if self.min_admit_batch <= 1 or not self.waiting or not plan.items:
            return False
        if any(item.num_new_tokens > 1 for item in plan.items):
            return False
        batch = min(self.min_admit_batch, len(self.running) // RUNNING_PER_ADMITTED)
        num_ready = min(self.max_num_seqs - len(self.running), len(self.waiting))
        return num_ready < batch and self.num_deferred_steps < self.max_admit_delay_steps

    def _pages_in_flight(self) -> set[int]:
        """Block hashes of full pages that running sequences have yet to compute."""
        if not self.cache.is_enabled:
            return set()
        pending: set[int] = set()
        for seq in self.running:
            if seq.num_uncomputed > 1:
                pending.update(self._block_hashes(seq)[seq.num_computed // self.page_size:])
        return pending

    def _block_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of seq's full pages, extended as its tokens grow (cached on the sequence)."""
        known = seq.block_hashes
        num_full = seq.num_known_tokens // self.page_size  # NOTE: never hash a pending placeholder
        if len(known) < num_full:
            start = len(known) * self.page_size
            known.extend(hash_blocks(seq.token_ids[start:num_full * self.page_size], self.page_size,
                                     self.cache.salt, known[-1] if known else None))
        return known

    def _waits_for_prefix(self, seq: Sequence, in_flight: set[int]) -> bool:
        if not self.cache.is_enabled:
            return False
        next_page = seq.num_computed // self.page_size
        num_cacheable = seq.num_reusable_tokens // self.page_size  # the pages match_prefix could reuse
        hashes = self._block_hashes(seq)
        return next_page < min(num_cacheable, len(hashes)) and hashes[next_page] in in_flight

    def _reserve_or_preempt(self, seq: Sequence, num_new: int, plan: StepPlan, now: float) -> bool:
        """Give seq pages for num_new more tokens, evicting cache then preempting newer sequences."""
        scheduled = None  # built only when the pool runs dry: O(B) per step, not O(B^2)
        while not self._reserve(seq, num_new):
            scheduled = scheduled or {id(item.seq) for item in plan.items}
            victims = [s for s in self.running
                       if id(s) not in scheduled and s is not seq and not s.stops_when_resolved]
            victim = victims[-1] if victims else seq
            self.preempt(victim, now)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _reserve(self, seq: Sequence, num_new: int) -> bool:
        num_needed = -(-(seq.num_computed + num_new) // self.page_size) - len(seq.page_ids)
        if num_needed <= 0:
            return True
        self._make_room(num_needed)
        try:
            seq.page_ids.extend(self.pool.allocate(num_needed))
        except OutOfPages:
            return False
        return True

    def _make_room(self, num_pages: int) -> None:
        """Evict cached pages until num_pages are free, plus a batch more (when eviction runs at all)."""
        short = num_pages - self.pool.num_free
        if short > 0:
            self.cache.evict(short + self.num_evict_batch_pages)

    def _admit(self, seq: Sequence, budget: int, now: float, is_first: bool,
               in_flight: set[int]) -> ScheduledItem | Deferred | None:
        if seq.num_computed == 0:
            self._attach_prefix(seq, now)
        if self._waits_for_prefix(seq, in_flight):
            self._detach(seq)
            return Deferred.WAIT_FOR_PREFIX
        num_new = min(seq.num_uncomputed, budget)
        if num_new < seq.num_uncomputed and not self.is_chunked_prefill:
            if not is_first:
                self._detach(seq)
                return None
            num_new = seq.num_uncomputed  # an over-budget prompt runs alone rather than never
        if not self._reserve(seq, num_new):
            self._detach(seq)
            return None
        seq.status = SeqStatus.RUNNING
        seq.was_admitted = True
        self.running.append(seq)
        return ScheduledItem(seq, num_new, num_new == seq.num_uncomputed)

    def _attach_prefix(self, seq: Sequence, now: float) -> None:
        """Reuse the longest cached prefix; at least the last token is always computed (for its logits), and every
        position whose logits prompt logprobs need (a request asking for them matches no more than it has)."""
        match = self.cache.match_prefix(seq.token_ids[:seq.num_reusable_tokens], now)
        if match.page_ids:
            self.cache.lock(match.node)
            seq.cache_node = match.node
            self.pool.incref(match.page_ids)
        seq.page_ids = list(match.page_ids)
        seq.num_computed = match.num_tokens
        if not seq.was_admitted:
            seq.num_cached_tokens = min(match.num_tokens, seq.num_prompt_tokens)

    def _detach(self, seq: Sequence) -> None:
        """Give back everything seq holds (pages, cache lock); its KV must be recomputed."""
        if seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
            seq.cache_node = None
        if seq.page_ids:
            self.pool.free(seq.page_ids)
        seq.page_ids = []
        seq.num_computed = 0

    def advance(self, plan: StepPlan) -> list[Sequence]:
        """Advance each scheduled sequence past its chunk (not its drafts: see commit_drafts); returns those that
        filled a page (to cache)."""
        filled = []
        for item in plan.items:
            seq = item.seq
            num_full_before = seq.num_computed // self.page_size
            seq.num_computed += item.num_new_tokens - item.num_draft_tokens
            if seq.num_computed // self.page_size > num_full_before:
                filled.append(seq)
        return filled

    def commit_drafts(self, seq: Sequence, num_kept: int, now: float) -> None:
        """Speculative decoding: keep the KV of seq's first num_kept verified drafts (now in token_ids) and roll the
        rest back: pages past the computed tokens return to the pool (they were reserved for the drafts only and
        never cached), and a page the kept drafts filled is cached.

            before:  |<-- num_computed -->|d1 d2 d3 d4|       KV written for every draft, pages reserved for all
            after:   |<-- num_computed + num_kept -->|        (num_kept = 2); later slots are overwritten when reached
        """
        num_full_before = seq.num_computed // self.page_size
        seq.num_computed += num_kept
        num_needed = -(-seq.num_computed // self.page_size)
        if len(seq.page_ids) > num_needed:
            self.pool.free(seq.page_ids[num_needed:])
            del seq.page_ids[num_needed:]
        if seq.num_computed // self.page_size > num_full_before:
            self.cache_computed(seq, now)

    def cache_computed(self, seq: Sequence, now: float) -> None:
        """Cache a running sequence's computed full pages (after advance(), once their tokens are known)."""
        if seq.status is SeqStatus.RUNNING:
            self._cache_computed(seq, now)

    def _cache_computed(self, seq: Sequence, now: float) -> None:
        """Insert seq's computed full pages into the radix cache, and share the cache's copy of any
        page another sequence computed first (the duplicate returns to the pool)."""
        if not self.cache.is_enabled:
            return
        computed = seq.token_ids[: min(seq.num_computed, seq.num_known_tokens)]
        num_full = len(computed) // self.page_size
        # from the sequence's own cache node: its pages up to there are the tree's already (matched, or made so by an
        # earlier call), so only the pages past it are walked and may need the tree's copy
        result = self.cache.insert(computed, seq.page_ids[:num_full], now, after=seq.cache_node)
        self.cache.lock(result.node)
        if seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
        seq.cache_node = result.node
        for i, page_id in enumerate(result.page_ids, start=num_full - len(result.page_ids)):
            if seq.page_ids[i] != page_id:
                self.pool.incref([page_id])
                self.pool.free([seq.page_ids[i]])
                seq.page_ids[i] = page_id

    def preempt(self, seq: Sequence, now: float) -> None:
        """Stop seq and free its pages (its full pages stay in the cache, unlocked); it re-queues first."""
        self._cache_computed(seq, now)
        self._detach(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, now: float) -> None:
        """Release a finished or aborted sequence at once, leaving its computed pages in the cache."""
        if seq.status is SeqStatus.RUNNING:
            self._cache_computed(seq, now)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._detach(seq)
        seq.status = SeqStatus.FINISHED

    def hold(self, seq: Sequence, now: float) -> None:
        """PD prefill side: seq sampled its first token; keep its prompt pages (and cache lock) for a decode
        worker to pull, out of the running set. release() frees them later."""
        self._cache_computed(seq, now)
        self.running.remove(seq)
        seq.status = SeqStatus.FINISHED

    def release(self, seq: Sequence) -> None:
        """Free what a held or importing sequence still holds."""
        self._detach(seq)

    def reserve_import(self, seq: Sequence, now: float) -> int | None:
        """PD decode side: pages for seq's prompt, whose KV another worker computed.

        Reuses this worker's own cached prefix, allocates the rest; returns how many leading prompt pages
        came from the cache (the caller pulls the others), or None when the pool has no room.

            prompt:   |<----------- num_prompt_tokens ----------->|
            pages:    | cached  | cached |  new  |  new  | new(partial)|
                      |<- returned count ->|<---- pulled --------->|
        """
        self._attach_prefix(seq, now)  # matches token_ids[:-1] == the prompt
        if not self._reserve(seq, seq.num_prompt_tokens - seq.num_computed):
            self._detach(seq)
            return None
        seq.status = SeqStatus.IMPORTING
        return seq.num_computed // self.page_size

    def join_imported(self, seq: Sequence, now: float) -> None:
        """The pulled prompt KV is in place: seq decodes from its first token on (it feeds it next step)."""
        seq.num_computed = seq.num_prompt_tokens
        seq.status = SeqStatus.RUNNING
        seq.was_admitted = True
        self.running.append(seq)
        self._cache_computed(seq, now)

    def fork(self, parent: Sequence, children: list[Sequence]) -> list[PageCopy]:
        """Start n-1 siblings right after parent's prompt: they share its full pages and get a private
        copy of its partial last page. A child that finds no page waits and recomputes instead.

        The children start from the prompt's KV (the parent may already have computed its own first
        token's KV into the partial page: each child overwrites that slot with its own token's)."""
        num_prompt = parent.num_prompt_tokens
        num_full = num_prompt // self.page_size
        has_partial = num_prompt % self.page_size != 0
        copies: list[PageCopy] = []
        if parent.status is not SeqStatus.RUNNING or parent.num_computed < num_prompt:
            # NOTE: overlap mode forks when the first token is read, a step after it was sampled; a parent
            # preempted meanwhile no longer holds its prompt's KV, so its children recompute the prompt
            for child in children:
                self.add(child)
            return copies
        for child in children:
            private = self._allocate_quietly(1 if has_partial else 0)
            if private is None:
                self.add(child)
                continue
            shared = parent.page_ids[:num_full]
            self.pool.incref(shared)
            child.page_ids = shared + private
            if has_partial:
                copies.append(PageCopy(parent.page_ids[num_full], private[0]))
            child.num_computed = num_prompt
            child.num_cached_tokens = parent.num_cached_tokens
            child.was_admitted = True
            if parent.cache_node is not None:
                self.cache.lock(parent.cache_node)
                child.cache_node = parent.cache_node
            child.status = SeqStatus.RUNNING
            self.running.append(child)
        return copies

    def _allocate_quietly(self, num_pages: int) -> list[int] | None:
        if num_pages == 0:
            return []
        self._make_room(num_pages)
        try:
            return self.pool.allocate(num_pages)
        except OutOfPages:
            return None

    def check_invariants(self) -> None:
        for seq in self.running:
            assert seq.status is SeqStatus.RUNNING
            assert len(seq.page_ids) * self.page_size >= seq.num_computed
        for seq in self.waiting:
            assert seq.status is SeqStatus.WAITING
            assert seq.num_computed == 0 and not seq.page_ids and seq.cache_node is None
        assert len({id(s) for s in self.running} | {id(s) for s in self.waiting}) == self.num_unfinished
