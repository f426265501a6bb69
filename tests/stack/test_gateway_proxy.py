"""Forwarding to a real replica: retries before the first byte, SSE relayed, usage taken out."""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.proxy.relay import SSERelay, UpstreamUnavailable, cached_tokens, forwarded_body, open_upstream
from gateway.proxy.upstream import UpstreamPool
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest, parse_request
from launcher.local_redis import free_port
from tests.helpers.metrics import sample_value, scrape
from tests.helpers.processes import ReplicaProcess
from tests.helpers.waiting import wait_until_async

pytestmark = pytest.mark.anyio  # async tests run on asyncio (tests/conftest.py)

CHAT = {
    "messages": [{"role": "user", "content": "Say something about prefix caches. " * 6}],
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}


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


def forwarded(payload: dict[str, object]) -> tuple[bytes, bool]:
    raw = json.dumps(payload).encode()
    return forwarded_body(raw, parse_request(ChatCompletionRequest, raw))


async def relay_events(replica: ReplicaProcess, payload: dict[str, object]) -> tuple[list[bytes], SSERelay]:
    body, client_asked = forwarded(payload)
    pool = UpstreamPool(read_timeout=60)
    upstream = await open_upstream(pool, [replica.url], "/v1/chat/completions", body)
    relay = SSERelay(upstream.response, forward_usage=client_asked)
    reads = [read async for read in relay]
    await pool.aclose()
    events = [event + b"\n\n" for event in b"".join(reads).split(b"\n\n") if event]
    return events, relay


async def test_dead_candidates_are_skipped_before_any_byte(replica: ReplicaProcess, llama_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    pool = UpstreamPool(read_timeout=60)
    payload = json.dumps(body(llama_dir)).encode()
    upstream = await open_upstream(pool, [dead, replica.url], "/v1/chat/completions", payload, whole=True)
    assert upstream.url == replica.url and [url for url, _ in upstream.failures] == [dead]
    reply = json.loads(await upstream.response.read())
    assert cached_tokens(reply["usage"]) == 0
    with pytest.raises(UpstreamUnavailable, match=r"cannot connect to 127\.0\.0\.1"):
        await open_upstream(pool, [dead], "/v1/chat/completions", b"{}")
    await pool.aclose()


async def test_usage_the_client_did_not_ask_for_is_recorded_then_taken_out(
    replica: ReplicaProcess, llama_dir: Path
) -> None:
    events, relay = await relay_events(replica, body(llama_dir, stream=True))
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert all(chunk["choices"] for chunk in chunks), "the usage-only chunk must not reach the client"
    assert relay.usage is not None and relay.usage["completion_tokens"] == 8
    assert cached_tokens(relay.usage) is not None and relay.first_event_at is not None
    direct = httpx.post(f"{replica.url}/v1/chat/completions", json=body(llama_dir), timeout=60).json()
    streamed = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert streamed == direct["choices"][0]["message"]["content"]


async def test_usage_the_client_asked_for_is_forwarded(replica: ReplicaProcess, llama_dir: Path) -> None:
    events, relay = await relay_events(
        replica, body(llama_dir, stream=True, stream_options={"include_usage": True})
    )
    last_chunk = json.loads(events[-2][len(b"data: ") :])
    assert last_chunk["choices"] == [] and last_chunk["usage"] == relay.usage


async def test_closing_the_relay_aborts_the_replica_request(replica: ReplicaProcess, llama_dir: Path) -> None:
    payload, _ = forwarded(body(llama_dir, stream=True, max_tokens=400))
    pool = UpstreamPool(read_timeout=60)
    upstream = await open_upstream(pool, [replica.url], "/v1/chat/completions", payload)
    relay = SSERelay(upstream.response, forward_usage=False)
    events = aiter(relay)
    await anext(events)
    await events.aclose()  # what the gateway does when its client goes away

    await wait_until_async(
        lambda: sample_value(scrape(replica.url), "vllm:num_requests_running") == 0,
        "the replica to stop generating once the relay was closed",
        timeout=10,
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("clients_own", [False, True])
def test_forwarded_bodies_carry_the_gateways_prompt_ids(stream: bool, clients_own: bool) -> None:
    """The ids the gateway routed on go to the replica as one ``kvroute_prompt_ids`` member, in
    place of any the client sent, beside the usage asked for on its behalf."""
    payload: dict[str, object] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
    }
    if clients_own:
        payload["kvroute_prompt_ids"] = [7, 7, 7]
    raw = json.dumps(payload).encode()
    body, client_asked = forwarded_body(raw, parse_request(ChatCompletionRequest, raw), array("I", [1, 2, 3]))
    assert client_asked is not stream
    sent = json.loads(body)
    assert sent.pop("kvroute_prompt_ids") == [1, 2, 3] and body.count(b'"kvroute_prompt_ids"') == 1
    assert sent.pop("stream_options", None) == ({"include_usage": True} if stream else None)
    assert sent == {key: value for key, value in payload.items() if key != "kvroute_prompt_ids"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_clients_own_prompt_ids_never_reach_the_replica(stream: bool) -> None:
    """Where the gateway sends no ids of its own (a vLLM server, a prompt over the window), ids the
    client put in the body are taken out: the replica would serve them in place of the prompt the
    request was routed on."""
    payload = {"model": "m", "prompt": "hi", "stream": stream, "kvroute_prompt_ids": [7, 7, 7]}
    raw = json.dumps(payload).encode()
    body, _ = forwarded_body(raw, parse_request(CompletionRequest, raw))
    sent = json.loads(body)
    assert "kvroute_prompt_ids" not in sent
    assert sent.pop("stream_options", None) == ({"include_usage": True} if stream else None)
    assert sent == {key: value for key, value in payload.items() if key != "kvroute_prompt_ids"}


@pytest.mark.parametrize(
    ("extra", "asked", "untouched"),
    [
        ({}, True, True),  # not streaming: usage comes anyway
        ({"stream": True, "stream_options": {"include_usage": True}}, True, True),
        ({"stream": True}, False, False),
        ({"stream": True, "stream_options": None}, False, False),
        ({"stream": True, "stream_options": {"include_usage": False, "other": 1}}, False, False),
    ],
)
def test_forwarded_bodies_ask_for_usage_and_keep_everything_else(
    extra: dict[str, object], asked: bool, untouched: bool
) -> None:
    payload = {"model": "m", "messages": [{"role": "user", "content": "héllo"}], "temperature": 0.5, **extra}
    raw = json.dumps(payload, ensure_ascii=False).encode() + b"\n"
    body, client_asked = forwarded_body(raw, parse_request(ChatCompletionRequest, raw))
    assert client_asked is asked and (body == raw) is untouched
    sent = json.loads(body)
    options = sent.pop("stream_options", None)
    expected = dict(payload)
    expected_options = expected.pop("stream_options", None)
    assert sent == expected
    if payload.get("stream"):
        assert options == {**(expected_options or {}), "include_usage": True}
    assert body.count(b'"stream_options"') <= 1
