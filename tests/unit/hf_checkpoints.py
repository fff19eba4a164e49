"""Helpers of the per-family exactness tests: prompts, transformers' fp32 greedy generate() and the engine's greedy
tokens and log-probabilities for the same prompts (tests/unit/test_phi3.py, test_moe_families.py, test_gemma2.py,
test_gemma3.py)."""
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


def save_with_random_norms(model: transformers.PreTrainedModel, root: str,
                           name: str) -> tuple[Path, transformers.PreTrainedModel]:
    """save_checkpoint with every norm weight drawn N(0, 0.3) first: Gemma's, offsets from 1 that transformers
    initialises to 0 (a gain of 1), would otherwise leave the (1 + w) arithmetic untested."""
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.0, 0.3)
    return save_checkpoint(model, root, name)


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
    return [r.samples[0].token_ids for r in _engine_generate(loaded, prompts, GREEDY, **overrides)]


def _engine_generate(loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams, **overrides) -> list:
    settings = dict(model=loaded.source_dir, device="cpu", dtype="float32", num_pages=256, page_size=4,
                    enable_overlap=MODE["overlap"])
    return Engine(EngineConfig(**{**settings, **overrides}), loaded=loaded).generate(prompts, params)


@torch.inference_mode()
def hf_logprobs(model: transformers.PreTrainedModel, prompt: list[int]) -> list[float]:
    """The log-probability of each of transformers' NUM_NEW greedy tokens under its (soft-capped) logits."""
    gen = transformers.GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                                        output_logits=True, return_dict_in_generate=True)
    out = model.generate(torch.tensor([prompt]), generation_config=gen)
    tokens = out.sequences[0, len(prompt):]
    return [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in zip(out.logits, tokens)]


def engine_logprobs(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[float]]:
    """The log-probability of each of the engine's NUM_NEW greedy tokens per prompt."""
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    return [[lp.logprob for lp in r.samples[0].logprobs] for r in _engine_generate(loaded, prompts, params)]


def worst_logprob_gap(loaded: LoadedModel, hf: transformers.PreTrainedModel, vocab_size: int) -> float:
    """The largest |engine - transformers| greedy-token log-probability over 3 random prompts: under 1e-4 when the
    engine computes transformers' model (a feature that changes the probabilities but not the greedy token shows)."""
    prompts = random_prompts(vocab_size, num=3)
    got = torch.tensor([lp for row in engine_logprobs(loaded, prompts) for lp in row])
    want = torch.tensor([lp for p in prompts for lp in hf_logprobs(hf, p)])
    return (got - want).abs().max().item()


def greedy_both_ways(path: Path, hf: transformers.PreTrainedModel, vocab_size: int,
                     max_num_batched_tokens: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """(the engine's, transformers') greedy tokens for random_prompts(vocab_size), the checkpoint loaded from path;
    max_num_batched_tokens small: the prompts prefill in chunks."""
    prompts = random_prompts(vocab_size)
    overrides = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    return engine_tokens(load_model(str(path)), prompts, **overrides), [hf_generate(hf, p) for p in prompts]
