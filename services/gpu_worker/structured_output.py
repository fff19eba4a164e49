"""Structured output in the engine: one llguidance matcher per constrained sequence, and each step's token bitmask,
filled on the CPU while the device runs the step's forward and applied to the logits on the device before sampling.

    step N+1:  forward queued ─▶ step N's tokens read ─▶ matchers advanced ─▶ bitmask filled (CPU, GPU busy)
               ─▶ bitmask copied (pinned, non-blocking) ─▶ logits of constrained rows masked ─▶ sampler
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import structlog
import torch

from services.gpu_worker.staging import to_device
from shared.output_constraint import ConstraintError, OutputConstraint, grammar_text

log = structlog.get_logger(__name__)

MAX_CACHED_GRAMMARS = 128
BITS = 32  # tokens per bitmask word: bit j of word w allows token 32·w + j


class StructuredOutput:
    """Compiles constraints against the model's tokenizer (an LRU of compiled matchers, copied per sequence), fills
    bitmasks and masks logits. Only the engine thread uses it."""

    def __init__(self, tokenizer: object | None, vocab_size: int, eos_token_ids: Sequence[int],
                 device: torch.device, max_cached_grammars: int = MAX_CACHED_GRAMMARS) -> None:
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // BITS)
        self.device = device
        self.max_cached_grammars = max_cached_grammars
        self._tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._lltokenizer = None  # built at the first constrained request (~0.3 s for a 49k vocabulary)
        self._executor = None
        self._compiled: OrderedDict[OutputConstraint, object] = OrderedDict()  # constraint → an unused LLMatcher
        # bit j set in word j: ANDed with a mask word, tells whether token 32·w + j is allowed
        self._bit_values = torch.tensor([1 << j for j in range(BITS - 1)] + [-(1 << (BITS - 1))],
                                        dtype=torch.int32, device=device)  # [32] int32

    def new_matcher(self, constraint: OutputConstraint) -> object:
        """A fresh matcher for one sequence; ValueError when the model has no tokenizer or the grammar fails."""
        compiled = self._compiled.get(constraint)
        if compiled is None:
            compiled = self._compile(constraint)
            self._compiled[constraint] = compiled
            if len(self._compiled) > self.max_cached_grammars:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint)
        return compiled.deep_copy()

    def _compile(self, constraint: OutputConstraint) -> object:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llguidance_tokenizer(), grammar_text(constraint), log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"the output constraint does not compile: {matcher.get_error()}")
        return matcher

    def _llguidance_tokenizer(self) -> object:
        if self._lltokenizer is None:
            if self._tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer; this model has none (random:*)")
            import llguidance.hf

            self._lltokenizer = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size,
                                                             eos_token=self._eos_token_ids)
        return self._lltokenizer

    @staticmethod
    def accept(matcher: object, token_id: int) -> bool:
        """Advance a matcher by its sequence's new token → whether the sequence must end now: the grammar is
        complete (nothing may follow), or the token broke it (never under the mask; logged)."""
        if not matcher.consume_token(token_id):
            log.warning("a sampled token broke its grammar; the sequence ends", error=matcher.get_error())
            return True
        return matcher.is_stopped()

    def fill_bitmask(self, matchers: Sequence[object | None]) -> tuple[torch.Tensor, list[int]]:
        """The next token's bitmask of each row with a matcher → ([R, num_words] int32 on the host, pinned on
        CUDA; the constrained rows' indices [R])."""
        from llguidance import LLExecutor

        rows = [i for i, m in enumerate(matchers) if m is not None]
        bitmask = torch.empty((len(rows), self.num_words), dtype=torch.int32,
                              pin_memory=self.device.type == "cuda")  # [R, W]
        if not rows:
            return bitmask, rows
        if self._executor is None:
            self._executor = LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(matchers[row], i) for i, row in enumerate(rows)],
                                               bitmask.data_ptr(), self.num_words * 4, len(rows))
        return bitmask, rows

    @torch.inference_mode()  # the model's logits are inference tensors
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Set the logits of disallowed tokens to -inf in the constrained rows, in place → logits [B, V].

        On CUDA one Triton launch (apply_token_bitmask_); elsewhere torch ops, the kernel's reference in its tests."""
        vocab = logits.shape[1]
        index = to_device(rows, torch.long, logits.device)  # [R]
        mask = bitmask.to(logits.device, non_blocking=True)  # [R, W] int32
        if logits.is_cuda:  # imported here: kernel modules load only where Triton runs (kernels/__init__.py)
            from services.gpu_worker.kernels.token_bitmask import apply_token_bitmask_

            return apply_token_bitmask_(logits, mask, index)
        allowed = (mask.unsqueeze(-1) & self._bit_values).ne(0).flatten(1)[:, :vocab]  # [R, W·32 → V] bool
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return logits
