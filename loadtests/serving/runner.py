"""Drives a workload against an endpoint: arrivals, the concurrency cap, and turn after turn.

Conversations arrive as a Poisson process at ``request_rate`` (all at once when infinite), and at
most ``max_concurrency`` of them are active at a time (a slot is held for the whole conversation,
so C concurrent conversations means C clients chatting). Within a conversation each turn is sent
only after the previous answer arrived, with that answer appended to the history.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from loadtests.serving.client import Endpoint, RequestRecord, send
from loadtests.serving.workloads import Conversation, Workload

REQUEST_TIMEOUT_S = 6 * 3600


@dataclass
class RunResult:
    records: list[RequestRecord]
    started: float
    duration_s: float
    # the exact messages each request sent, by (conversation, turn): the oracle re-tokenizes them
    sent_messages: dict[tuple[int, int], list[dict[str, str]]]


def arrival_times(count: int, request_rate: float, rng: random.Random) -> list[float]:
    """Offsets (s) of a Poisson arrival process; all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * count
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


async def run_workload(
    endpoint: Endpoint,
    workload: Workload,
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    on_request_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    rng = random.Random(seed)
    arrivals = arrival_times(len(workload.conversations), request_rate, rng)
    slots = asyncio.Semaphore(max_concurrency or len(workload.conversations))
    records: list[RequestRecord] = []
    sent: dict[tuple[int, int], list[dict[str, str]]] = {}
    limit = max_concurrency or 0  # 0: aiohttp's "no limit"
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    started = time.perf_counter()

    async def converse(index: int, conversation: Conversation, arrival: float) -> None:
        await asyncio.sleep(max(0.0, started + arrival - time.perf_counter()))
        think = random.Random(seed * 1_000_003 + index)
        async with slots:
            history = [dict(message) for message in conversation.opening]
            for turn, question in enumerate(conversation.user_turns):
                if turn and conversation.think_time_s > 0:
                    await asyncio.sleep(think.expovariate(1 / conversation.think_time_s))
                history.append({"role": "user", "content": question})
                sent[(index, turn)] = list(history)
                record = RequestRecord(index, turn, time.perf_counter())
                await send(session, endpoint, history, conversation.max_tokens, record)
                records.append(record)
                if on_request_done is not None:
                    on_request_done(record)
                if not record.ok:
                    return  # the history is broken: later turns would not be the workload's
                history.append({"role": "assistant", "content": record.text})

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(
            *(
                converse(index, conversation, arrival)
                for index, (conversation, arrival) in enumerate(
                    zip(workload.conversations, arrivals, strict=True)
                )
            )
        )
    return RunResult(records, started, time.perf_counter() - started, sent)
