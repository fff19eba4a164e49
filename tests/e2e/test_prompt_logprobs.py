"""Prompt logprobs through `radixserve serve` (one CPU worker in fp32, 32-token steps so long prompts are chunked):
echo with logprobs on /v1/completions, whole and streamed, max_tokens 0, and vLLM's prompt_logprobs on both endpoints
equal transformers' teacher-forced logprobs to 1e-4; a warm prefix cache changes nothing; lm-eval's
local-completions loglikelihood requests, sent as lm-eval sends them and through lm-eval itself, agree with
transformers."""
from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Iterator
from operator import itemgetter
from typing import Any

import pytest
import torch

from services.gpu_worker.model.loader import LoadedModel, load_model
from tests.e2e.conftest import post_json as _post
from tests.e2e.conftest import serving
from tests.reference import hf_model, hf_prompt_logprobs

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
BUDGET = 32  # tokens per engine step: a longer prompt is prefilled in chunks
LONG_TEXT = ("Machine learning is a field of study in artificial intelligence concerned with the development and "
             "study of statistical algorithms that can learn from data and generalise to unseen data. ") * 3
TOL = 1e-4


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    args = ["--workers", "1", "--num-pages", "256", "--device", "cpu", "--dtype", "float32",
            "--max-num-batched-tokens", str(BUDGET)]
    with serving(args, tmp_path_factory.mktemp("serve") / "serve.log") as base:
        yield base


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("bundled", dtype=torch.float32)


@pytest.fixture(scope="module")
def hf(loaded: LoadedModel) -> torch.nn.Module:
    return hf_model(loaded)


@pytest.fixture(scope="module")
def long_ids(loaded: LoadedModel) -> list[int]:
    ids = loaded.tokenizer.encode(LONG_TEXT)
    assert len(ids) > 2 * BUDGET
    return ids


def _events(url: str, body: dict[str, Any]) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        lines = resp.read().decode().splitlines()
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _assert_legacy_prompt(logprobs: dict, prompt: list[int], want: list, num_top: int) -> None:
    """The first len(prompt) entries of legacy logprobs are the prompt's, equal to transformers'."""
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    got = logprobs["token_logprobs"][1:len(prompt)]
    assert got == pytest.approx([w[0] for w in want[1:]], abs=TOL)
    for top, (_, _, hf_top) in zip(logprobs["top_logprobs"][1:len(prompt)], want[1:], strict=True):
        assert len(top) <= num_top  # keyed by text: two ids of one text would share a key
        assert sorted(top.values(), reverse=True) == pytest.approx([v for _, v in hf_top][:len(top)], abs=TOL)


def test_echo_with_logprobs_and_max_tokens_0_equal_transformers(url: str, hf: torch.nn.Module,
                                                                long_ids: list[int], loaded: LoadedModel) -> None:
    short = loaded.tokenizer.encode("The capital of France is Paris.")
    status, body = _post(url + "/v1/completions", {"model": MODEL, "prompt": [short, long_ids], "max_tokens": 0,
                                                   "echo": True, "logprobs": 2})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 0
    for choice, prompt in zip(sorted(body["choices"], key=itemgetter("index")), [short, long_ids], strict=True):
        logprobs = choice["logprobs"]
        assert choice["finish_reason"] == "length"
        assert choice["text"] == loaded.tokenizer.decode(prompt)
        assert len(logprobs["tokens"]) == len(prompt) == len(logprobs["text_offset"])
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["text_offset"][-1] == len(choice["text"]) - len(logprobs["tokens"][-1])
        _assert_legacy_prompt(logprobs, prompt, hf_prompt_logprobs(hf, prompt, 2), 2)
    # a text prompt: the same tokens, and its text as sent
    status, by_text = _post(url + "/v1/completions", {"model": MODEL, "prompt": "The capital of France is Paris.",
                                                      "max_tokens": 0, "echo": True, "logprobs": 2})
    got, want = by_text["choices"][0]["logprobs"], body["choices"][0]["logprobs"]
    assert (got["tokens"], got["text_offset"]) == (want["tokens"], want["text_offset"])
    assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=TOL)


