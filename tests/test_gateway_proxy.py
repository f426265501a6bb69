"""Forwarding to a real replica: retries before the first byte, SSE relayed, usage taken out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.proxy import SSERelay, UpstreamUnavailable, cached_tokens, open_upstream, with_usage_requested
from kvroute.local_redis import free_port
from tests.replica_process import ReplicaProcess

CHAT = {
    "messages": [{"role": "user", "content": "Say something about prefix caches. " * 6}],
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def replica(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    with ReplicaProcess(
        llama_dir,
        tmp_path_factory.mktemp("proxy") / "replica.log",
        "--dtype",
        "float32",
        "--kv-cache-tokens",
        "4096",
    ) as process:
        yield process


def body(llama_dir: Path, **fields: object) -> dict[str, object]:
    return {"model": llama_dir.name, **CHAT, **fields}


async def relay_events(replica: ReplicaProcess, payload: dict[str, object]) -> tuple[list[bytes], SSERelay]:
    forwarded, client_asked = with_usage_requested(payload)
    async with httpx.AsyncClient(timeout=60) as client:
        upstream = await open_upstream(
            client, [replica.url], "/v1/chat/completions", json.dumps(forwarded).encode(), JSON
        )
        relay = SSERelay(upstream.response, forward_usage=client_asked)
        events = [event async for event in relay]
    return events, relay


def test_dead_candidates_are_skipped_before_any_byte(replica: ReplicaProcess, llama_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            upstream = await open_upstream(
                client,
                [dead, replica.url],
                "/v1/chat/completions",
                json.dumps(body(llama_dir)).encode(),
                JSON,
            )
            assert upstream.url == replica.url and [url for url, _ in upstream.failures] == [dead]
            reply = json.loads(await upstream.response.aread())
            assert cached_tokens(reply["usage"]) == 0
            with pytest.raises(UpstreamUnavailable, match="ConnectError"):
                await open_upstream(client, [dead], "/v1/chat/completions", b"{}", JSON)

    asyncio.run(scenario())


def test_usage_the_client_did_not_ask_for_is_recorded_then_taken_out(
    replica: ReplicaProcess, llama_dir: Path
) -> None:
    events, relay = asyncio.run(relay_events(replica, body(llama_dir, stream=True)))
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert all(chunk["choices"] for chunk in chunks), "the usage-only chunk must not reach the client"
    assert relay.usage is not None and relay.usage["completion_tokens"] == 8
    assert cached_tokens(relay.usage) is not None and relay.first_event_at is not None
    direct = httpx.post(f"{replica.url}/v1/chat/completions", json=body(llama_dir), timeout=60).json()
    streamed = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert streamed == direct["choices"][0]["message"]["content"]


def test_usage_the_client_asked_for_is_forwarded(replica: ReplicaProcess, llama_dir: Path) -> None:
    events, relay = asyncio.run(
        relay_events(replica, body(llama_dir, stream=True, stream_options={"include_usage": True}))
    )
    last_chunk = json.loads(events[-2][len(b"data: ") :])
    assert last_chunk["choices"] == [] and last_chunk["usage"] == relay.usage


def test_closing_the_relay_aborts_the_replica_request(replica: ReplicaProcess, llama_dir: Path) -> None:
    async def scenario() -> None:
        payload, _ = with_usage_requested(body(llama_dir, stream=True, max_tokens=400))
        async with httpx.AsyncClient(timeout=60) as client:
            upstream = await open_upstream(
                client, [replica.url], "/v1/chat/completions", json.dumps(payload).encode(), JSON
            )
            relay = SSERelay(upstream.response, forward_usage=False)
            events = aiter(relay)
            await anext(events)
            await events.aclose()  # what Starlette does when the gateway's client goes away

    asyncio.run(scenario())
    for _ in range(100):
        metrics = httpx.get(f"{replica.url}/metrics", timeout=10).text
        running = [ln for ln in metrics.splitlines() if ln.startswith("vllm:num_requests_running")]
        if running and float(running[0].split()[-1]) == 0:
            return
        asyncio.run(asyncio.sleep(0.05))
    pytest.fail("the replica kept generating after the relay was closed")
