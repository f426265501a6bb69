"""The gateway end to end: redis-server, two replicas on the tiny model, the gateway, all real
processes, driven by the official ``openai`` client with only ``base_url`` and ``api_key`` set."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.helpers.metrics import sample_value, scrape
from tests.helpers.processes import Service, running_stack
from tests.helpers.waiting import wait_until

BLOCK = 16


@dataclass
class Stack:
    model: str
    gateway: Service
    replicas: list[Service]
    client: OpenAI


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(llama_dir, tmp_path_factory.mktemp("gateway-stack"), 2) as processes:
        client = OpenAI(base_url=f"{processes.gateway.url}/v1", api_key="unused", max_retries=0)
        yield Stack(processes.model, processes.gateway, processes.replicas, client)


def chat(
    stack: Stack, messages: list[dict[str, str]], **fields: object
) -> tuple[str, openai.types.chat.ChatCompletion]:
    """One non-streaming chat; returns the replica that served it and the completion."""
    settings = {"max_tokens": 6, "temperature": 0, **fields}
    raw = stack.client.chat.completions.with_raw_response.create(
        model=stack.model, messages=messages, **settings
    )
    return raw.headers["x-kvroute-replica"], raw.parse()


def test_chat_and_completions_through_the_gateway(stack: Stack) -> None:
    replica, reply = chat(stack, [{"role": "user", "content": "Hello there, gateway."}])
    assert replica in {f"127.0.0.1:{r.port}" for r in stack.replicas}
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    completion = stack.client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=5)
    assert completion.choices[0].text and completion.usage.completion_tokens == 5
    assert [m.id for m in stack.client.models.list().data] == [stack.model]


def test_streaming_with_and_without_usage(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Stream me a few words."}]
    plain = list(
        stack.client.chat.completions.create(model=stack.model, messages=messages, max_tokens=6, stream=True)
    )
    assert all(chunk.choices for chunk in plain), "usage the client did not ask for must not appear"
    with_usage = list(
        stack.client.chat.completions.create(
            model=stack.model,
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 6


def test_a_conversation_stays_where_its_prefix_is_cached(stack: Stack) -> None:
    messages = [{"role": "system", "content": "You answer questions about routing. " * 8}]
    served_by, previous_prompt = set(), 0
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question number {turn}: where am I cached?"})
        replica, reply = chat(stack, messages)
        assert reply.usage is not None
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if turn:
            served_by.add(replica)
            assert cached >= previous_prompt // BLOCK * BLOCK - BLOCK, (turn, cached, previous_prompt)
        previous_prompt = reply.usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    assert len(served_by) == 1, f"turns 2-4 should stick to one replica, went to {served_by}"


def test_errors_reach_the_sdk_as_its_exception_classes(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError):
        stack.client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError):
        stack.client.chat.completions.create(model=stack.model, messages=[])
    with pytest.raises(openai.BadRequestError):
        stack.client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "x"}], temperature=-1
        )


def test_concurrent_new_conversations_spread_and_then_stick(stack: Stack) -> None:
    """Two conversations with different system prompts, sent at once: the first decision counts
    its request (load and predicted blocks) before awaiting anything, so the second goes to the
    other replica; each one's next turn then returns to where its prefix is cached."""
    conversations = [
        [{"role": "system", "content": f"Persona {name}: " + "you talk about caches. " * 10}]
        for name in ("alpha", "beta")
    ]
    for messages in conversations:
        messages.append({"role": "user", "content": "First question?"})
    # Long enough answers that the two requests overlap even on a loaded machine (were the first
    # done before the second is routed, the loads would tie and the choice be a coin flip).
    with ThreadPoolExecutor(2) as pool:
        first = list(
            pool.map(lambda m: chat(stack, m, max_tokens=256, extra_body={"ignore_eos": True}), conversations)
        )
    assert first[0][0] != first[1][0], "equal load: the two new conversations must not pile up"
    for (replica, reply), messages in zip(first, conversations, strict=True):
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": "Second question?"},
        ]
        again, second = chat(stack, messages)
        assert again == replica
        assert second.usage is not None and second.usage.prompt_tokens_details.cached_tokens > 0


def _metric(replica: Service, name: str, **labels: str) -> float:
    """The sum of a replica metric's samples (all of them, or those with ``labels``)."""
    return sample_value(scrape(replica.url), name, default=0.0, **labels)


def _long_talk(stack: Stack, content: str, **fields: object) -> dict[str, object]:
    """A chat the replica would spend a long while answering (2,000 tokens, EOS ignored)."""
    messages = [{"role": "user", "content": content}]
    return {"model": stack.model, "messages": messages, "max_tokens": 2000, "ignore_eos": True, **fields}


def _wait_until_idle(replicas: list[Service]) -> None:
    wait_until(
        lambda: sum(_metric(r, "vllm:num_requests_running") for r in replicas) == 0,
        "the replica to stop generating after the client left",
        timeout=20,
    )


def test_a_client_leaving_mid_stream_aborts_the_replica_request(stack: Stack) -> None:
    body = _long_talk(stack, "Talk for a long while.", stream=True)
    generated = {r.port: _metric(r, "vllm:generation_tokens_total") for r in stack.replicas}
    with httpx.stream("POST", f"{stack.gateway.url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        served_by = response.headers["x-kvroute-replica"]
        replica = next(r for r in stack.replicas if f"127.0.0.1:{r.port}" == served_by)
        assert next(line for line in response.iter_lines() if line.startswith("data: {"))
    _wait_until_idle([replica])
    assert _metric(replica, "vllm:generation_tokens_total") - generated[replica.port] < 1000


def _aborted(stack: Stack) -> float:
    """Requests the stack's replicas ended as aborted."""
    return sum(_metric(r, "vllm:request_success_total", finished_reason="abort") for r in stack.replicas)


def test_a_client_leaving_before_a_whole_reply_aborts_the_replica_request(stack: Stack) -> None:
    """Non-streaming: the client gives up while the replica is still generating."""
    body = _long_talk(stack, "Talk for a long while, then stop.")
    aborted = _aborted(stack)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.gateway.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    _wait_until_idle(stack.replicas)
    assert _aborted(stack) == aborted + 1


def test_bad_bodies_are_refused_before_any_replica(stack: Stack) -> None:
    url = f"{stack.gateway.url}/v1/chat/completions"
    broken = httpx.post(url, content=b'{"model": ', headers={"content-type": "application/json"}, timeout=10)
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    huge = httpx.post(url, content=b"x" * (9 * 1024 * 1024), timeout=30)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    ids = httpx.post(
        f"{stack.gateway.url}/v1/completions", json={"model": stack.model, "prompt": [2**40]}, timeout=10
    )
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"
    assert httpx.get(url, timeout=10).status_code == 405
