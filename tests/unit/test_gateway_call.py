"""The gateway's Call (pure, one event loop): chunks of each prompt's generation land at choice p * n + i, the first
error of any prompt fails the call, and what is still running upstream is what open_request_ids names."""
from __future__ import annotations

import asyncio
import math

import pytest

from services.gateway.call import Call
from services.gateway.protocol import ApiError
from services.gateway.responses import RequestOutput
from shared.messages import GenerateChunk, GenerateError


def _call(num_prompts: int, n: int) -> Call:
    ids = [f"r-{p}" for p in range(num_prompts)]
    return Call(ids, asyncio.Queue(), RequestOutput(n, num_prompts), math.inf, 0.0, num_sent=num_prompts)


def test_chunks_land_at_their_choice_and_finished_prompts_are_not_open() -> None:
    async def run() -> None:
        call = _call(3, 2)
        for msg in (GenerateChunk("r-2", 1, "c", [7], finish_reason="stop"), GenerateChunk("r-0", 0, "a", [5]),
                    GenerateChunk("r-2", 2, "bad index", [1]), GenerateChunk("r-2", 0, "d", [8], finish_reason="stop")):
            call.queue.put_nowait(msg)
        assert [(c.request_id, c.index, c.text) for c in [await call.next_chunk() for _ in range(3)]] == [
            ("r-2", 5, "c"), ("r-0", 0, "a"), ("r-2", 4, "d")]
        assert [s.text for s in call.output.samples] == ["a", "", "", "", "d", "c"]
        assert call.open_request_ids() == ["r-0", "r-1"]
        call.num_sent = 1  # r-1 and r-2 never sent: nothing of theirs to abort
        assert call.open_request_ids() == ["r-0"]
    asyncio.run(run())


def test_an_error_of_one_prompt_fails_the_call_and_leaves_the_others_open() -> None:
    async def run() -> None:
        call = _call(2, 1)
        call.queue.put_nowait(GenerateError("r-1", 429, "rate_limit_error", "busy", retry_after_s=2.0,
                                            error_code="x", param="prompt"))
        with pytest.raises(ApiError) as info:
            await call.next_chunk()
        assert (info.value.status, info.value.type, info.value.code, info.value.param, info.value.retry_after_s) == (
            429, "rate_limit_error", "x", "prompt", 2.0)
        assert call.open_request_ids() == ["r-0"]
    asyncio.run(run())


def test_a_deadline_is_a_504() -> None:
    async def run() -> None:
        call = Call(["r"], asyncio.Queue(), RequestOutput(1), asyncio.get_running_loop().time() + 0.05, 0.05)
        with pytest.raises(ApiError) as info:
            await call.next_chunk()
        assert (info.value.status, info.value.code) == (504, "timeout")
    asyncio.run(run())
