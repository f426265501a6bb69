"""``kvroute bridge`` between real processes: a real redis-server, a real engine server, the bridge,
and a gateway routing over a mixed fleet. The engine behind the bridge is a kvroute replica started
without Redis (it serves vLLM's /metrics names and /v1/models), and vLLM's side of the events is
played by ``tests.helpers.vllm_events`` (the bytes vLLM sends, built as vLLM builds them); the same
checks against vLLM itself are in tests/stack/test_vllm_bridge.py (slow).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from openai import OpenAI

from kvroute.openai_api.schema import ChatCompletionRequest, parse_request
from kvroute.protocol import Heartbeat, Keys, block_hashes, model_seed
from kvroute.text.tokenizer import TextTokenizer
from launcher.local_redis import RedisServer, free_port
from tests.helpers import vllm_events as vllm
from tests.helpers.faults import ADMIN, ADMIN_KEY, respawn
from tests.helpers.processes import KvrouteProcess, ReplicaProcess, Service
from tests.helpers.waiting import wait_until

VLLM_BLOCK = 128  # vLLM's CPU block size: each of its blocks is 8 kvroute blocks
HISTORY = "Tell me about the history of the printing press in Europe, with dates. " * 12


@dataclass
class Fleet:
    redis: RedisServer
    engine: Service  # what the bridge fronts (vLLM's place)
    replica: Service  # a kvroute replica publishing itself
    bridge: Service
    gateway: Service
    publisher: vllm.FakeVllmPublisher
    model: str
    tokenizer: TextTokenizer

    @property
    def bridged_id(self) -> str:
        return self.engine.replica_id  # host:port of --engine-url


@pytest.fixture
def fleet(redis_server: RedisServer, llama_dir: Path, tmp_path: Path) -> Iterator[Fleet]:
    events = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    publisher = vllm.FakeVllmPublisher(events, replay)
    common = ("--dtype", "float32", "--kv-cache-tokens", "4096")
    with (
        ReplicaProcess(llama_dir, tmp_path / "engine.log", *common) as engine,
        ReplicaProcess(
            llama_dir, tmp_path / "replica.log", *common, "--redis", redis_server.url,
            "--heartbeat-interval", "0.2",
        ) as replica,
        KvrouteProcess(
            "bridge", tmp_path / "bridge.log", "--engine-url", engine.url, "--events", events,
            "--replay", replay, "--model", str(llama_dir), "--redis", redis_server.url,
            "--heartbeat-interval", "0.2",
        ) as bridge,
        KvrouteProcess(
            "gateway", tmp_path / "gateway.log", "--redis", redis_server.url, "--admin-key", ADMIN_KEY,
            "--poll-interval", "0.1",
        ) as gateway,
    ):  # fmt: skip
        tokenizer = TextTokenizer.from_dir(llama_dir)
        try:
            yield Fleet(redis_server, engine, replica, bridge, gateway, publisher, llama_dir.name, tokenizer)
        finally:
            publisher.close()


def chat(model: str, *turns: str) -> dict[str, object]:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    return {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}


def prompt_ids(fleet: Fleet, body: dict[str, object]) -> list[int]:
    """The prompt's token ids as the gateway computes them (and as vLLM would)."""
    request = parse_request(ChatCompletionRequest, json.dumps(body).encode())
    messages, tools, kwargs = request.template_inputs()
    return fleet.tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=True, **kwargs)


def store_prefix(fleet: Fleet, ids: list[int], first_hash: int = 1000) -> list[int]:
    """What vLLM publishes after computing ``ids``: one BlockStored of its full 128-token blocks."""
    count = len(ids) // VLLM_BLOCK
    hashes = list(range(first_hash, first_hash + count))
    fleet.publisher.send(vllm.stored(hashes, None, ids[: count * VLLM_BLOCK], VLLM_BLOCK))
    return hashes


def matched(fleet: Fleet, body: dict[str, object]) -> dict[str, int]:
    reply = httpx.post(f"{fleet.gateway.url}/admin/route", json=body, headers=ADMIN, timeout=5)
    assert reply.status_code == 200, reply.text
    return {c["replica_id"]: c["matched_tokens"] for c in reply.json()["candidates"]}


def wait_matched(fleet: Fleet, body: dict[str, object], tokens: int) -> None:
    wait_until(
        lambda: matched(fleet, body).get(fleet.bridged_id) == tokens,
        f"the gateway to see {tokens} tokens cached behind the bridge",
        timeout=10,
        detail=lambda: f"{matched(fleet, body)}\n{fleet.bridge.log()}",
    )


def heartbeat(fleet: Fleet) -> Heartbeat | None:
    client = redis.Redis.from_url(fleet.redis.url)
    fields = client.hgetall(Keys("kvroute").heartbeat(fleet.bridged_id))
    return Heartbeat.decode(fields) if fields else None


