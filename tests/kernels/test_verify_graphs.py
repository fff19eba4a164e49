"""Speculative verify steps under CUDA graphs (cuda_graphs.VerifyGraphs), on a GPU: a tiny random model decoding
with a replay proposer whose drafts are partly right gives the plain engine's greedy tokens (up to a near-tie of the
plain run's logprobs), and its drafted steps replay the verify graphs, in buckets 1 and 4."""
from __future__ import annotations

import random

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.request import SamplingParams
from services.gpu_worker.spec.replay import ReplayProposer
from tests.kernels.helpers import gpu_only

PRESET = "tiny-llama"
TIE_MARGIN = 0.05  # logprob gap under which rounding (tf32 dots, other GEMM shapes) may flip a greedy choice
K = 4


def _config(**overrides: object) -> EngineConfig:
    return EngineConfig(model=f"random:{PRESET}", device="cuda", dtype="float32", num_pages=256, page_size=16,
                        **overrides)


def _same_greedy(plain, spec) -> int:
    """Tokens equal until a near-tie in the plain run → how many were compared."""
    num_compared = 0
    for p, s in zip(plain, spec, strict=True):
        for i, (tp, ts) in enumerate(zip(p.token_ids, s.token_ids, strict=True)):
            if tp != ts:
                top = p.logprobs[i].top
                assert top[0][1] - top[1][1] < TIE_MARGIN, f"token {i} differs without a near-tie"
                break
            num_compared += 1
    return num_compared


@pytest.mark.gpu
@gpu_only
def test_verify_steps_replay_graphs_and_keep_the_plain_greedy_output() -> None:
    loaded = load_model(f"random:{PRESET}", dtype=torch.float32, device="cuda", seed=3)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, loaded.config.vocab_size) for _ in range(n)] for n in (21, 30, 14)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = Engine(_config(), loaded=loaded)
    spec = Engine(_config(speculative_method="ngram", num_speculative_tokens=K), loaded=loaded)
    assert spec.verify_graphs is not None and spec.verify_graphs.q == K + 1 and plain.verify_graphs is None
    tries: list[bool] = []  # per step with drafts: whether it replayed (else it ran eager)
    try_forward = spec.verify_graphs.try_forward

    def counted(items):
        out = try_forward(items)
        tries.append(out is not None)
        return out

    spec.verify_graphs.try_forward = counted
    for batch in ([prompts[0]], prompts):  # bucket 1, then bucket 4 with a padding row
        want = [r.samples[0] for r in plain.generate(batch, params)]
        spec.speculator.proposer = ReplayProposer({tuple(p): s.token_ids for p, s in zip(batch, want)}, 0.6,
                                                  loaded.config.vocab_size, seed=1)
        spec.metrics = type(spec.metrics)()
        spec.verify_graphs.num_replays = 0
        tries.clear()
        got = [r.samples[0] for r in spec.generate(batch, params)]
        assert _same_greedy(want, got) >= len(batch) * params.max_tokens // 2
        m = spec.metrics
        assert 0 < m.num_spec_accepted_tokens < m.num_spec_draft_tokens  # drafts partly right: rows of every length
        # the prompts prefill in one step, so every step with drafts is decode-only: each replayed, none ran eager
        assert spec.verify_graphs.num_replays == len(tries) > 0 and all(tries)
