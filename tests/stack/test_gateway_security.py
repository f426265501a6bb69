"""Keys and the admin API, on a real stack: redis-server, one replica on the tiny model that
requires a shared key, and a gateway holding that key with data and admin keys of its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.auth import ADMIN, DATA, GatewayAuth
from kvroute.auth import bearer_token, key_matches, parse_keys
from tests.helpers.metrics import sample_value, scrape
from tests.helpers.processes import Service, running_stack

DATA_KEY = "sk-data-123"
OTHER_DATA_KEY = "sk-data-456"
ADMIN_KEY = "sk-admin-789"
REPLICA_KEY = "replica-shared-secret"
CHAT = {"messages": [{"role": "user", "content": "Is this request allowed through?"}], "max_tokens": 3}


@dataclass
class Stack:
    model: str
    gateway: Service
    replica: Service

    @property
    def replica_id(self) -> str:
        return f"127.0.0.1:{self.replica.port}"

    def post(self, path: str, body: dict, key: str | None = None, **headers: str) -> httpx.Response:
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        return httpx.post(f"{self.gateway.url}{path}", json=body, headers=headers, timeout=30)

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        return httpx.get(f"{self.gateway.url}{path}", headers=headers, timeout=30)

    def replica_requests(self) -> float:
        """Requests the replica finished (``vllm:request_success_total``, every finish reason)."""
        return sample_value(scrape(self.replica.url), "vllm:request_success_total", default=0.0)


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        llama_dir,
        tmp_path_factory.mktemp("security-stack"),
        1,
        replica_args=("--kv-cache-tokens", "4096", "--api-key", REPLICA_KEY),
        gateway_args=(
            "--api-key", DATA_KEY, "--api-key", OTHER_DATA_KEY,
            "--admin-key", ADMIN_KEY, "--replica-key", REPLICA_KEY,
        ),
    ) as processes:  # fmt: skip
        yield Stack(processes.model, processes.gateway, processes.replicas[0])


def test_health_and_metrics_are_open(stack: Stack) -> None:
    assert stack.get("/health").status_code == 200
    metrics = stack.get("/metrics")
    assert metrics.status_code == 200 and "kvroute_gateway" in metrics.text


def test_no_key_or_a_wrong_key_is_refused_before_any_replica(stack: Stack) -> None:
    before = stack.replica_requests()
    missing = stack.post("/v1/chat/completions", {"model": stack.model, **CHAT})
    assert missing.status_code == 401
    error = missing.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert error["param"] is None and error["message"]
    assert stack.post("/v1/completions", {"model": stack.model, "prompt": "x"}, key="nope").status_code == 401
    assert stack.get("/v1/models").status_code == 401
    client = OpenAI(base_url=f"{stack.gateway.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=stack.model, **CHAT)
    assert stack.replica_requests() == before, "a refused request reached the replica"


def test_every_data_key_works_and_the_gateway_holds_the_replica_key(stack: Stack) -> None:
    before = stack.replica_requests()
    for key in (DATA_KEY, OTHER_DATA_KEY):
        client = OpenAI(base_url=f"{stack.gateway.url}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(model=stack.model, **CHAT)
        assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert [m.id for m in client.models.list().data] == [stack.model]
    assert stack.replica_requests() == before + 2  # the counter the refusal tests rely on moves


def test_the_replica_refuses_calls_without_the_shared_key(stack: Stack) -> None:
    url = stack.replica.url
    body = {"model": stack.model, **CHAT}
    for path, payload in (("/v1/chat/completions", body), ("/tokenize", {"prompt": "hi"})):
        assert httpx.post(url + path, json=payload, timeout=10).status_code == 401
        wrong = httpx.post(
            url + path, json=payload, headers={"authorization": f"Bearer {DATA_KEY}"}, timeout=10
        )
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/kvroute/tokenizer", timeout=10).status_code == 401
    assert httpx.post(f"{url}/reset_prefix_cache", timeout=10).status_code == 401
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    ok = httpx.post(
        f"{url}/tokenize", json={"prompt": "hi"}, headers={"authorization": f"Bearer {REPLICA_KEY}"}
    )
    assert ok.status_code == 200 and ok.json()["count"] >= 1


def test_admin_needs_the_admin_key(stack: Stack) -> None:
    before = stack.replica_requests()
    assert stack.get("/admin/replicas").status_code == 401
    assert stack.get("/admin/replicas", key="wrong").status_code == 401
    data_key = stack.get("/admin/replicas", key=DATA_KEY)
    assert data_key.status_code == 403 and data_key.json()["error"]["type"] == "permission_error"
    assert stack.post("/admin/route", {"model": stack.model, **CHAT}, key=DATA_KEY).status_code == 403
    drain = httpx.post(f"{stack.gateway.url}/admin/replicas/{stack.replica_id}/drain", timeout=10)
    assert drain.status_code == 401
    assert stack.replica_requests() == before


def test_admin_replicas(stack: Stack) -> None:
    client = OpenAI(base_url=f"{stack.gateway.url}/v1", api_key=DATA_KEY, max_retries=0)
    before = stack.get("/admin/replicas", key=ADMIN_KEY).json()["replicas"][0]
    for _ in range(2):  # the second one is predicted to hit the cache, and does
        client.chat.completions.create(model=stack.model, **CHAT)
        time.sleep(0.3)  # the replica's cache events reach the index
    reply = stack.get("/admin/replicas", key=ADMIN_KEY)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["redis"] == "ok" and body["policy"] == "kv"
    [row] = body["replicas"]
    assert row["id"] == stack.replica_id and row["model"] == stack.model and row["url"] == stack.replica.url
    assert row["source"] == "redis" and row["listed"] and row["healthy"] and not row["drained"]
    assert len(row["epoch"]) == 16 and 0 <= row["heartbeat_age_s"] < 5
    assert set(row["load"]) == {"running", "waiting", "waiting_prefill_tokens", "gateway_inflight"}
    assert row["load"]["running"] == 0 and row["load"]["gateway_inflight"] == 0
    assert row["kv"]["total_pages"] > 0 and row["kv"]["used_pages"] >= 0
    assert row["indexed_blocks"] >= 1 and row["requests_routed"] == before["requests_routed"] + 2
    usage, earlier = row["usage"], before["usage"]
    assert usage["reports"] == earlier["reports"] + 2
    assert usage["prompt_tokens"] > earlier["prompt_tokens"]
    assert usage["predicted_cached_tokens"] > earlier["predicted_cached_tokens"]
    assert usage["cached_tokens"] > earlier["cached_tokens"]
    tokens = body["models"][stack.model]
    assert tokens["prompt_tokens"] >= usage["prompt_tokens"]
    assert tokens["predicted_cached_tokens"] >= usage["predicted_cached_tokens"]
    assert tokens["cached_tokens"] == usage["cached_tokens"]


def test_admin_route_explains_without_sending(stack: Stack) -> None:
    before = stack.replica_requests()
    reply = stack.post("/admin/route", {"model": stack.model, **CHAT}, key=ADMIN_KEY)
    assert reply.status_code == 200, reply.text
    decision = reply.json()
    assert decision["winner"] == stack.replica_id and decision["policy"] == "kv"
    assert decision["endpoint"] == "/v1/chat/completions" and decision["prompt_tokens"] > 0
    [candidate] = decision["candidates"]
    assert candidate["replica_id"] == stack.replica_id and candidate["capped"] is False
    assert isinstance(candidate["cost"], float | int) and isinstance(candidate["load"], float | int)
    assert 0 <= candidate["matched_tokens"] <= decision["prompt_tokens"]
    completion = stack.post("/admin/route", {"model": stack.model, "prompt": "Once upon"}, key=ADMIN_KEY)
    assert completion.status_code == 200 and completion.json()["endpoint"] == "/v1/completions"
    override = stack.post(
        "/admin/route", {"model": stack.model, **CHAT}, key=ADMIN_KEY, **{"x-kvroute-policy": "round-robin"}
    )
    assert override.json()["policy"] == "round-robin"
    assert stack.post("/admin/route", {"model": "nope", **CHAT}, key=ADMIN_KEY).status_code == 404
    assert stack.replica_requests() == before, "/admin/route must not send the request"


def test_admin_route_shows_the_next_turn_a_replica_awaits(stack: Stack) -> None:
    """Right after an answer, the replica that gave it counts the chat's next turn as coming:
    one awaited turn (one sequence of load) to any other request, none to that next turn, which
    it shows as continuing the answer there."""
    time.sleep(2.1)  # the answers of earlier tests are no longer awaited (--expect-return 2 s)
    opening = {"role": "user", "content": "Tell me a short story about a lighthouse keeper and a storm."}
    answered = stack.post("/v1/chat/completions", {"model": stack.model, "messages": [opening]}, key=DATA_KEY)
    assert answered.status_code == 200, answered.text
    reply = answered.json()["choices"][0]["message"]
    next_turn = [
        opening,
        {"role": "assistant", "content": reply["content"]},
        {"role": "user", "content": "More."},
    ]
    unrelated = [{"role": "user", "content": "A question of another chat: why are there tides?"}]
    other = stack.post("/admin/route", {"model": stack.model, "messages": unrelated}, key=ADMIN_KEY).json()
    same = stack.post("/admin/route", {"model": stack.model, "messages": next_turn}, key=ADMIN_KEY).json()
    [other_row], [same_row] = other["candidates"], same["candidates"]
    assert other_row["awaited_turns"] == 1 and other_row["load"] == 64, other_row
    assert not other_row["continues"], other_row
    assert same_row["awaited_turns"] == 0 and same_row["load"] == 0, same_row
    assert same_row["continues"], same_row


def test_drain_takes_the_only_replica_out_of_rotation(stack: Stack) -> None:
    drain_url = f"{stack.gateway.url}/admin/replicas/{stack.replica_id}/drain"
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.post(f"{stack.gateway.url}/admin/replicas/nope/drain", headers=admin).status_code == 404
    try:
        drained = httpx.post(drain_url, headers=admin, timeout=10)
        assert drained.status_code == 200
        assert drained.json() == {"id": stack.replica_id, "drained": True, "shared": True}
        before = stack.replica_requests()
        refused = stack.post("/v1/chat/completions", {"model": stack.model, **CHAT}, key=DATA_KEY)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable"
        assert stack.replica_requests() == before
        [row] = stack.get("/admin/replicas", key=ADMIN_KEY).json()["replicas"]
        assert row["drained"] and not row["healthy"]
    finally:
        undrained = httpx.delete(drain_url, headers=admin, timeout=10)
    assert undrained.json() == {"id": stack.replica_id, "drained": False, "shared": True}
    assert stack.post("/v1/chat/completions", {"model": stack.model, **CHAT}, key=DATA_KEY).status_code == 200


# -- the rules without a stack -------------------------------------------------------------------


def test_auth_rules() -> None:
    auth = GatewayAuth(None, api_keys=["a", "b"], admin_key="root")  # type: ignore[arg-type]
    assert auth.role(b"a") == DATA and auth.role(b"root") == ADMIN and auth.role(b"x") is None
    assert auth.check("/v1/chat/completions", DATA, True) is None
    assert auth.check("/v1/chat/completions", ADMIN, True) is None  # the admin key works on /v1
    assert auth.check("/v1/models", None, False).status == 401  # type: ignore[union-attr]
    assert auth.check("/admin/replicas", DATA, True).status == 403  # type: ignore[union-attr]
    assert auth.check("/admin/replicas", None, True).status == 401  # type: ignore[union-attr]
    assert auth.check("/health", None, False) is None and auth.check("/metrics", None, False) is None
    disabled = GatewayAuth(None, api_keys=["a"])  # type: ignore[arg-type]
    refusal = disabled.check("/admin/replicas", DATA, True)
    assert refusal is not None and refusal.status == 403 and "--admin-key" in refusal.message
    open_gateway = GatewayAuth(None)  # type: ignore[arg-type]
    assert open_gateway.check("/v1/chat/completions", None, False) is None
    keyed = GatewayAuth(None, api_keys=["a"], metrics_key_required=True)  # type: ignore[arg-type]
    assert keyed.check("/metrics", None, False).status == 401  # type: ignore[union-attr]
    assert keyed.check("/metrics", DATA, True) is None
    with pytest.raises(ValueError):
        GatewayAuth(None, metrics_key_required=True)  # type: ignore[arg-type]


def test_key_parsing() -> None:
    assert bearer_token([(b"authorization", b"Bearer  tok ")]) == b"tok"
    assert bearer_token([(b"authorization", b"Basic tok")]) is None
    assert bearer_token([]) is None
    assert key_matches(b"b", [b"a", b"b"]) and not key_matches(b"c", [b"a", b"b"])
    assert not key_matches(None, [b"a"])
    assert parse_keys(None, " a, b,,a ") == ("a", "b")
    assert parse_keys(["x"], "a,b") == ("x",)
    assert parse_keys([], None) == ()
