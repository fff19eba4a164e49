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
"""
from __future__ import annotations

import numpy as np
import torch

from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from services.gpu_worker.batch_policy import ScheduledItem
from services.gpu_worker.kernels.argmax import argmax_rows
from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.model.llama import LlamaForCausalLM

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MAX_GRAPH_CONTEXT = 8192  # tokens: a longer sequence's decode step runs eager


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
        argmax_rows(logits, out=self.tokens[:bucket])
        return logits

    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (inputs are the padding rows)."""
        pool = None
        for bucket in reversed(self.buckets):
            self._run(bucket)  # warm-up: compiles the Triton kernels for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bucket] = self._run(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

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
