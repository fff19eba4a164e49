"""CUDA graphs of decode-only steps: the whole forward, the LM head and the greedy argmax, captured once per
batch-size bucket.

A decode-only step of B ≤ max bucket sequences is padded to the next bucket and replayed. Its inputs travel
in one host→device copy of a pinned int32 buffer laid out as

    [ input_ids | positions | slot_mapping | seq_lens | feed_src ]  (max_bucket each)  [ page_table: max_bucket × W ]

feed_src[i] ≥ 0 marks an input token the previous step sampled and the host has not read yet (overlap mode):
the graph's embedding takes it from `tokens[feed_src[i]]` on the device. `tokens` is the graph's static output
of greedy tokens (argmax over each row's logits); it is also where a step sampled outside a graph leaves its
tokens for the next replay to read. So a batch-1 greedy step is one copy in, one replay, one copy out.
Padding rows decode token 0 at position 0 into slot 0 (page 0 is reserved padding, never read as real KV).
Steps with a prefill chunk, more sequences than the largest bucket, or a sequence longer than W pages run eager.

Speculative verify steps (VerifyGraphs): every row a decode with d ≤ k drafts, captured per bucket of rows with
Q = k + 1 query tokens each, so one graph serves every mix of draft counts. A row is padded to Q tokens (token 0 into
slot 0, positions continuing after its real ones); its real tokens attend causally and never see the padding, whose
outputs, like the padding rows', are not gathered. The step's real logit rows are gathered after the replay in the
eager path's order (verify_layout).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from services.gpu_worker.batch_policy import ScheduledItem
from services.gpu_worker.kernels import pdl
from services.gpu_worker.kernels.argmax import argmax_rows
from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.model.llama import LlamaForCausalLM

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MAX_GRAPH_CONTEXT = 8192  # tokens: a longer sequence's decode step runs eager


def capture_buckets(buckets: list[int], run: Callable[[int], torch.Tensor], graphs: dict[int, torch.cuda.CUDAGraph],
                    outputs: dict[int, torch.Tensor], pool: tuple | None = None) -> tuple:
    """Capture run(bucket) for every bucket, largest first, into one memory pool (a new one unless given), filling
    graphs and outputs (each bucket's static output) → the pool."""
    for bucket in reversed(buckets):
        run(bucket)  # warm-up: compiles the Triton kernels for this shape outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[bucket] = run(bucket)
        pool = graph.pool()
        graphs[bucket] = graph
    torch.cuda.synchronize()
    return pool


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, backend: AttentionBackend, max_batch: int,
                 max_seq_len: int) -> None:
        self.model, self.kv, self.backend, self.page_size = model, kv, backend, kv.page_size
        top = next((b for b in BUCKETS if b >= max_batch), BUCKETS[-1])
        self.buckets = [b for b in BUCKETS if b <= top]
        self.max_batch = self.buckets[-1]
        self.width = -(-min(max_seq_len, MAX_GRAPH_CONTEXT) // self.page_size)  # W: page-table columns
        bm = self.max_batch
        size = 5 * bm + bm * self.width
        device = kv.k.device
        # Two pinned staging buffers, used in turn: in overlap mode the host fills one for step N+1 while the
        # copy out of the other may still be queued behind step N on the GPU (each waits on its own event).
        self.hosts = [torch.zeros(size, dtype=torch.int32).pin_memory() for _ in range(2)]
        for host in self.hosts:
            host.numpy()[3 * bm: 4 * bm] = 1  # padding rows: seq_len 1
            host.numpy()[4 * bm: 5 * bm] = -1  # no fed tokens
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0
        self.dev = self.hosts[0].to(device)
        self.input_ids, self.positions = self.dev[:bm], self.dev[bm: 2 * bm]  # [bm] int32 each
        self.slots, self.seq_lens = self.dev[2 * bm: 3 * bm], self.dev[3 * bm: 4 * bm]
        self.feed_src = self.dev[4 * bm: 5 * bm]  # [bm] int32: row of `tokens` feeding this input, or -1
        self.page_table = self.dev[5 * bm:].view(bm, self.width)  # [bm, W] int32
        self.tokens = torch.zeros(bm, dtype=torch.int64, device=device)  # greedy tokens out; fed tokens in
        self.query_start = torch.arange(bm + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket → static [bucket, vocab] fp32 output
        self.num_replays = 0

    def _meta(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:bucket], query_start=self.query_start[: bucket + 1],
            seq_lens=self.seq_lens[:bucket], page_table=self.page_table[:bucket],
            query_start_host=list(range(bucket + 1)), seq_lens_host=[1] * bucket, max_query_len=1,
            max_seq_len=self.width * self.page_size)

    def _num_words(self, bucket: int) -> int:
        return 5 * self.max_batch + bucket * self.width

    def _run(self, bucket: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv, self._meta(bucket),
                            self.backend, fed=(self.feed_src[:bucket], self.tokens))
        logits = self.model.logits(hidden)  # [bucket, vocab] fp32
        with pdl.scope(self.model.runs_only_our_kernels(bucket)):  # as the forward's and LM head's (kernels/pdl.py)
            argmax_rows(logits, out=self.tokens[:bucket])
        return logits

    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (inputs are the padding rows)."""
        self.pool = capture_buckets(self.buckets, self._run, self.graphs, self.logits)  # VerifyGraphs shares it

    def try_forward(self, items: list[ScheduledItem], pending: list[tuple[int, int]] = (),
                    prev_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Replay the graph for a decode-only step → (logits [B, vocab] fp32, greedy tokens [B] int64), both
        valid until the next replay; None when the step must run eager.

        pending: (item index, row of prev_tokens) for each input token still on the device (overlap mode);
        prev_tokens: the previous step's sampled tokens [P] on the device (a view of `tokens` when that step
        was a replay whose tokens are the greedy ones, else copied in here)."""
        num_seqs = len(items)
        # every row must sample: a prompt-only one-token chunk (max_tokens 0) samples nothing and runs eager
        if num_seqs > self.max_batch or not all(it.num_new_tokens == 1 and it.is_sampling and it.seq.params.max_tokens
                                                for it in items):
            return None
        width, page_size, bm = self.width, self.page_size, self.max_batch
        if any(len(it.seq.page_ids) > width for it in items):
            return None
        if pending and (prev_tokens is None or prev_tokens.shape[0] > bm):
            return None
        bucket = next(b for b in self.buckets if b >= num_seqs)
        self.turn ^= 1
        host = self.hosts[self.turn]
        self.copied[self.turn].synchronize()  # its last copy to the device is done (an unrecorded event: at once)
        h = host.numpy()
        positions = [it.seq.num_computed for it in items]
        h[:num_seqs] = [max(it.seq.token_ids[p], 0) for it, p in zip(items, positions)]  # placeholders → 0
        h[bm: bm + num_seqs] = positions
        h[2 * bm: 2 * bm + num_seqs] = [it.seq.page_ids[p // page_size] * page_size + p % page_size
                                        for it, p in zip(items, positions)]
        h[3 * bm: 3 * bm + num_seqs] = np.asarray(positions) + 1
        for lo in (0, bm, 2 * bm):
            h[lo + num_seqs: lo + bucket] = 0
        h[3 * bm + num_seqs: 3 * bm + bucket] = 1
        src = h[4 * bm: 4 * bm + bucket]
        src[:] = -1
        for i, row in pending:
            src[i] = row
        table = h[5 * bm: 5 * bm + bucket * width].reshape(bucket, width)
        for i, it in enumerate(items):
            pages = it.seq.page_ids
            table[i, : len(pages)] = pages
        num_words = self._num_words(bucket)
        self.dev[:num_words].copy_(host[:num_words], non_blocking=True)
        self.copied[self.turn].record()
        if pending and prev_tokens.data_ptr() != self.tokens.data_ptr():  # sampled outside a graph, or not greedy
            self.tokens[: prev_tokens.shape[0]].copy_(prev_tokens)
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.logits[bucket][:num_seqs], self.tokens[:num_seqs]


@dataclass
class VerifyLayout:
    """The host side of one verify replay: n rows of Q tokens each (n ≤ bucket; rows past n are padding)."""

    input_ids: list[int]  # [n * Q]: a row's last token, its drafts, then token 0
    positions: list[int]  # [n * Q]: first_position .. first_position + Q - 1
    slots: list[int]  # [n * Q]: the real tokens' cache slots; 0 (the reserved page) for padding
    seq_lens: list[int]  # [n]: first_position + Q
    pages: list[list[int]]  # [n] each row's page ids (its page-table row, before zero padding)
    logit_rows: list[int]  # rows of the [bucket * Q] logits the eager path would return, in its order


def fits_verify(items: list[ScheduledItem], q: int, max_batch: int, width: int, page_size: int) -> bool:
    """Whether a step can replay a verify graph of Q = q tokens a row: every item a sampling decode (its last token
    plus at most q - 1 drafts, none still pending on the device), at most max_batch of them, each row's Q positions
    within W pages (the kernel reads a padding query's keys through the page table too)."""
    if not items or len(items) > max_batch:
        return False
    for it in items:
        seq = it.seq
        if not (it.is_sampling and seq.params.max_tokens > 0 and it.num_new_tokens == 1 + it.num_draft_tokens
                and it.num_draft_tokens < q and not seq.num_pending and len(seq.page_ids) <= width
                and seq.num_computed + q <= width * page_size):
            return False
    return True


def verify_layout(items: list[ScheduledItem], q: int, page_size: int) -> VerifyLayout:
    """Inputs of a verify step padded to q tokens a row (items passed fits_verify). A row's real tokens sit where
    the eager path puts them (model_runner.forward); its padding writes K/V into slot 0, so no real page changes,
    and sits after the real tokens, so causal attention hides it from them."""
    out = VerifyLayout([], [], [], [], [], [])
    for i, it in enumerate(items):
        seq, start, d = it.seq, it.seq.num_computed, it.num_draft_tokens
        out.input_ids += [seq.token_ids[start], *seq.draft_token_ids[:d]] + [0] * (q - 1 - d)
        out.positions += range(start, start + q)
        out.slots += [seq.page_ids[p // page_size] * page_size + p % page_size for p in range(start, start + 1 + d)]
        out.slots += [0] * (q - 1 - d)
        out.seq_lens.append(start + q)
        out.pages.append(seq.page_ids)
        out.logit_rows += range(i * q, i * q + 1 + d)  # its last token's row, then its drafts'
    return out


class VerifyGraphs:
    """CUDA graphs of speculative verify steps, one per batch-size bucket, Q = k + 1 tokens a row. Inputs travel in
    one host→device copy of a pinned int32 buffer laid out as

        [ input_ids | positions | slot_mapping | logit_rows ]  (max_bucket × Q each)
        [ seq_lens ]  (max_bucket)  [ page_table: max_bucket × W ]

    The graph runs the forward and the LM head over all bucket × Q rows; the real rows are gathered after the
    replay (an index_select outside the graph: their number changes with the drafts)."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, backend: AttentionBackend, max_batch: int,
                 max_seq_len: int, num_speculative_tokens: int) -> None:
        self.model, self.kv, self.backend, self.page_size = model, kv, backend, kv.page_size
        self.q = q = num_speculative_tokens + 1
        top = next((b for b in BUCKETS if b >= max_batch), BUCKETS[-1])
        self.buckets = [b for b in BUCKETS if b <= top]
        self.max_batch = bm = self.buckets[-1]
        self.width = -(-min(max_seq_len, MAX_GRAPH_CONTEXT) // self.page_size)  # W: page-table columns
        tm = bm * q  # token rows of the largest bucket
        self.host = torch.zeros(4 * tm + bm + bm * self.width, dtype=torch.int32)
        if torch.cuda.is_available():
            self.host = self.host.pin_memory()
        h = self.host.numpy()
        h[tm: 2 * tm] = np.tile(np.arange(q), bm)  # padding rows: positions 0..Q-1, seq_len Q
        h[4 * tm: 4 * tm + bm] = q
        # NOTE: one staging buffer suffices: a step with drafts is never overlapped (engine.step reads it at once);
        # the event only guards against a replay whose copy is still queued
        self.copied = torch.cuda.Event()
        self.dev = self.host.to(kv.k.device)
        self.input_ids, self.positions = self.dev[:tm], self.dev[tm: 2 * tm]  # [tm] int32 each
        self.slots, self.logit_rows = self.dev[2 * tm: 3 * tm], self.dev[3 * tm: 4 * tm]
        self.seq_lens = self.dev[4 * tm: 4 * tm + bm]  # [bm] int32
        self.page_table = self.dev[4 * tm + bm:].view(bm, self.width)  # [bm, W] int32
        self.query_start = torch.arange(0, tm + 1, q, dtype=torch.int32, device=kv.k.device)  # [bm + 1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket → static [bucket * Q, vocab] fp32 output
        self.num_replays = 0

    def _meta(self, bucket: int) -> AttentionMetadata:
        # NOTE: the host lists give the static shape only (max_query_len Q > 1, so no leading single-token rows:
        # forward_rope runs rope_kv_write_ + extend_attention, whose grid depends on Q and the bucket alone)
        q = self.q
        return AttentionMetadata(
            slot_mapping=self.slots[: bucket * q], query_start=self.query_start[: bucket + 1],
            seq_lens=self.seq_lens[:bucket], page_table=self.page_table[:bucket],
            query_start_host=list(range(0, bucket * q + 1, q)), seq_lens_host=[q] * bucket, max_query_len=q,
            max_seq_len=self.width * self.page_size)

    def _run(self, bucket: int) -> torch.Tensor:
        n = bucket * self.q
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.kv, self._meta(bucket), self.backend)
        return self.model.logits(hidden)  # [bucket * Q, vocab] fp32

    def capture(self, pool: tuple | None = None) -> None:
        """Capture every bucket, largest first, into one memory pool (the decode graphs' when given)."""
        capture_buckets(self.buckets, self._run, self.graphs, self.logits, pool)

    def try_forward(self, items: list[ScheduledItem]) -> torch.Tensor | None:
        """Replay the graph for a verify step → the logits of its sampling rows [sum of 1 + num_draft_tokens, vocab]
        fp32 in the eager path's order; None when the step must run eager."""
        q, bm, width = self.q, self.max_batch, self.width
        if not fits_verify(items, q, bm, width, self.page_size):
            return None
        n = len(items)
        bucket = next(b for b in self.buckets if b >= n)
        layout = verify_layout(items, q, self.page_size)
        tm, real, padded = bm * q, n * q, bucket * q
        self.copied.synchronize()  # the last copy out of the staging buffer is done (unrecorded: at once)
        h = self.host.numpy()
        h[:real] = layout.input_ids
        h[real:padded] = 0
        h[tm: tm + real] = layout.positions
        h[tm + real: tm + padded] = np.tile(np.arange(q), bucket - n)
        h[2 * tm: 2 * tm + real] = layout.slots
        h[2 * tm + real: 2 * tm + padded] = 0
        h[3 * tm: 3 * tm + len(layout.logit_rows)] = layout.logit_rows
        h[4 * tm: 4 * tm + n] = layout.seq_lens
        h[4 * tm + n: 4 * tm + bucket] = q
        table = h[4 * tm + bm: 4 * tm + bm + bucket * width].reshape(bucket, width)
        for i, pages in enumerate(layout.pages):
            table[i, : len(pages)] = pages
            table[i, len(pages):] = 0  # a padding query's keys past the row's pages: page 0, not a stale page
        table[n:] = 0
        num_words = 4 * tm + bm + bucket * width
        self.dev[:num_words].copy_(self.host[:num_words], non_blocking=True)
        self.copied.record()
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.logits[bucket].index_select(0, self.logit_rows[: len(layout.logit_rows)])
