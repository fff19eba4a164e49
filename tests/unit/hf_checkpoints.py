"""Helpers of the per-family exactness tests: prompts, transformers' fp32 greedy generate() and the engine's greedy
tokens for the same prompts (tests/unit/test_phi3.py, test_moe_families.py)."""
from __future__ import annotations

import random
from pathlib import Path

import torch
import transformers

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import LoadedModel, load_model
from services.gpu_worker.request import SamplingParams
from tests.unit.step_modes import MODE

NUM_NEW = 8
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def save_checkpoint(model: transformers.PreTrainedModel, root: str,
                    name: str) -> tuple[Path, transformers.PreTrainedModel]:
    """model saved as transformers saves it (safetensors) under root/name; → (that directory, model in eval mode)."""
    path = Path(root) / name
    model.eval().save_pretrained(path, safe_serialization=True)
    return path, model


def random_prompts(vocab_size: int, num: int = 5, seed: int = 0) -> list[list[int]]:
    """num prompts of 1 to 40 token ids in [3, vocab_size)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(num)]


@torch.inference_mode()
def hf_generate(model: transformers.PreTrainedModel, prompt: list[int]) -> list[int]:
    gen = transformers.GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(torch.tensor([prompt]), generation_config=gen)
    return out[0, len(prompt):].tolist()


def engine_tokens(loaded: LoadedModel, prompts: list[list[int]], **overrides) -> list[list[int]]:
    """The engine's NUM_NEW greedy tokens per prompt, on the CPU in fp32, in the step mode of step_modes.MODE."""
    settings = dict(model=loaded.source_dir, device="cpu", dtype="float32", num_pages=256, page_size=4,
                    enable_overlap=MODE["overlap"])
    engine = Engine(EngineConfig(**{**settings, **overrides}), loaded=loaded)
    return [r.samples[0].token_ids for r in engine.generate(prompts, GREEDY)]


def greedy_both_ways(path: Path, hf: transformers.PreTrainedModel, vocab_size: int,
                     max_num_batched_tokens: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """(the engine's, transformers') greedy tokens for random_prompts(vocab_size), the checkpoint loaded from path;
    max_num_batched_tokens small: the prompts prefill in chunks."""
    prompts = random_prompts(vocab_size)
    overrides = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    return engine_tokens(load_model(str(path)), prompts, **overrides), [hf_generate(hf, p) for p in prompts]
