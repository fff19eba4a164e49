"""Issue 31, item 5: a short request behind long prompts is not starved. Each step's budget went whole to the
running prompt chunks and admission was strictly in arrival order, so a tiny request behind three long prompts
waited until all of them were computed (229 s on the CPU). Now long prompt chunks leave part of each step to
admission while anything waits.

One real `serve` (random tiny weights, CPU, a small step budget so the long prompts take hundreds of steps); the
assertion is on the order of events, not on time: the short request ends before the later long prompts have
produced their first token."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import serving
from tests.reliability.cluster import MODEL, completion

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LONG_PROMPT_TOKENS = 6000
BUDGET = 32  # tokens a step: each long prompt takes ~190 steps


def stream_events(url: str, body: dict, events: list[tuple[str, float]], name: str) -> None:
    """POST a streaming completion; append (name:first, t) at its first token and (name:done, t) at [DONE]."""
    with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=150) as resp:
        assert resp.status_code == 200, resp.text
        seen_first = False
        for line in resp.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                events.append((f"{name}:done", time.monotonic()))
                return
            chunk = json.loads(data)
            if not seen_first and chunk["choices"] and chunk["choices"][0].get("text") is not None:
                seen_first = True
                events.append((f"{name}:first", time.monotonic()))


def test_a_short_request_behind_long_prompts_ends_before_they_start_answering(tmp_path: Path) -> None:
    args = ["--model", MODEL, "--device", "cpu", "--max-num-batched-tokens", str(BUDGET), "--workers", "1"]
    with serving(args, tmp_path / "serve.log") as url:
        events: list[tuple[str, float]] = []
        threads = []
        for i in range(3):
            prompt = [10 + (7 * i + j) % 400 for j in range(LONG_PROMPT_TOKENS)]
            thread = threading.Thread(target=stream_events, args=(url, completion(MODEL, prompt, 1), events, f"long{i}"))
            thread.start()
            threads.append(thread)
            time.sleep(0.05)  # in this order
        time.sleep(0.2)
        stream_events(url, completion(MODEL, [11, 12, 13, 14], 2), events, "short")
        for thread in threads:
            thread.join(150)
        order = [name for name, _ in sorted(events, key=lambda e: e[1])]
        assert {"long0:done", "long1:done", "long2:done", "short:done"} <= set(order), order
        short_done = order.index("short:done")
        later_longs_first = [order.index(f"long{i}:first") for i in (1, 2)]
        assert all(short_done < position for position in later_longs_first), order
