"""CUDA graphs of decode-only steps: the whole forward plus the LM head, captured once per batch-size bucket.

A decode-only step of B ≤ max bucket sequences is padded to the next bucket and replayed. Its inputs travel
in one host→device copy of a pinned int32 buffer laid out as

    [ input_ids | positions | slot_mapping | seq_lens ]  (max_bucket each)  [ page_table: max_bucket × W ]

Padding rows decode token 0 at position 0 into slot 0 (page 0 is reserved padding, never read as real KV).
Steps with a prefill chunk, more sequences than the largest bucket, or a sequence longer than W pages run eager.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from services.gpu_worker.batch_policy import ScheduledItem
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
        size = 4 * bm + bm * self.width
        device = kv.k.device
        # Two pinned staging buffers, used in turn: in overlap mode the host fills one for step N+1 while the
        # copy out of the other may still be queued behind step N on the GPU (each waits on its own event).
        self.hosts = [torch.zeros(size, dtype=torch.int32).pin_memory() for _ in range(2)]
        for host in self.hosts:
            host.numpy()[3 * bm: 4 * bm] = 1  # padding rows: seq_len 1
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0
        self.dev = self.hosts[0].to(device)
        self.input_ids, self.positions = self.dev[:bm], self.dev[bm: 2 * bm]  # [bm] int32 each
        self.slots, self.seq_lens = self.dev[2 * bm: 3 * bm], self.dev[3 * bm: 4 * bm]
        self.page_table = self.dev[4 * bm:].view(bm, self.width)  # [bm, W] int32
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

    def _run(self, bucket: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv, self._meta(bucket),
                            self.backend)
        return self.model.logits(hidden)  # [bucket, vocab] fp32

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

    def try_forward(self, items: list[ScheduledItem],
                    feed: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Replay the graph for a decode-only step → logits [B, vocab] fp32 (valid until the next replay);
        None when the step must run eager. feed(input_ids) writes tokens still on the device (overlap mode)."""
        num_seqs = len(items)
        if num_seqs > self.max_batch or not all(it.num_new_tokens == 1 and it.is_sampling for it in items):
            return None
        width, page_size, bm = self.width, self.page_size, self.max_batch
        if any(len(it.seq.page_ids) > width for it in items):
            return None
        bucket = next(b for b in self.buckets if b >= num_seqs)
        self.turn ^= 1
        host = self.hosts[self.turn]
        self.copied[self.turn].synchronize()  # its last copy to the device is done (an unrecorded event: at once)
        h = host.numpy()
        positions = [it.seq.num_computed for it in items]
        h[:num_seqs] = [it.seq.token_ids[p] for it, p in zip(items, positions)]
        h[bm: bm + num_seqs] = positions
        h[2 * bm: 2 * bm + num_seqs] = [it.seq.page_ids[p // page_size] * page_size + p % page_size
                                        for it, p in zip(items, positions)]
        h[3 * bm: 3 * bm + num_seqs] = np.asarray(positions) + 1
        for lo in (0, bm, 2 * bm):
            h[lo + num_seqs: lo + bucket] = 0
        h[3 * bm + num_seqs: 3 * bm + bucket] = 1
        table = h[4 * bm: 4 * bm + bucket * width].reshape(bucket, width)
        for i, it in enumerate(items):
            pages = it.seq.page_ids
            table[i, : len(pages)] = pages
        num_words = 4 * bm + bucket * width
        self.dev[:num_words].copy_(host[:num_words], non_blocking=True)
        self.copied[self.turn].record()
        if feed is not None:
            feed(self.input_ids)
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.logits[bucket][:num_seqs]
