"""radixserve bench's real client and runner against an in-process fake OpenAI server with scripted timings.

The fake streams `max_tokens` one-token chunks: the first after TTFT_S, the rest TOKEN_GAP_S apart, then
the usage chunk (cached_tokens = half the prompt) and [DONE]. Script by the first prompt token id:
429 → HTTP 429 at once; 500 → an error event after the first token; anything else → normal. With
has_metrics, /metrics exports W6's worker series for one worker: every prompt token queried, half of them hits.
"""
from __future__ import annotations

import asyncio
import json
import math
import socket

import pytest
import pytest_asyncio
from aiohttp import web

from radixserve.bench import runner, workloads
from radixserve.bench.client import Target
from radixserve.bench.main import run_bench
from radixserve.bench.metrics import summarize, totals
from radixserve.bench.workloads import IdPrompts, RequestSpec, Workload
from radixserve.cli import build_parser

TTFT_S, TOKEN_GAP_S = 0.05, 0.01
MODEL = "fake-model"
pytestmark = pytest.mark.asyncio


class FakeServer:
    def __init__(self, has_metrics: bool = False) -> None:
        self.num_in_flight = self.max_in_flight = 0
        self.num_prompt_tokens = 0
        self.bodies: list[dict] = []
        self.port = _free_port()
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        if has_metrics:
            self.app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(self.app)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        text = "".join(f'radixserve_{name}{{worker_id="w0"}} {value}\n' for name, value in (
            ("kv_cache_usage_perc", 0.5), ("num_requests_running", self.num_in_flight),
            ("prefix_cache_queries_total", self.num_prompt_tokens),
            ("prefix_cache_hits_total", self.num_prompt_tokens / 2)))
        return web.Response(text=text)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.num_prompt_tokens += len(body.get("prompt") or [])
        is_chat = "messages" in body
        prompt = body.get("prompt") or [0] * 8
        if prompt[0] == 429:
            return web.json_response({"error": {"message": "slow down", "code": 429}}, status=429)
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            return await self._stream(request, body, prompt, is_chat)
        finally:
            self.num_in_flight -= 1

    async def _stream(self, request, body, prompt, is_chat) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def event(obj) -> None:
            await response.write(f"data: {json.dumps(obj)}\n\n".encode())

        if is_chat:
            await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None})
        await asyncio.sleep(TTFT_S)
        num_tokens = body["max_tokens"]
        for i in range(num_tokens):
            if i:
                await asyncio.sleep(TOKEN_GAP_S)
            if i == 1 and prompt[0] == 500:
                await event({"error": {"message": "engine died", "type": "server_error", "code": 500}})
                return response
            finish = "length" if i == num_tokens - 1 else None
            choice = ({"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": finish} if is_chat
                      else {"index": 0, "text": f" t{i}", "finish_reason": finish})
            await event({"choices": [choice], "usage": None})
        await event({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": num_tokens,
                                              "prompt_tokens_details": {"cached_tokens": len(prompt) // 2}}})
        await response.write(b"data: [DONE]\n\n")
        return response


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest_asyncio.fixture
async def fake():
    server = FakeServer()
    await server.start()
    yield server
    await server.runner.cleanup()


@pytest_asyncio.fixture
async def fake_with_metrics():
    server = FakeServer(has_metrics=True)
    await server.start()
    yield server
    await server.runner.cleanup()


def _spec(first_id: int, num_prompt: int = 8, max_tokens: int = 6) -> RequestSpec:
    return RequestSpec(max_tokens, prompt=[first_id] + [1000] * (num_prompt - 1), num_prompt_tokens=num_prompt)


async def test_timings_counts_and_errors_by_kind(fake):
    specs = [_spec(1) for _ in range(4)] + [_spec(429), _spec(500)]
    target = Target(fake.url, MODEL)
    records, duration_s = await runner.run(Workload("t", requests=specs), target, [0.0] * 6, IdPrompts(32000),
                                           is_progress=False)
    figures = summarize(records, duration_s)
    assert (figures["num_ok"], figures["errors"]) == (4, {"http_429": 1, "stream_error": 1})
    assert records[5].error_message == "engine died" and records[4].error_message == "slow down"
    assert figures["num_output_tokens"] == 24 and figures["num_prompt_tokens"] == 32
    assert figures["num_short_outputs"] == 0
    assert figures["cache_hit_rate"] == pytest.approx(0.5)
    for record in records[:4]:
        assert TTFT_S <= record.ttft_s < TTFT_S + 0.5
        assert len(record.itl_s) == 5
        # One late read shortens the next gap, so bound the arrival times, not each gap: token k+1 cannot
        # arrive before the server has slept TTFT_S + k gaps (2 ms of slack for the event loop's clock).
        arrivals = [record.ttft_s + sum(record.itl_s[:k]) for k in range(6)]
        assert all(arrival >= TTFT_S + k * TOKEN_GAP_S - 0.002 for k, arrival in enumerate(arrivals))
        assert min(record.itl_s) > 0
        assert sorted(record.itl_s)[2] < TOKEN_GAP_S + 0.1
        assert record.e2e_s == pytest.approx(record.ttft_s + sum(record.itl_s), abs=0.05)
        assert record.tpot_s == pytest.approx(sum(record.itl_s) / 5, abs=0.01)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] is True
               and b["max_tokens"] == 6 and b["temperature"] == 0.0 for b in fake.bodies)


async def test_chat_stream_skips_the_empty_role_chunk(fake):
    spec = RequestSpec(3, messages=[{"role": "user", "content": "hi"}], num_prompt_tokens=1)
    records, _ = await runner.run(Workload("t", requests=[spec]), Target(fake.url, MODEL, is_chat=True,
                                                                         ignore_eos=False),
                                  [0.0], IdPrompts(32000), is_progress=False)
    assert records[0].is_ok and records[0].num_output_tokens == 3
    assert records[0].ttft_s >= TTFT_S  # the role chunk arrives at once but carries no token
    assert "ignore_eos" not in fake.bodies[0]


async def test_concurrency_cap_and_arrival_schedule(fake):
    specs = [_spec(1, max_tokens=2) for _ in range(4)]
    records, duration_s = await runner.run(Workload("t", requests=specs), Target(fake.url, MODEL), [0.0] * 4,
                                           IdPrompts(32000), concurrency=1, is_progress=False)
    assert fake.max_in_flight == 1 and all(r.is_ok for r in records)
    assert duration_s >= 4 * (TTFT_S + TOKEN_GAP_S)
    records, _ = await runner.run(Workload("t", requests=specs), Target(fake.url, MODEL), [0.0, 0.0, 0.3, 0.3],
                                  IdPrompts(32000), is_progress=False)
    assert records[2].start_s - records[0].start_s >= 0.29


async def test_sessions_carry_their_history(fake):
    settings = workloads.resolve("w5", workloads.Settings(num_sessions=2, turns=3, prefix_len=5, input_len=2,
                                                          output_len=2))
    work = workloads.build("w5", settings, IdPrompts(32000), seed=0)
    records, _ = await runner.run(work, Target(fake.url, MODEL), [0.0, 0.0], IdPrompts(32000), is_progress=False)
    assert [r.num_prompt_tokens for r in records] == [7, 11, 15] * 2
    assert [(r.session_id, r.turn) for r in records] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    by_session = [b["prompt"] for b in fake.bodies if b["prompt"][:5] == work.sessions[0].system]
    assert all(len(p) >= 7 for p in by_session)
    turn2 = next(b["prompt"] for b in fake.bodies if len(b["prompt"]) == 15 and
                 b["prompt"][5:7] == work.sessions[0].user_turns[0])
    assert turn2 == (work.sessions[0].system + work.sessions[0].user_turns[0] + work.sessions[0].answer_standins[0]
                     + work.sessions[0].user_turns[1] + work.sessions[0].answer_standins[1]
                     + work.sessions[0].user_turns[2])


async def test_command_writes_json_plots_and_compares(fake, tmp_path, capsys):
    argv = ["bench", "--base-url", fake.url + "/v1", "--workload", "w2", "--variant", "shared,random",
            "--num-groups", "2", "--per-group", "2", "--prefix-len", "8", "--input-len", "4", "--output-len", "3",
            "--rate", "50,inf", "--warmup", "1", "--slo-ttft-ms", "10000", "--out-dir", str(tmp_path),
            "--name", "w2run", "--no-progress"]
    rc = await asyncio.to_thread(run_bench, build_parser().parse_args(argv), argv[1:])
    assert rc == 0
    record = json.loads((tmp_path / "w2run.json").read_text())
    assert record["command"].startswith("radixserve bench --base-url")
    assert [r["label"] for r in record["runs"]] == ["shared, rate=50", "shared, rate=inf",
                                                    "random, rate=50", "random, rate=inf"]
    assert all(r["figures"]["num_ok"] == 4 and len(r["requests"]) == 4 for r in record["runs"])
    assert record["runs"][0]["figures"]["goodput"] > 0
    assert record["settings"]["prefix_len"] == 8 and record["target"]["model"] == MODEL
    assert len(fake.bodies) == 4 * 5  # one warm-up before each run
    assert (tmp_path / "w2run_cdf.png").stat().st_size > 0 and (tmp_path / "w2run_ttft_vs_rate.png").exists()
    assert "TTFT p90 ms" in capsys.readouterr().out
    argv = ["bench", "--compare", str(tmp_path / "w2run.json"), str(tmp_path / "w2run.json"),
            "--out-dir", str(tmp_path), "--name", "cmp"]
    assert run_bench(build_parser().parse_args(argv), argv[1:]) == 0
    out = capsys.readouterr().out
    assert "1.00x" in out and (tmp_path / "cmp_cdf.png").exists()
    assert not math.isnan(record["runs"][0]["figures"]["ttft"]["p50_ms"])


def _w6_source(seed: int = 0) -> workloads.Sustained:
    settings = workloads.resolve("w6", workloads.Settings(num_groups=2, prefix_len=6, input_len=4, output_len=3))
    return workloads.Sustained(settings, IdPrompts(32000), seed)


async def test_closed_loop_holds_its_concurrency_and_accounts_for_every_request(fake):
    source = _w6_source()
    records, _, rows = await runner.run_closed_loop(source.request, Target(fake.url, MODEL), concurrency=3,
                                                    duration_s=0.6, sample_interval_s=0.2, is_progress=False)
    assert fake.max_in_flight == 3 and len(records) == len(fake.bodies) >= 3
    assert [r.index for r in records] == list(range(len(records)))
    assert sorted(b["prompt"] for b in fake.bodies) == sorted(source.request(i).prompt for i in range(len(records)))
    assert [r.max_tokens for r in records] == [source.request(i).max_tokens for i in range(len(records))]
    result = totals(records, is_ignore_eos=True)
    assert result["is_exact"] is True and result["num_failed"] == 0
    assert result["num_completion_tokens"] == result["num_expected_tokens"] == sum(r.max_tokens for r in records)
    assert result["finish_reasons"] == {"length": len(records)}
    assert len(rows) == 3 and rows[-1]["t_end_s"] >= 0.6
    assert [r["t_start_s"] for r in rows[1:]] == [r["t_end_s"] for r in rows[:-1]]
    assert sum(r["num_output_tokens"] for r in rows) <= result["num_completion_tokens"]
    assert all(r[k] is None for r in rows for k in ("kv_cache_usage_perc", "hit_rate", "num_preemptions"))


async def test_closed_loop_samples_the_server_series(fake_with_metrics):
    records, _, rows = await runner.run_closed_loop(_w6_source().request, Target(fake_with_metrics.url, MODEL), 2,
                                                    duration_s=0.4, sample_interval_s=0.2, is_progress=False)
    assert len(rows) == 2 and all(r.is_ok for r in records)
    assert all(r["kv_cache_usage_perc"] == 0.5 and r["num_preemptions"] is None for r in rows)
    assert sum(r["prefix_cache_queries"] for r in rows) <= fake_with_metrics.num_prompt_tokens
    assert [r["hit_rate"] for r in rows if r["prefix_cache_queries"]] == [0.5] * sum(
        1 for r in rows if r["prefix_cache_queries"])
    assert any(r["prefix_cache_queries"] for r in rows)


async def test_w6_command_writes_series_totals_and_a_timeline(fake_with_metrics, tmp_path, capsys):
    argv = ["bench", "--base-url", fake_with_metrics.url, "--workload", "sustained", "--duration-s", "0.6",
            "--sample-interval-s", "0.2", "--concurrency", "2", "--num-groups", "2", "--prefix-len", "6",
            "--input-len", "4", "--output-len", "3", "--out-dir", str(tmp_path), "--name", "w6run",
            "--request-detail", "none", "--no-progress"]
    assert await asyncio.to_thread(run_bench, build_parser().parse_args(argv), argv[1:]) == 0
    record = json.loads((tmp_path / "w6run.json").read_text())
    run = record["runs"][0]
    assert record["workload"] == "w6" and record["settings"]["duration_s"] == 0.6
    assert record["settings"]["concurrency"] == 2 and record["settings"]["request_detail"] == "none"
    assert run["requests"] == [] and len(run["samples"]) == 3
    assert run["totals"]["is_exact"] is True and run["totals"]["num_sent"] == len(fake_with_metrics.bodies)
    assert run["figures"]["num_requests"] == run["totals"]["num_sent"]
    assert run["sustained"]["steady_basis"].startswith("first and last 20 %")
    assert run["sustained"]["steady_num_samples"] == 1 and run["sustained"]["concurrency"] == 2
    assert (tmp_path / "w6run_timeline.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "steady ratio" in out and "exact" in out
    argv = ["bench", "--compare", str(tmp_path / "w6run.json"), str(tmp_path / "w6run.json"),
            "--out-dir", str(tmp_path), "--name", "cmp"]
    assert run_bench(build_parser().parse_args(argv), argv[1:]) == 0
    assert (tmp_path / "cmp_timeline.png").stat().st_size > 0 and not (tmp_path / "cmp_cdf.png").exists()
