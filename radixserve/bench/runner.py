"""Drives one run: open-loop arrivals (or a concurrency cap), sessions turn by turn, a progress bar."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import replace

import aiohttp

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
