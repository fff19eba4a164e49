"""Hugging Face transformers as the reference: the same weights, greedy decoding, raw-logit logprobs."""
from __future__ import annotations

import torch
import transformers

from services.gpu_worker.model.loader import LoadedModel, hf_config_dict


def hf_model(loaded: LoadedModel) -> torch.nn.Module:
    """A transformers model holding exactly the loaded weights (fp32, eval mode)."""
    cfg_dict = dict(hf_config_dict(loaded.config))
    model_type = cfg_dict.pop("model_type")
    cfg_dict.pop("architectures", None)
    config = transformers.AutoConfig.for_model(model_type, **cfg_dict)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(
        {k: v.float() for k, v in loaded.state_dict.items()}, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not loaded.config.tie_word_embeddings]
    assert not missing and not unexpected, (missing, unexpected)
    if loaded.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int,
              num_top: int = 0) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """Greedy continuation with transformers' KV cache; logprobs from the raw logits."""
    input_ids = torch.tensor([prompt])
    out = model(input_ids=input_ids, use_cache=True)
    tokens, logprobs, tops = [], [], []
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(torch.argmax(logp))
        tokens.append(token)
        logprobs.append(float(logp[token]))
        values, ids = torch.topk(logp, num_top)
        tops.append(list(zip(ids.tolist(), values.tolist())))
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs, tops


@torch.inference_mode()
def hf_prompt_logprobs(model: torch.nn.Module, prompt: list[int],
                       num_top: int = 0) -> list[tuple[float, int, list[tuple[int, float]]] | None]:
    """Teacher-forced prompt logprobs: per prompt token its (logprob, rank, top num_top) given the tokens before it,
    None for the first (one forward over the whole prompt, no cache)."""
    logp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)  # [P, V]
    entries: list[tuple[float, int, list[tuple[int, float]]] | None] = [None]
    for position, token in enumerate(prompt[1:]):
        row = logp[position]
        values, ids = torch.topk(row, num_top)
        entries.append((float(row[token]), int((row > row[token]).sum()) + 1, list(zip(ids.tolist(), values.tolist()))))
    return entries