def test_a_warm_prefix_cache_still_gives_every_prompt_logprob(url: str, hf: torch.nn.Module,
                                                              long_ids: list[int]) -> None:
    want = hf_prompt_logprobs(hf, long_ids, 1)
    request = {"model": MODEL, "prompt": long_ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    answers = [_post(url + "/v1/completions", request)[1] for _ in range(2)]
    for body in answers:
        logprobs = body["choices"][0]["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(long_ids) + 1
        _assert_legacy_prompt(logprobs, long_ids, want, 1)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed, not served from cache
    # its pages did enter the cache: the same prompt without logprobs is served from it
    status, plain = _post(url + "/v1/completions", {"model": MODEL, "prompt": long_ids, "max_tokens": 1})
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(long_ids) - 16


def test_streamed_echo_with_logprobs_equals_the_whole_answer(url: str, loaded: LoadedModel) -> None:
    prompt = loaded.tokenizer.encode("One, two, three, four,")
    request = {"model": MODEL, "prompt": [prompt, prompt[:3]], "max_tokens": 3, "temperature": 0, "echo": True,
               "logprobs": 1, "ignore_eos": True}
    _, whole = _post(url + "/v1/completions", request)
    streamed: dict[int, dict] = {}
    for event in _events(url + "/v1/completions", request):
        choice = event["choices"][0]
        mine = streamed.setdefault(choice["index"], {"text": "", "tokens": [], "token_logprobs": [],
                                                      "top_logprobs": [], "text_offset": []})
        if not mine["text"]:  # a choice's first event: its prompt, with the prompt's logprobs
            assert len(choice["logprobs"]["tokens"]) == len(request["prompt"][choice["index"]])
        mine["text"] += choice["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            mine[key] += choice["logprobs"][key]
    for choice in whole["choices"]:
        mine = streamed[choice["index"]]
        assert mine["text"] == choice["text"]
        logprobs = choice["logprobs"]
        assert (mine["tokens"], mine["text_offset"]) == (logprobs["tokens"], logprobs["text_offset"])
        # the two runs may batch the prompts differently, and fp32 GEMMs round by their batch: equal to 1e-4
        assert mine["token_logprobs"] == pytest.approx(logprobs["token_logprobs"], abs=1e-4)
        for got, want in zip(mine["top_logprobs"], logprobs["top_logprobs"], strict=True):
            assert (got is None) == (want is None)
            if want is not None:
                assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)


def test_prompt_logprobs_is_vllms_field_on_completions_and_chat(url: str, hf: torch.nn.Module,
                                                                long_ids: list[int]) -> None:
    status, body = _post(url + "/v1/completions", {"model": MODEL, "prompt": long_ids, "max_tokens": 0,
                                                   "prompt_logprobs": 2})
    assert status == 200, body
    shown = body["choices"][0]["prompt_logprobs"]
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["text"] == ""
    _assert_vllm(shown, long_ids, hf_prompt_logprobs(hf, long_ids, 2))
    messages = [{"role": "user", "content": "Name three fruits."}]
    _, tokenized = _post(url + "/tokenize", {"model": MODEL, "messages": messages})
    status, chat = _post(url + "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                        "prompt_logprobs": 1})
    assert status == 200, chat
    want = hf_prompt_logprobs(hf, tokenized["tokens"], 1)
    _assert_vllm(chat["choices"][0]["prompt_logprobs"], tokenized["tokens"], want)
    assert chat["prompt_logprobs"] == chat["choices"][0]["prompt_logprobs"]
    events = _events(url + "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                    "prompt_logprobs": 1})
    carrying = [e["choices"][0]["prompt_logprobs"] for e in events if "prompt_logprobs" in e["choices"][0]]
    assert carrying == [chat["prompt_logprobs"]]


def _assert_vllm(shown: list, prompt: list[int], want: list) -> None:
    """vLLM's shape: null first, then {id: {logprob, rank, decoded_token}} with the prompt token and the top k."""
    assert len(shown) == len(prompt) and shown[0] is None
    for position, (entry, (logprob, rank, top)) in enumerate(zip(shown[1:], want[1:]), start=1):
        mine = entry[str(prompt[position])]
        assert mine["logprob"] == pytest.approx(logprob, abs=TOL)
        assert mine["rank"] == rank
        assert {int(k) for k in entry} == {prompt[position], *(t for t, _ in top)}


@torch.inference_mode()
def _hf_loglikelihood(hf: torch.nn.Module, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log P(continuation | context) and whether it is the greedy continuation, teacher-forced."""
    logp = torch.log_softmax(hf(input_ids=torch.tensor([context + continuation])).logits[0].float(), dim=-1)
    rows = logp[len(context) - 1:-1]  # [len(continuation), V]
    target = torch.tensor(continuation)
    total = float(rows.gather(1, target.unsqueeze(1)).sum())
    return total, bool((rows.argmax(dim=-1) == target).all())


PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " London"),
         ("Question: what is two plus two?\nAnswer:", " four"), ("One, two, three,", " four, five")]


def test_lm_evals_request_shape_agrees_with_transformers(url: str, hf: torch.nn.Module,
                                                         loaded: LoadedModel) -> None:
    """What lm-eval's local-completions sends for loglikelihood, and how it reads the answer (parse_logprobs)."""
    tok = loaded.tokenizer
    pairs = [(tok.encode(c), tok.encode(x)) for c, x in PAIRS]
    status, body = _post(url + "/v1/completions", {"model": MODEL, "prompt": [c + x for c, x in pairs],
                                                   "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                                                   "echo": True})
    assert status == 200, body
    for choice, (context, continuation) in zip(sorted(body["choices"], key=itemgetter("index")), pairs, strict=True):
        token_logprobs = choice["logprobs"]["token_logprobs"][len(context):-1]
        tops = choice["logprobs"]["top_logprobs"][len(context):-1]
        is_greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, tops))
        want_total, want_greedy = _hf_loglikelihood(hf, context, continuation)
        assert (sum(token_logprobs), is_greedy) == (pytest.approx(want_total, abs=TOL), want_greedy)


def test_lm_eval_local_completions_agrees_with_transformers(url: str, hf: torch.nn.Module, loaded: LoadedModel,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval[api]
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = LocalCompletionsAPI(base_url=url + "/v1/completions", model=MODEL, tokenizer=loaded.source_dir,
                             tokenizer_backend="huggingface", batch_size=2, max_retries=1)
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    answers = lm.loglikelihood(instances, disable_tqdm=True)
    for (total, is_greedy), (context, continuation) in zip(answers, PAIRS, strict=True):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        want_total, want_greedy = _hf_loglikelihood(hf, context_ids, continuation_ids)
        assert math.isclose(total, want_total, abs_tol=TOL) and is_greedy == want_greedy, (context, continuation)
    assert [g for _, g in answers] != [False] * len(PAIRS)  # " Paris" is the greedy continuation


def test_logit_bias_ids_are_checked_and_sampled_rows_obey_the_bias(url: str, loaded: LoadedModel) -> None:
    vocab = loaded.config.vocab_size
    prompt = loaded.tokenizer.encode("The capital of France is")
    status, body = _post(url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                   "logit_bias": {str(vocab): 5}})
    assert status == 400, body
    assert (body["error"]["code"], body["error"]["param"]) == ("invalid_value", "logit_bias")
    assert body["error"]["message"] == f"Invalid key in 'logit_bias': {vocab}. Maximum value is {vocab - 1}."
    forced = loaded.tokenizer.encode(" of")[0]
    for temperature in (0.0, 1.5):  # greedy, and sampled from every token
        status, body = _post(url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4, "seed": 7,
                                                       "temperature": temperature, "logit_bias": {str(forced): 100},
                                                       "logprobs": 0})
        assert status == 200, body
        assert body["choices"][0]["logprobs"]["tokens"] == [" of"] * 4
