"""The hard per-replica queue cap, through real processes. Replicas decode one sequence at a time
(``--max-num-seqs 1``), so a second request waits: a replica whose queue (waiting + sent since its
heartbeat) is at the cap is skipped even though it holds the prompt's prefix, and when every
replica is at its cap the client gets 429."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers.processes import StackProcesses, running_stack

# > heartbeat interval (0.2 s) + the gateway's heartbeat poll (0.1 s), and all four streams must be
# placed well before the first one ends (3,900 tokens take the tiny model a few seconds)
SETTLE_S = 0.4
MESSAGES = [
    {"role": "system", "content": "You are the capped assistant. " * 10},
    {"role": "user", "content": "Tell me a long story."},
]


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProcesses]:
    workdir = tmp_path_factory.mktemp("queue-cap")
    with running_stack(
        llama_dir,
        workdir,
        2,
        replica_args=("--max-num-seqs", "1"),
        gateway_args=("--max-queue", "1", "--poll-interval", "0.1"),
    ) as processes:
        yield processes


class LongStream:
    """A streaming chat that occupies (or waits for) its replica until closed. It is sent from a
    thread of its own: the gateway answers once the replica sends the first chunk, which a waiting
    request sends only when it runs, so the headers naming its replica come late."""

    def __init__(self, base_url: str, model: str) -> None:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 3900, "stream": True, "ignore_eos": True}
        self.client = httpx.Client(base_url=base_url, timeout=60)
        self.request = self.client.build_request("POST", "/v1/chat/completions", json=body)
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.response = self.pool.submit(self.client.send, self.request, stream=True)

    @property
    def replica(self) -> str:
        response = self.response.result(timeout=60)
        assert response.status_code == 200
        return response.headers["x-kvroute-replica"]

    def close(self) -> None:
        self.client.close()  # aborts the stream, or the request still waiting for its headers
        self.pool.shutdown(cancel_futures=True)


def test_a_full_queue_sends_requests_elsewhere_then_429(stack: StackProcesses) -> None:
    """Four long streams of one prompt: a replica takes one running and one waiting, then its queue
    is at the cap and the prefix it holds no longer pulls requests to it; the fifth gets 429."""
    body = {"model": stack.model, "messages": MESSAGES, "max_tokens": 2}
    streams: list[LongStream] = []
    with httpx.Client(base_url=stack.gateway.url, timeout=60) as client:
        try:
            client.post("/v1/chat/completions", json=body)  # one replica now holds the prefix
            for _ in range(4):
                streams.append(LongStream(stack.gateway.url, stack.model))
                time.sleep(SETTLE_S)  # let heartbeats report it running or waiting
            refused = client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            placed = sorted(Counter(stream.replica for stream in streams).values())
            assert placed == [2, 2], "each replica: one running, one waiting, then capped"
        finally:
            for stream in streams:
                stream.close()
