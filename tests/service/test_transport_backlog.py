"""shared.transport.receive_forever with a backlog: receiving a frame that is already queued does not suspend, so
a burst read in one go held the event loop until the last frame was handled (a real tokenizer given 3,000 requests
of 3,000 token ids at once: its loop stalled 1.1 s, its pings and timers waiting). It hands the loop over every
MAX_HOLD_S."""
from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import zmq

from shared import transport
from shared.messages import AbortRequest, encode

NUM_MESSAGES = 200
WORK_S = 0.002  # per message, on the loop: 0.4 s in all, 20 times MAX_HOLD_S


def test_a_backlog_is_handled_in_slices_that_let_other_tasks_run() -> None:
    async def run() -> list[int]:
        with tempfile.TemporaryDirectory(prefix="rsb") as tmp:
            addr = f"ipc://{Path(tmp) / 'p'}"
            pull = transport.bind(zmq.PULL, addr)
            push = transport.connect(zmq.PUSH, addr)
            for i in range(NUM_MESSAGES):
                await push.send(encode(AbortRequest(f"r{i}")))
            await asyncio.sleep(0.3)  # every frame is queued at the PULL socket before the receive loop starts
            ticks_at: list[int] = []  # how many messages were handled each time the ticker ran
            handled: list[str] = []
            done = asyncio.Event()

            async def handle(msg: AbortRequest, _identity: bytes | None) -> None:
                time.sleep(WORK_S)  # NOTE: on purpose: CPU work of a handler that never awaits
                handled.append(msg.request_id)
                if len(handled) == NUM_MESSAGES:
                    done.set()

            async def tick() -> None:
                while not done.is_set():
                    ticks_at.append(len(handled))
                    await asyncio.sleep(0)

            receiver = asyncio.ensure_future(transport.receive_forever(pull, AbortRequest, handle))
            ticker = asyncio.ensure_future(tick())
            await asyncio.wait_for(done.wait(), 10)
            receiver.cancel()
            await asyncio.gather(ticker, receiver, return_exceptions=True)
            push.close(linger=0)
            pull.close(linger=0)
            assert handled == [f"r{i}" for i in range(NUM_MESSAGES)]
            return ticks_at

    ticks_at = asyncio.run(run())
    during_backlog = sorted({n for n in ticks_at if 0 < n < NUM_MESSAGES})
    max_hold = transport.MAX_HOLD_S / WORK_S + 1  # messages handled between two turns of the other task, at most
    assert len(during_backlog) >= 5, ticks_at
    assert all(b - a <= max_hold for a, b in zip([0, *during_backlog], [*during_backlog, NUM_MESSAGES])), ticks_at
