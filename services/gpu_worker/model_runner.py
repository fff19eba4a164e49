"""The model runner: a model on its device with its KV pool, attention backend and CUDA graphs (decode, and
speculative verify), and the forward pass of one scheduled step.

The engine (engine.py) owns the requests' lifecycle: admission, the prefix cache, sampling, stop checks, PD holds.
It hands the runner a StepPlan and gets back the logits of the rows it samples. The runner knows nothing of
requests: a new model family touches model/ and its registry line, never this file or the engine.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.gpu_worker.attention import AttentionMetadata, make_backend
from services.gpu_worker.batch_policy import ScheduledItem, StepPlan
from services.gpu_worker.engine_config import BatchingLimits, EngineConfig
from services.gpu_worker.kv_cache import KVCache, select_pages
from services.gpu_worker.model.adopt import adopt_parameters_, move_buffers_, parameters_on_meta
from services.gpu_worker.model.loader import LoadedModel, bundled_gguf_path, load_model
from services.gpu_worker.model.registry import architecture_for_type
from services.gpu_worker.prompt_logprobs import (
    PromptLogprobBatch,
    PromptSpan,
    prompt_logprob_tensors,
    slice_rows,
)
from services.gpu_worker.quant.checkpoint import install_
from services.gpu_worker.staging import to_device
from shared.model_id import BUNDLED_SPECS

if TYPE_CHECKING:
    from services.gpu_worker.parallel.state import TensorParallelGroup

TABLE_WIDTH_MULTIPLE = 16  # an eager step's page table is this many pages wide, or a multiple (Triton's specialization)


def eager_inputs(items: list[ScheduledItem], page_size: int,
                 ) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int]]:
    """An eager step's host inputs: input ids, positions and cache slots of every new token, query_start [B + 1],
    seq_lens [B], and the rows whose logits the step returns (a speculative row: its last token's, then its drafts')."""
    input_ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
    logit_rows = []
    for item in items:
        seq, start = item.seq, item.seq.num_computed
        end = start + item.num_new_tokens
        input_ids.extend(seq.token_ids[start:end - item.num_draft_tokens])
        input_ids.extend(seq.draft_token_ids[:item.num_draft_tokens])  # speculative: scored after the last token
        positions.extend(range(start, end))
        slots.extend(seq.page_ids[p // page_size] * page_size + p % page_size for p in range(start, end))
        query_start.append(query_start[-1] + item.num_new_tokens)
        seq_lens.append(end)
        if item.is_sampling and seq.params.max_tokens > 0:
            logit_rows.extend(range(query_start[-1] - 1 - item.num_draft_tokens, query_start[-1]))
    return input_ids, positions, slots, query_start, seq_lens, logit_rows


class ModelRunner:
    """Loads the weights (the loader's copy freed before the KV pool is sized from free memory), chooses the pool and
    the batching limits, and runs forwards: a decode step on a captured graph when one fits, else eagerly."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.tp = self._join_tensor_parallel(config)  # None unless tensor_parallel_size > 1
        dtype = self.model_dtype = config.resolved_dtype()
        owns_weights = loaded is None
        loaded = loaded or load_model(config.model, dtype=dtype, device=self.device, seed=config.seed)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        model_class = architecture_for_type(loaded.config.arch).model_class  # model/registry.py
        with parameters_on_meta():  # no parameter allocated or initialised yet (model/adopt.py)
            self.model = model_class(loaded.config, self.tp)
        move_buffers_(self.model, self.device)
        if not owns_weights:  # the caller keeps the loaded tensors (to build another engine from them): the model
            adopt_parameters_(self.model, {}, self.device, dtype)  # gets memory of its own, and the load copies
        # the load adopts the loader's tensors as the parameters still on meta (none left where the caller keeps them)
        self.num_quantized_layers = self._load_weights(loaded, config.quantization, meta_to=(self.device, dtype))
        # what the weights are, for the start-up log: the dtype, or the quantization and where it came from
        dtype_name = str(dtype).removeprefix("torch.")
        origin = ("as the checkpoint holds them" if loaded.quantization else
                  "from the GGUF's own 4-bit blocks" if config.quantization == "gguf" else "on load")
        self.weights = dtype_name if not self.num_quantized_layers else (
            f"{loaded.quantization or config.quantization} ({self.num_quantized_layers} linear layers quantized "
            f"{origin}; the rest {dtype_name})")
        if owns_weights:  # the loader's copy goes before the KV pool is sized from free memory (alive, it took a
            loaded.state_dict.clear()  # second copy of the weights out of the pool: 16 GB for Llama-3.1-8B in bf16)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.model.inv_freq = self.model.inv_freq.float()
        self.model.eval()
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        kv_dtype = config.resolved_kv_dtype()
        # bytes torch's allocator holds but nothing uses when the pool is sized from free memory: freed tensors in
        # segments it cannot give back (a neighbour still alive), lost to the KV pool (the ready log shows it)
        self.allocator_idle_bytes = (torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
                                     if self.device.type == "cuda" else 0)
        self.num_pages = config.resolved_num_pages(loaded.config, kv_dtype, self.device)
        if self.tp is not None:
            self.num_pages = self.tp.min_over_ranks(self.num_pages)  # every rank must plan with the same pool
        # A sequence, even running alone, never holds more tokens than the whole pool's slots.
        self.max_seq_len = min(self.max_model_len, (self.num_pages - 1) * config.page_size)
        self.kv = KVCache(loaded.config.num_layers, self.num_pages, config.page_size,
                          loaded.config.num_kv_heads // config.tensor_parallel_size, loaded.config.head_dim,
                          kv_dtype, self.device)
        self.batching: BatchingLimits = config.resolved_batching(self.num_pages)
        self.backend = make_backend(config.attention_backend, self.device.type)
        # positions and slots of eager steps: int32 for the Triton kernels, as in the CUDA graphs' buffers, so a mixed
        # step's decodes reuse the graphs' compiles; torch's index_copy_ (the torch backend) takes int64 only
        self._index_dtype = torch.int32 if self.backend.name == "triton" else torch.long
        self.verify_graphs = None  # speculative verify steps' graphs (cuda_graphs.VerifyGraphs), beside the decode ones
        self.graphs = self._setup_cuda_path(config)

    def _join_tensor_parallel(self, config: EngineConfig) -> TensorParallelGroup | None:
        """tensor_parallel_size > 1: this process's TP group (parallel/state.py), and its rank's device."""
        if config.tensor_parallel_size == 1:
            return None
        from services.gpu_worker.parallel.state import current_group

        tp = current_group(config.tensor_parallel_size)
        self.device = tp.local_device(self.device)
        return tp

    def _load_weights(self, loaded: LoadedModel, method: str | None,
                      meta_to: tuple[torch.device, torch.dtype] | None) -> int:
        """The weights into the model (under TP: this rank's slices), quantized where asked (quant/): a quantized
        checkpoint's layers as published, the bundled GGUF's own 4-bit blocks (`gguf`), or every decoder linear layer
        of a dense model quantized on load → how many layers are quantized."""
        if loaded.quantization is not None and method not in (None, loaded.quantization):
            raise ValueError(f"the checkpoint is quantized with {loaded.quantization}, not {method}")
        linears = loaded.quantized_linears or (self._gguf_linears(loaded) if method == "gguf" else {})
        if linears:  # installed first (under TP: this rank's slices); the dense rest loads around them
            if self.tp is not None:
                from services.gpu_worker.parallel.shard import shard_linear_layers

                linears = shard_linear_layers(linears, self.tp.rank, self.tp.size)
            dense = {name: w for name, w in loaded.state_dict.items() if name.removesuffix(".weight") not in linears}
            self.model.load_weights(dense, local=install_(self.model, linears), meta_to=meta_to)
            return len(linears)
        self.model.load_weights(loaded.state_dict, meta_to=meta_to)
        if method is None:
            return 0
        from services.gpu_worker.quant.apply import quantize_linears_
        from services.gpu_worker.quant.calibration import on_load_calibration

        num_layers = quantize_linears_(self.model, method, calibration=on_load_calibration(loaded.tokenizer))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the dense weights the quantized ones replaced
        return num_layers

    def _gguf_linears(self, loaded: LoadedModel) -> dict:
        if self.config.model not in BUNDLED_SPECS:
            raise ValueError(f"quantization gguf serves the bundled GGUF's own 4-bit blocks; {self.config.model!r} is "
                             "not the bundled model (fp8, awq or gptq quantize any model on load)")
        from services.gpu_worker.quant.gguf_int4 import gguf_int4_linears

        return {name: linear.to(self.device)
                for name, linear in gguf_int4_linears(bundled_gguf_path(), loaded.config, self.model_dtype).items()}

    def _setup_cuda_path(self, config: EngineConfig):
        """With the Triton backend: fused kernels in the model (quantized layers run their own GEMMs inside it:
        model/fused.py), and decode CUDA graphs when enabled (with speculation, verify graphs too)."""
        gemv_max_tokens = config.resolved_gemv_max_tokens(self.backend.name)
        if self.backend.name != "triton":
            if gemv_max_tokens:
                raise ValueError(f"gemv_max_tokens needs the Triton attention backend, not {self.backend.name}")
            return None
        self.model.enable_fused_kernels()
        self.model.gemv_max_tokens = gemv_max_tokens  # dense projections and the LM head; quantized ones never
        if not config.enable_cuda_graphs or self.device.type != "cuda":
            return None
        from services.gpu_worker.cuda_graphs import DecodeGraphs, VerifyGraphs

        graphs = DecodeGraphs(self.model, self.kv, self.backend, self.batching.max_num_seqs, self.max_seq_len)
        graphs.capture()
        if config.speculative_method is not None:  # drafts go to decodes only while this many sequences decode
            self.verify_graphs = VerifyGraphs(
                self.model, self.kv, self.backend, min(config.speculative_max_batch_size, self.batching.max_num_seqs),
                self.max_seq_len, config.num_speculative_tokens)
            self.verify_graphs.capture(graphs.pool)
        return graphs

    def forward(self, plan: StepPlan, previous_tokens: Callable[[], torch.Tensor],
                ) -> tuple[torch.Tensor, torch.Tensor | None, PromptLogprobBatch | None]:
        """Run the model over every scheduled chunk → logits of sampling chunks [B_s, V] fp32 (a chunk with drafts has
        1 + num_draft_tokens rows, in order; such a step replays a verify graph when every chunk is a decode, else
        runs eager), their argmax [B_s] when a decode graph computed it (else None), and the prompt logprobs the
        chunks give (eager steps only: a replayed step is decodes and last prompt tokens, whose logits are no prompt
        token's).

        previous_tokens(): the last launched step's sampled tokens on the device, which a chunk's last input takes
        where its sequence has a placeholder (overlap mode: the host has not read them yet)."""
        if self.verify_graphs is not None and any(item.num_draft_tokens for item in plan.items):
            verified = self.verify_graphs.try_forward(plan.items)
            if verified is not None:
                return verified, None, None
        if self.graphs is not None:
            pending = [(i, item.seq.pending_row) for i, item in enumerate(plan.items) if item.seq.num_pending]
            replayed = self.graphs.try_forward(plan.items, pending, previous_tokens() if pending else None)
            if replayed is not None:
                return *replayed, None
        input_ids, positions, slots, query_start, seq_lens, logit_rows = eager_inputs(plan.items,
                                                                                      self.config.page_size)
        # the table's width rounded up to 16 pages: its row stride, a kernel argument, then always divides by 16, and
        # Triton compiles the kernels once instead of once more each time the widest sequence crosses a multiple
        widest = max(len(item.seq.page_ids) for item in plan.items)
        max_pages = -(-widest // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
        table = np.zeros((len(plan.items), max_pages), dtype=np.int32)  # row by row: no padded list of lists
        for i, item in enumerate(plan.items):
            table[i, :len(item.seq.page_ids)] = item.seq.page_ids
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, self._index_dtype, dev),
            query_start=to_device(query_start, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            page_table=to_device(table, torch.int32, dev),
            query_start_host=query_start, seq_lens_host=seq_lens,
            max_query_len=max(item.num_new_tokens for item in plan.items), max_seq_len=max(seq_lens))
        ids = to_device(input_ids, torch.long, dev)
        pending = [(query_start[i + 1] - 1, item.seq.pending_row) for i, item in enumerate(plan.items)
                   if item.seq.num_pending and seq_lens[i] == item.seq.num_tokens]
        if pending:  # the previous step's device tokens into the input ids: (input index, its sampled row)
            tokens = previous_tokens()
            index = to_device(pending, torch.long, tokens.device)  # [P, 2]
            ids[index[:, 0]] = tokens[index[:, 1]].to(ids.dtype)
        hidden = self.model(ids, to_device(positions, self._index_dtype, dev), self.kv, meta, self.backend)
        prompt = self._prompt_logprobs(plan, hidden, query_start)
        if not logit_rows:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32), None, prompt
        return self.model.logits(hidden[to_device(logit_rows, torch.long, dev)]), None, prompt

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor,
                         query_start: list[int]) -> PromptLogprobBatch | None:
        """The prompt logprobs of every position this step computes that its sequence still needs.
        hidden: [T, H], the rows of the plan's chunks in order (chunk i from query_start[i])."""
        spans: list[PromptSpan] = []
        rows, target_ids = [], []
        for i, item in enumerate(plan.items):
            wanted, start = item.seq.prompt_logprobs, item.seq.num_computed
            if wanted is None or wanted.is_complete:
                continue
            for position in range(start, start + item.num_new_tokens):
                if not wanted.needs(position):
                    continue
                last = spans[-1] if spans else None
                if last is not None and last.target is wanted and last.first_position + last.num_positions == position:
                    last.num_positions += 1
                else:
                    spans.append(PromptSpan(wanted, position, 1))
                rows.append(query_start[i] + position - start)
                target_ids.append(item.seq.token_ids[position + 1])
        if not rows:
            return None
        dev = hidden.device
        tensors = prompt_logprob_tensors(self.model.logits, hidden[to_device(rows, torch.long, dev)],
                                         to_device(target_ids, torch.long, dev),
                                         max(span.target.num_top for span in spans),
                                         slice_rows(self.model_config.vocab_size))
        return PromptLogprobBatch.launch(spans, target_ids, tensors)

    def export_pages(self, page_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these pages, each [num_layers, len(page_ids), page_size, num_kv_heads, head_dim]."""
        index = torch.tensor(page_ids, dtype=torch.long, device=self.kv.k.device)
        return select_pages(self.kv.k, index), select_pages(self.kv.v, index)
