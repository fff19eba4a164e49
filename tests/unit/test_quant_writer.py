"""`radixserve quantize` (quant/writer.py): a checkpoint written from a tiny random model loads through the real loader
into the very layers the quantizer produced and generates the in-memory quantized model's greedy tokens; bad
arguments fail before any work."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import bundled_cache_dir, load_bundled, load_model
from services.gpu_worker.quant.checkpoint import checkpoint_method
from services.gpu_worker.quant.fp8 import dequantize_fp8
from services.gpu_worker.quant.int4 import dequantize_int4
from services.gpu_worker.quant.linear import QuantizedLinear
from services.gpu_worker.quant.quality import sequence_logits
from services.gpu_worker.quant.writer import (check_method, float_model, prepare_out_dir, quantize_checkpoint,
                                              quantize_for_checkpoint_, write_quantized_model)
from services.gpu_worker.request import SamplingParams
from tests.unit.hf_checkpoints import random_prompts, save_checkpoint

NUM_NEW = 6
WINDOWS = [torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]


def _tiny_llama(root: Path, vocab_size: int) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    path, _ = save_checkpoint(transformers.LlamaForCausalLM(cfg), str(root), "dense")
    return path


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("writer"), 256)


def _dequantized(layer: QuantizedLinear) -> torch.Tensor:
    if layer.method == "fp8":
        return dequantize_fp8(layer.qweight, layer.weight_scale)
    return dequantize_int4(layer.int4_weight()).float()


def _greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    for _ in range(NUM_NEW):
        tokens.append(int(sequence_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("method, calibration", [("fp8", "gptq"), ("fp8", "rtn"), ("awq", "awq"), ("gptq", "gptq"),
                                                 ("gptq", "rtn")])
def test_a_written_checkpoint_loads_the_quantizers_layers_and_tokens(dense_dir: Path, tmp_path: Path, method: str,
                                                                     calibration: str):
    loaded = load_model(str(dense_dir))
    model = float_model(loaded)
    lines: list[str] = []
    assert quantize_for_checkpoint_(model, method, calibration, WINDOWS, 32, progress=lines.append) == 2 * 7
    last, num_lines = {"rtn": ("14 linears of 2 decoder layers rounded to nearest", 1),  # progress: one line a
                       "awq": ("model.layers.1: activation-aware scales, alpha ", 2 * 4),  # layer, or a group
                       "gptq": ("model.layers.1: 7 linears quantized (", 2)}[calibration]
    assert lines[-1].startswith(last) and len(lines) == num_lines
    out = tmp_path / "q"
    write_quantized_model(out, model, loaded, method, 32)

    config = json.loads((out / "config.json").read_text())
    assert checkpoint_method(config) == method
    assert config["quantization_config"].get("desc_act", False) == (method == "gptq" and calibration == "gptq")
    served = load_model(str(out))
    assert served.quantization == method and len(served.quantized_linears) == 2 * 7
    for name, written in served.quantized_linears.items():
        assert torch.equal(_dequantized(written), _dequantized(model.get_submodule(name))), name
    state = model.state_dict()
    for name, tensor in served.state_dict.items():  # the dense rest (AWQ: the norms its scales folded into)
        assert torch.equal(tensor, state[name]), name

    engine = Engine(EngineConfig(model=str(out), device="cpu", dtype="float32", num_pages=64, page_size=4))
    assert engine.runner.num_quantized_layers == 2 * 7
    prompts = random_prompts(256, num=3)
    results = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True))
    assert [r.samples[0].token_ids for r in results] == [_greedy(model, p) for p in prompts]


def test_calibrated_weights_differ_from_round_to_nearest(dense_dir: Path):
    loaded = load_model(str(dense_dir))
    layers = {}
    for calibration in ("gptq", "rtn"):
        model = float_model(loaded)
        quantize_for_checkpoint_(model, "fp8", calibration, WINDOWS, 32, progress=lambda line: None)
        layers[calibration] = model.model.layers[1].mlp.down_proj.qweight.float()
    assert not torch.equal(layers["gptq"], layers["rtn"])


def test_int4_layers_share_one_group_size_dividing_every_k(tmp_path: Path):
    out = tmp_path / "awq"
    summary = quantize_checkpoint("random:tiny-llama", "awq", out, "rtn", progress=lambda line: None)
    assert summary.group_size == 64 and summary.num_layers == 14  # K is 64 or 128: one group size, their gcd
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 64
    assert {m.group_size for m in load_model(str(out)).quantized_linears.values()} == {64}


@pytest.mark.parametrize("method, calibration, message", [
    ("int8", None, "unknown quantization method 'int8'"),
    ("fp8", "awq", "--method fp8 takes --calibration gptq or rtn, not 'awq'"),
    ("awq", "gptq", "--method awq takes --calibration awq or rtn"),
])
def test_a_bad_method_or_calibration_is_refused(method: str, calibration: str | None, message: str):
    with pytest.raises(ValueError, match=message):
        check_method(method, calibration)


def test_defaults_are_the_calibrated_quantizers():
    assert [check_method(m, None) for m in ("fp8", "awq", "gptq")] == ["gptq", "awq", "gptq"]


def test_an_out_dir_that_is_not_new_or_empty_or_not_writable_is_refused(tmp_path: Path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        prepare_out_dir(tmp_path / "full")
    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        prepare_out_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="cannot write there"):
        prepare_out_dir(tmp_path / "file" / "out")
    (tmp_path / "empty").mkdir()
    prepare_out_dir(tmp_path / "empty")
    prepare_out_dir(tmp_path / "new" / "out")


def test_calibration_without_a_tokenizer_or_tokens_is_refused_before_any_work(tmp_path: Path):
    with pytest.raises(ValueError, match="has no tokenizer"):
        quantize_checkpoint("random:tiny-llama", "fp8", tmp_path / "q", progress=lambda line: None)
    with pytest.raises(ValueError, match="--calibration-tokens must be at least 1, not 0"):
        quantize_checkpoint("bundled", "awq", tmp_path / "q", calibration_tokens=0, progress=lambda line: None)
    assert not (tmp_path / "q").exists()
    with pytest.raises(ValueError, match="needs token windows of calibration text"):
        quantize_for_checkpoint_(float_model(load_model("random:tiny-llama")), "gptq", "gptq", [], 64)


def test_the_bundled_model_is_written_with_its_tokenizer_and_chat_template(tmp_path: Path):
    out = tmp_path / "bundled-fp8"
    quantize_checkpoint("bundled", "fp8", out, "rtn", progress=lambda line: None)
    served, bundled = load_model(str(out)), load_bundled()
    assert served.quantization == "fp8" and len(served.quantized_linears) == 210
    assert served.tokenizer.chat_template == bundled.tokenizer.chat_template
    assert served.tokenizer("def f(): pass")["input_ids"] == bundled.tokenizer("def f(): pass")["input_ids"]
    assert served.config.eos_token_ids == bundled.config.eos_token_ids
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert "model.layers.0.self_attn.q_proj.weight_scale" in f.keys() and "lm_head.weight" not in f.keys()


def _radixserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixserve", *args], capture_output=True, text=True, timeout=300)


def test_the_cli_writes_a_checkpoint_that_serves(tmp_path: Path):
    source = _tiny_llama(tmp_path, 49152)  # with the bundled tokenizer (its vocabulary): calibration reads text
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_cache_dir() / name, source / name)
    out = tmp_path / "fp8"
    done = _radixserve("quantize", "--model", str(source), "--method", "fp8", "--out", str(out),
                       "--calibration-tokens", "96")
    assert done.returncode == 0, done.stderr
    assert "model.layers.1: 7 linears quantized" in done.stderr and f"wrote {out}" in done.stderr
    engine = Engine(EngineConfig(model=str(out), device="cpu", dtype="float32", num_pages=64, page_size=4))
    assert engine.runner.num_quantized_layers == 2 * 7
    assert engine.runner.model.model.layers[0].self_attn.q_proj.qweight.dtype == torch.float8_e4m3fn
    results = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(results[0].samples[0].token_ids) == 3

    again = _radixserve("quantize", "--model", str(source), "--method", "fp8", "--out", str(out))
    assert again.returncode == 2 and "already exists and is not an empty directory" in again.stderr
    bad = _radixserve("quantize", "--model", str(source), "--method", "int8", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "invalid choice: 'int8'" in bad.stderr


def test_gptq_column_loop_runs_on_one_cpu_thread_and_restores_the_count():
    from services.gpu_worker.quant.gptq import _feedback_quantize_

    seen: list[int] = []

    def round_column(column: int, rest: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return rest[:, 0].round()

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _feedback_quantize_(torch.randn(4, 16), torch.eye(16), 8, round_column)
        assert seen == [1] * 16 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("argv", "want"), [
    (["--method", "awq"], 2048), (["--method", "gptq"], 1024), (["--method", "fp8"], 1024),
    (["--method", "awq", "--calibration-tokens", "96"], 96)])
def test_quantize_cli_calibrates_awq_on_2048_tokens_by_default(monkeypatch, tmp_path, argv, want) -> None:
    """The INT4 grid search meets +10 % on both calibration texts only from 2,048 tokens (docs/PERFORMANCE.md): the
    count the CLI's defaults (or its flag) bring to the writer's calibration text."""
    from radixserve import cli
    from services.gpu_worker.quant import writer

    class Calibrating(Exception):
        pass

    def windows(tokenizer, num_tokens, window):
        raise Calibrating(num_tokens)

    monkeypatch.setattr(writer, "calibration_windows", windows)
    with pytest.raises(Calibrating) as seen:
        cli.main(["quantize", "--model", "bundled", "--out", str(tmp_path / "q"), *argv])
    assert seen.value.args == (want,)