def test_the_bridge_registers_the_engine_as_a_replica(fleet: Fleet) -> None:
    beat = heartbeat(fleet)
    assert beat is not None
    assert beat.url == fleet.engine.url  # requests go to the engine, not through the bridge
    assert beat.tokenizer_url == fleet.bridge.url
    assert beat.model == fleet.model and beat.block_size == 16
    assert beat.fingerprint == fleet.tokenizer.fingerprint
    assert beat.gateways is None  # the engine reports no per-gateway shares
    assert beat.kv_total_pages > 0
    served = httpx.get(f"{fleet.bridge.url}/kvroute/tokenizer", timeout=5).json()
    assert served["fingerprint"] == fleet.tokenizer.fingerprint and served["model"] == fleet.model


def test_a_chat_goes_where_vllm_says_its_prefix_is_cached(fleet: Fleet) -> None:
    body = chat(fleet.model, HISTORY)
    ids = prompt_ids(fleet, body)
    assert len(ids) >= 2 * VLLM_BLOCK
    store_prefix(fleet, ids)
    cached = len(ids) // VLLM_BLOCK * VLLM_BLOCK
    wait_matched(fleet, body, cached)
    assert matched(fleet, body)[fleet.replica.replica_id] == 0
    client = OpenAI(base_url=f"{fleet.gateway.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.with_raw_response.create(**body)
    assert reply.headers["x-kvroute-replica"] == fleet.bridged_id
    assert int(reply.headers["x-kvroute-predicted-cached-tokens"]) == cached
    assert reply.parse().usage.completion_tokens == 8  # served by the engine behind the bridge


def test_removed_and_cleared_blocks_leave_the_index(fleet: Fleet) -> None:
    body = chat(fleet.model, HISTORY)
    ids = prompt_ids(fleet, body)
    hashes = store_prefix(fleet, ids)
    wait_matched(fleet, body, len(hashes) * VLLM_BLOCK)
    fleet.publisher.send(vllm.BlockRemoved(hashes[-1:], "GPU"))
    wait_matched(fleet, body, (len(hashes) - 1) * VLLM_BLOCK)
    epoch = heartbeat(fleet).epoch
    fleet.publisher.send(vllm.AllBlocksCleared())
    wait_matched(fleet, body, 0)
    assert heartbeat(fleet).epoch != epoch
    members = redis.Redis.from_url(fleet.redis.url).smembers(Keys("kvroute").blocks(fleet.bridged_id))
    assert members == set()


def test_a_restarted_vllm_numbering_starts_a_new_epoch_with_no_stale_blocks(fleet: Fleet) -> None:
    body = chat(fleet.model, HISTORY)
    ids = prompt_ids(fleet, body)
    store_prefix(fleet, ids)
    wait_matched(fleet, body, len(ids) // VLLM_BLOCK * VLLM_BLOCK)
    epoch = heartbeat(fleet).epoch
    fleet.publisher.restart_numbering()  # a vLLM restarted: its numbers start again
    other = chat(fleet.model, "A different conversation about sailing boats and winds. " * 12)
    other_ids = prompt_ids(fleet, other)
    store_prefix(fleet, other_ids, first_hash=5000)
    wait_matched(fleet, other, len(other_ids) // VLLM_BLOCK * VLLM_BLOCK)
    shared = next(i for i, (a, b) in enumerate(zip(ids, other_ids, strict=False)) if a != b) // 16 * 16
    assert matched(fleet, body)[fleet.bridged_id] == shared  # the rest, held by the old process, is gone
    assert heartbeat(fleet).epoch != epoch
    seed = model_seed(fleet.model, fleet.tokenizer.fingerprint)
    expected = {
        h.to_bytes(8, "little") for h in block_hashes(other_ids[: len(other_ids) // 128 * 128], 16, seed)
    }
    members = redis.Redis.from_url(fleet.redis.url).smembers(Keys("kvroute").blocks(fleet.bridged_id))
    assert members == expected


def test_an_engine_that_stops_answering_leaves_at_once_and_comes_back(fleet: Fleet, tmp_path: Path) -> None:
    epoch = heartbeat(fleet).epoch
    fleet.engine.kill()
    wait_until(lambda: heartbeat(fleet) is None, "the bridge to deregister the dead engine", timeout=10)
    assert httpx.get(f"{fleet.bridge.url}/health", timeout=5).status_code == 503
    body = chat(fleet.model, "Hello there")
    wait_until(lambda: fleet.bridged_id not in matched(fleet, body), "the gateway to drop it", timeout=5)
    with respawn(fleet.engine, tmp_path / "engine-again.log"):  # same port, so the same replica id
        wait_until(
            lambda: heartbeat(fleet) is not None, "the bridge to register the engine again", timeout=10
        )
        assert heartbeat(fleet).epoch != epoch
        wait_until(lambda: fleet.bridged_id in matched(fleet, body), "the gateway to route there again")


def test_a_stopped_bridge_deregisters_its_engine(fleet: Fleet) -> None:
    assert heartbeat(fleet) is not None
    assert fleet.bridge.terminate() in (0, -signal.SIGTERM)  # uvicorn re-raises the handled signal
    assert heartbeat(fleet) is None
    assert fleet.bridged_id.encode() not in redis.Redis.from_url(fleet.redis.url).smembers(
        Keys("kvroute").replicas
    )
