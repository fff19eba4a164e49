"""Tests of the bundled SmolLM2 GGUF conversion against transformers' own GGUF loader, and its cache."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from services.gpu_worker.model import loader
from services.gpu_worker.model.loader import LoadedModel, bundled_gguf_path, load_model

pytestmark = pytest.mark.slow


def _no_conversion(*args: object) -> None:
    raise AssertionError("the second load converted the GGUF again instead of using the cache")


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cache_root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CACHE_DIR", str(cache_root))
        start = time.perf_counter()
        first = load_model("bundled")
        first_s = time.perf_counter() - start
        mp.setattr(loader, "convert_gguf", _no_conversion)
        start = time.perf_counter()
        second = load_model("smollm2-135m-instruct")
        second_s = time.perf_counter() - start
    return {"first": first, "second": second, "first_s": first_s, "second_s": second_s, "root": cache_root}


@pytest.fixture(scope="module")
def bundled(loads: dict) -> LoadedModel:
    return loads["first"]


@pytest.fixture(scope="module")
def reference_tensors() -> dict[str, torch.Tensor]:
    """transformers' GGUF weights; from_pretrained(gguf_file=...) does this but also needs accelerate."""
    path = bundled_gguf_path()
    hf_config = transformers.AutoConfig.for_model(**load_gguf_checkpoint(path)["config"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]


def test_config(bundled: LoadedModel) -> None:
    c = bundled.config
    assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert (c.rope_theta, c.rms_norm_eps, c.rope_scaling, c.max_position_embeddings) == (100000.0, 1e-5, None, 8192)
    assert c.tie_word_embeddings and "lm_head.weight" not in bundled.state_dict
    assert (c.bos_token_id, c.eos_token_ids, c.model_id) == (1, (2,), "smollm2-135m-instruct")


def test_weights_match_transformers_gguf_loader(
    bundled: LoadedModel, reference_tensors: dict[str, torch.Tensor]
) -> None:
    assert sorted(reference_tensors) == sorted(bundled.state_dict)
    for name, ref in reference_tensors.items():
        ours = bundled.state_dict[name]
        assert ours.dtype == torch.float32 and ours.shape == ref.shape, name
        assert (ours - ref.float()).abs().max().item() <= 1e-6, name


def test_tokenizer_matches_transformers_gguf_tokenizer(bundled: LoadedModel) -> None:
    path = bundled_gguf_path()
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = bundled.tokenizer
    for text in ("Hello world", "<|im_start|>user\nÜnïcode, numbers 12345 and  spaces<|im_end|>"):
        assert tok(text).input_ids == reference(text).input_ids
    assert tok("Hello world").input_ids == [19556, 905]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.chat_template == reference.chat_template and "<|im_start|>" in tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_second_load_reads_the_cache(loads: dict) -> None:
    first, second = loads["first"], loads["second"]
    cache_dir = Path(second.source_dir)
    assert first.source_dir == second.source_dir and cache_dir.parent == loads["root"]
    assert cache_dir.name.startswith("smollm2-135m-instruct-")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in cache_dir.iterdir()}
    assert [p.name for p in loads["root"].iterdir()] == [cache_dir.name]
    assert second.config == first.config
    assert list(second.state_dict) == list(first.state_dict)
    assert all(torch.equal(second.state_dict[k], first.state_dict[k]) for k in first.state_dict)
    assert second.tokenizer("Hello world").input_ids == first.tokenizer("Hello world").input_ids
    assert loads["second_s"] < loads["first_s"] / 3


def test_cached_dir_answers_sensibly_in_transformers(bundled: LoadedModel) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(bundled.source_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = bundled.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert "Paris" in bundled.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
