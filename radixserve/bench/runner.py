"""Drives one run: open-loop arrivals (or a concurrency cap), sessions turn by turn, a progress bar; or W6's
closed loop at a fixed concurrency, sampled over time."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp

from radixserve.bench import scrape, timeline
from radixserve.bench.client import Target, send
from radixserve.bench.metrics import RequestRecord
from radixserve.bench.workloads import IdPrompts, RequestSpec, SessionSpec, TextPrompts, Workload


class _Progress:
    """tqdm on stderr when installed and wanted; otherwise nothing."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=description, file=sys.stderr, unit="req", leave=False)
            except ImportError:
                pass

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run(workload: Workload, target: Target, arrivals: list[float], maker: IdPrompts | TextPrompts,
              concurrency: int | None = None, description: str = "bench",
              is_progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Send the workload; arrivals[i] is request (or session) i's send time in seconds from the start.

    Returns the records in request order and the duration: the first send to the last answer.
    """
    limit = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    progress = _Progress(workload.num_requests, description, is_progress)
    records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.perf_counter()

        async def one(spec: RequestSpec, index: int) -> RequestRecord:
            async with limit:
                record = await send(http, target, spec, index, start)
            records.append(record)
            progress.update()
            return record

        async def at(delay_s: float, job):
            await asyncio.sleep(max(0.0, start + delay_s - time.perf_counter()))
            return await job

        if workload.sessions:
            jobs = [at(arrivals[i], _session(one, s, i, maker, target.is_chat))
                    for i, s in enumerate(workload.sessions)]
        else:
            jobs = [at(arrivals[i], one(spec, i)) for i, spec in enumerate(workload.requests)]
        await asyncio.gather(*jobs)
        ends = [r.start_s + (r.e2e_s or 0.0) for r in records]
    progress.close()
    records.sort(key=lambda r: r.index)
    first = min((r.start_s for r in records), default=0.0)
    return records, (max(ends, default=first) - first)


def raise_open_files_limit() -> None:
    """A thousand streams need a thousand sockets: lift the soft limit on open files to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


FAILURE_PAUSE_S = 0.5  # a closed loop waits this long after a failed request, so a dead server is not flooded


class _LiveCounts:
    def __init__(self) -> None:
        self.num_tokens = self.num_finished = self.num_in_flight = 0

    def add_tokens(self, num: int) -> None:
        self.num_tokens += num

    def snapshot(self, t_s: float, server: dict[str, float | None]) -> timeline.Snapshot:
        return timeline.Snapshot(t_s, self.num_tokens, self.num_finished, self.num_in_flight, server)


async def run_closed_loop(source: Callable[[int], RequestSpec], target: Target, concurrency: int,
                          duration_s: float, sample_interval_s: float,
                          is_progress: bool = True) -> tuple[list[RequestRecord], float, list[dict[str, Any]]]:
    """W6: `concurrency` loops, each sending source(i) for the next i as soon as its previous request ends,
    until duration_s; requests still in flight then run to their end, so every request is accounted for.

    Every sample_interval_s, and at duration_s, the client's counts are read and the server's /metrics is
    scraped (timeline.window_row). Returns the records by index, the duration (first send to last answer)
    and the window rows.
    """
    counts = _LiveCounts()
    records: list[RequestRecord] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        snapshots = [counts.snapshot(0.0, await scrape.fetch_server_series(http, target.base_url, target.headers))]
        start = time.perf_counter()
        deadline, indices = start + duration_s, itertools.count()

        async def loop() -> None:
            while time.perf_counter() < deadline:
                index = next(indices)
                counts.num_in_flight += 1
                record = await send(http, target, source(index), index, start, counts.add_tokens)
                counts.num_in_flight -= 1
                counts.num_finished += 1
                records.append(record)
                if not record.is_ok:
                    await asyncio.sleep(FAILURE_PAUSE_S)

        async def sample() -> None:
            for k in itertools.count(1):
                t_s = min(k * sample_interval_s, duration_s)
                await asyncio.sleep(max(0.0, start + t_s - time.perf_counter()))
                now_s = time.perf_counter() - start
                taken = counts.snapshot(now_s, {})
                server = await scrape.fetch_server_series(http, target.base_url, target.headers)
                snapshots.append(replace(taken, server=server))
                if is_progress:
                    print(_sample_line(timeline.window_row(snapshots[-2], snapshots[-1])), file=sys.stderr)
                if t_s >= duration_s:
                    return

        await asyncio.gather(sample(), *[loop() for _ in range(concurrency)])
    records.sort(key=lambda r: r.index)
    ends = [r.start_s + (r.e2e_s or 0.0) for r in records]
    return records, max(ends, default=0.0), timeline.rows(snapshots)


def _sample_line(row: dict[str, Any]) -> str:
    def show(key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, fmt)

    return (f"[{row['t_end_s']:7.1f}s] {show('output_tok_s', '.1f')} out tok/s, {row['num_finished']} finished, "
            f"{row['num_in_flight']} in flight; server: kv {show('kv_cache_usage_perc', '.3f')}, "
            f"hit rate {show('hit_rate', '.3f')}, running {show('num_requests_running', '.0f')}, "
            f"waiting {show('num_requests_waiting', '.0f')}, preemptions {show('num_preemptions', '.0f')}")


async def _session(one, session: SessionSpec, session_index: int, maker: IdPrompts | TextPrompts,
                   is_chat: bool) -> None:
    """The turns of one session in order, each after the previous answer; the history grows each turn."""
    history: list = []  # prompt parts (completions) or messages (chat)
    base_index = session_index * len(session.user_turns)
    for turn, user in enumerate(session.user_turns):
        if is_chat:
            messages = [{"role": "system", "content": session.system}, *history, {"role": "user", "content": user}]
            spec = RequestSpec(session.max_tokens, messages=messages,
                               num_prompt_tokens=sum(maker.count(m["content"]) for m in messages))
        else:
            prompt = maker.join([session.system, *history, user])
            spec = RequestSpec(session.max_tokens, prompt=prompt, num_prompt_tokens=maker.count(prompt))
        record = await one(spec, base_index + turn)
        record.session_id, record.turn = session_index, turn
        if not record.is_ok:
            return
        if is_chat:
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": record.output_text}]
        else:
            answer = record.output_text if maker.is_text else session.answer_standins[turn]
            history += [user, answer]


def warmup_workload(workload: Workload, num: int) -> Workload:
    """The first num requests (sessions: their first turns) of a workload, to send before measuring."""
    if workload.sessions:
        sessions = [replace(s, user_turns=s.user_turns[:1], answer_standins=s.answer_standins[:1])
                    for s in workload.sessions[:num]]
        return Workload(workload.name, sessions=sessions)
    return Workload(workload.name, requests=[replace(r, arrival_s=None) for r in workload.requests[:num]])
