"""The threat model of docs/SECURITY.md on a real stack: redis-server, one replica that requires the
shared key, and a gateway with four data keys, an admin key, the replica key and per-key rate
limits (--rate-limit 5 --rate-burst 3).

Extends tests/stack/test_gateway_security.py (which checks one missing and one wrong key, the
admin API's answers and the replica's refusal without a key): here many garbled keys, each proven
not to reach the replica by its own counters and its access log; the bearer scheme in any case on
both sides; data keys on every admin path; keys in query strings, then looked for in every log,
metric, Redis key and value, and error body; per-key rate limits. ``pytest -s`` prints the counts.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.abuse import Tally, assert_openai_error, raw_exchange, redis_contents
from tests.helpers.metrics import sample_value, scrape
from tests.helpers.processes import StackProcesses, running_stack
from tests.helpers.waiting import wait_until

DATA_KEY = "sk-sec-data-4f1b9e"
OTHER_KEY = "sk-sec-other-a27c51"
BURST_KEY = "sk-sec-burst-0d93aa"
FLOOD_KEY = "sk-sec-flood-6e5f02"
ADMIN_KEY = "sk-sec-admin-b8c4d7"
REPLICA_KEY = "sec-replica-shared-31e9f0"
DATA_KEYS = (DATA_KEY, OTHER_KEY, BURST_KEY, FLOOD_KEY)
ALL_KEYS = (*DATA_KEYS, ADMIN_KEY, REPLICA_KEY)
RATE, BURST = 5, 3

# What the replica counts for every engine request it takes (request_success: each finished choice).
REPLICA_COUNTERS = (
    "vllm:request_success_total",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_queries_total",
)
ACCESS_LINE = re.compile(r'"(?:GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS) (?!/health|/metrics)\S* HTTP/')


@dataclass
class Stack:
    processes: StackProcesses
    tally: Tally = field(default_factory=Tally)
    baseline: tuple[dict[str, float], int] = field(default_factory=lambda: ({}, 0))

    @property
    def model(self) -> str:
        return self.processes.model

    @property
    def gateway(self) -> str:
        return self.processes.gateway.url

    @property
    def replica(self) -> str:
        return self.processes.replicas[0].url

    @property
    def replica_id(self) -> str:
        return self.processes.replicas[0].replica_id

    def chat(self, **fields: Any) -> dict[str, Any]:
        messages = [{"role": "user", "content": "Am I let in?"}]
        return {"model": self.model, "messages": messages, "max_tokens": 2, **fields}

    def request(self, case: str, method: str, url: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("timeout", 30)
        response = httpx.request(method, url, **kwargs)
        self.tally.record(case, response.status_code)
        assert response.status_code < 500, response.text
        return response

    def replica_seen(self) -> tuple[dict[str, float], int]:
        """The replica's own request counters, and the lines of its access log for requests other
        than /health and /metrics."""
        text = scrape(self.replica)
        counters = {name: sample_value(text, name, default=0.0) for name in REPLICA_COUNTERS}
        log = self.processes.replicas[0].log_path.read_text(errors="replace")
        return counters, len(ACCESS_LINE.findall(log))


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    keys = [arg for key in DATA_KEYS for arg in ("--api-key", key)]
    with running_stack(
        llama_dir,
        tmp_path_factory.mktemp("security-battery"),
        1,
        replica_args=("--api-key", REPLICA_KEY),
        gateway_args=(*keys, "--admin-key", ADMIN_KEY, "--replica-key", REPLICA_KEY,
                      "--rate-limit", str(RATE), "--rate-burst", str(BURST)),
    ) as processes:  # fmt: skip
        built = Stack(processes)
        built.baseline = built.replica_seen()  # what the replica saw of the stack's own start
        yield built
        print("\n" + built.tally.report("security battery"))


def bearer(key: str, scheme: str = "Bearer") -> dict[str, str]:
    return {"authorization": f"{scheme} {key}"}


def assert_refused(response: httpx.Response, status: int, code: str | None, what: str) -> dict[str, Any]:
    assert response.status_code == status, f"{what}: {response.status_code} {response.text[:200]}"
    error = assert_openai_error(status, response.headers.get("content-type"), response.content, what)
    assert error["code"] == code, (what, error)
    for key in ALL_KEYS:
        assert key not in response.text, f"{what}: the key {key} is in the error body"
    return error


def with_rate_retry(send: Any) -> httpx.Response:
    """``send()``, once more after ``retry-after`` if the key's bucket was empty (a 429)."""
    response = send()
    if response.status_code == 429:
        time.sleep(int(response.headers["retry-after"]))
        response = send()
    return response


# --- no request without a valid key reaches a replica ------------------------------------------

GARBLED = [
    {},
    {"authorization": ""},
    {"authorization": "Bearer"},
    bearer(DATA_KEY[:-1]),
    bearer(DATA_KEY + "x"),
    bearer(DATA_KEY.upper()),
    bearer(DATA_KEY[1:]),
    bearer("   " + DATA_KEY[: len(DATA_KEY) // 2]),
    bearer(DATA_KEY, "Basic"),
    bearer(DATA_KEY, "Bearer:"),
    bearer(DATA_KEY, "Token"),
    bearer(DATA_KEY, "Bearer\t"),
    bearer(DATA_KEY, "Bearerx"),
    {"authorization": DATA_KEY},
    {"authorization": f"Bearer\t{DATA_KEY}"},
    bearer(f"{DATA_KEY},{OTHER_KEY}"),
    bearer(f"{DATA_KEY} {OTHER_KEY}"),
    bearer(f'"{DATA_KEY}"'),
    bearer(REPLICA_KEY),  # the gateways' key for the replicas is no key for the gateway
    {"x-api-key": DATA_KEY},
    {"api-key": DATA_KEY},
    {"cookie": f"api_key={DATA_KEY}"},
    {"proxy-authorization": f"Bearer {DATA_KEY}"},
]
GATEWAY_API = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/models/x"),
    ("PUT", "/v1/chat/completions"),
]


def test_no_request_without_a_valid_key_reaches_the_replica(stack: Stack) -> None:
    counters, access = stack.replica_seen()
    sent = 0
    body = {"model": stack.model, "prompt": "Am I let in?", "max_tokens": 2}
    for method, path in GATEWAY_API:
        for headers in GARBLED:
            response = stack.request("garbled key", method, stack.gateway + path, json=body, headers=headers)
            error = assert_refused(response, 401, "invalid_api_key", f"{method} {path} {headers}")
            assert (
                error["type"] == "authentication_error" and response.headers["www-authenticate"] == "Bearer"
            )
            sent += 1
        for query in (f"api_key={DATA_KEY}", f"key={DATA_KEY}", f"authorization=Bearer%20{DATA_KEY}"):
            response = stack.request("garbled key", method, f"{stack.gateway}{path}?{query}", json=body)
            assert_refused(response, 401, "invalid_api_key", f"{method} {path}?{query}")
            sent += 1
        # two Authorization headers: the first one counts
        twice = [("authorization", "Bearer wrong"), ("authorization", f"Bearer {DATA_KEY}")]
        response = stack.request("garbled key", method, stack.gateway + path, json=body, headers=twice)
        assert_refused(response, 401, "invalid_api_key", f"{method} {path} with two Authorization headers")
        sent += 1
    # values no client library sends (whitespace around them, control bytes): over a plain socket
    for value in (b"Bearer ", b"Bearer    ", b"Bearer \t", b"Bearer \xff\xfe", b"\xff" + DATA_KEY.encode(),
                  b"Bearer " + DATA_KEY.encode() + b"\x01", b"Bearer \x7f" + DATA_KEY.encode()):  # fmt: skip
        request = (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + value
                   + b"\r\n\r\n")  # fmt: skip
        [reply], _, _ = raw_exchange(stack.gateway, request)
        stack.tally.record("garbled key", reply.status)
        assert reply.status in (400, 401), (value, reply)  # 400: a header the HTTP parser refuses
        error = reply.error(f"authorization {value!r}")
        assert not [key for key in ALL_KEYS if key.encode() in reply.body]
        assert reply.status == 400 or error["code"] == "invalid_api_key"
        sent += 1
    assert stack.replica_seen() == (counters, access), "a refused request reached the replica"
    print(f"\n{sent} requests with a missing or garbled key: all refused (401; 400 where the HTTP parser "
          f"refused the header); the replica's counters and access log did not move: {counters}")  # fmt: skip


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=st.one_of(
        st.binary(max_size=80), st.sampled_from([b"Bearer", b"bearer"]).map(lambda s: s + b" ")
    ).map(lambda v: v.replace(b"\r", b"").replace(b"\n", b"")),
    key=st.sampled_from([b"", DATA_KEY.encode(), ADMIN_KEY.encode()]),
    path=st.sampled_from(GATEWAY_API),
)
def test_any_authorization_value_is_refused(
    stack: Stack, value: bytes, key: bytes, path: tuple[str, str]
) -> None:
    """Any bytes (over a plain socket: no client library sends them all), also around a real key."""
    value = value + b"x" + key if key else value  # a real key with anything before it is no key
    method, url = path
    body = json.dumps(stack.chat()).encode()
    request = (
        (
            f"{method} {url} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
        ).encode()
        + b"Authorization: "
        + value
        + b"\r\n\r\n"
        + body
    )
    [reply], _, _ = raw_exchange(stack.gateway, request)
    stack.tally.record("generated authorization", reply.status)
    error = reply.error(f"authorization {value!r}")
    assert not [k for k in ALL_KEYS if k.encode() in reply.body]
    if reply.status == 400:  # a byte the HTTP parser refuses in a header value (a control character)
        assert error["message"].startswith("Invalid HTTP request"), error
        assert set(value) & {*range(0x00, 0x20), 0x7F} - {0x09}, value
    else:
        assert reply.status == 401 and error["code"] == "invalid_api_key", (value, reply)


def test_the_refusals_above_reached_nothing(stack: Stack) -> None:
    """The generated refusals too: still nothing at the replica, nothing routed by the gateway."""
    assert stack.replica_seen() == stack.baseline
    assert sample_value(scrape(stack.gateway), "kvroute_gateway_requests_total", default=0.0) == 0


# --- who may do what ---------------------------------------------------------------------------


def test_the_bearer_scheme_in_any_case(stack: Stack) -> None:
    schemes = ("Bearer", "bearer", "BEARER", "bEaReR")
    for scheme in schemes:  # the replica, with the shared key
        headers = bearer(REPLICA_KEY, scheme)
        models = stack.request("bearer scheme", "GET", f"{stack.replica}/v1/models", headers=headers)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == stack.model
        tokenized = stack.request("bearer scheme", "POST", f"{stack.replica}/tokenize", headers=headers,
                                  json={"prompt": "hi"})  # fmt: skip
        assert tokenized.status_code == 200
        admin = stack.request(
            "bearer scheme", "GET", f"{stack.gateway}/admin/replicas", headers=bearer(ADMIN_KEY, scheme)
        )
        assert admin.status_code == 200
        as_data = stack.request(
            "bearer scheme", "GET", f"{stack.gateway}/v1/models", headers=bearer(ADMIN_KEY, scheme)
        )
        assert as_data.status_code == 200  # the admin key opens /v1 too, without a rate limit
    data = stack.request(
        "bearer scheme", "GET", f"{stack.gateway}/v1/models", headers=bearer(DATA_KEY, "bEARER")
    )
    assert data.status_code == 200
    padded = stack.request("bearer scheme", "GET", f"{stack.gateway}/v1/models",
                           headers={"authorization": f"bearer   {OTHER_KEY}"})  # fmt: skip
    assert padded.status_code == 200


def test_admin_refuses_every_data_key(stack: Stack) -> None:
    drain = f"{stack.gateway}/admin/replicas/{stack.replica_id}/drain"
    paths = [
        ("GET", f"{stack.gateway}/admin/replicas"),
        ("POST", f"{stack.gateway}/admin/route"),
        ("POST", drain),
        ("DELETE", drain),
        ("GET", f"{stack.gateway}/admin"),
        ("GET", f"{stack.gateway}/admin/nothing-here"),
    ]
    for key in DATA_KEYS:
        for scheme in ("Bearer", "bearer"):
            for method, url in paths:
                response = stack.request(
                    "data key on /admin", method, url, headers=bearer(key, scheme), json=stack.chat()
                )
                error = assert_refused(response, 403, "insufficient_permissions", f"{method} {url}")
                assert error["type"] == "permission_error"
    [row] = stack.request(
        "admin", "GET", f"{stack.gateway}/admin/replicas", headers=bearer(ADMIN_KEY)
    ).json()["replicas"]
    assert not row["drained"] and row["healthy"], "a data key drained the replica"
    # the admin key itself: an unknown admin path is a JSON 404, not a 403
    missing = stack.request("admin", "GET", f"{stack.gateway}/admin/nothing-here", headers=bearer(ADMIN_KEY))
    assert_refused(missing, 404, missing.json()["error"]["code"], "unknown admin path")
    # choosing a policy is an admin's: a data key's x-kvroute-policy is ignored, an admin's is read
    headers = {**bearer(DATA_KEY), "x-kvroute-policy": "no-such-policy"}
    chat_url = f"{stack.gateway}/v1/chat/completions"
    ignored = with_rate_retry(
        lambda: stack.request("policy header", "POST", chat_url, headers=headers, json=stack.chat())
    )
    assert ignored.status_code == 200, ignored.text
    headers = {**bearer(ADMIN_KEY), "x-kvroute-policy": "no-such-policy"}
    read = stack.request(
        "policy header", "POST", f"{stack.gateway}/v1/chat/completions", headers=headers, json=stack.chat()
    )
    assert_refused(read, 400, "invalid_value", "an admin's unknown policy")


REPLICA_PATHS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/x"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/kvroute/tokenizer"),
    ("POST", "/reset_prefix_cache"),
    ("GET", "/nothing-here"),
    ("PUT", "/v1/chat/completions"),
]


def test_the_replica_refuses_every_caller_without_the_shared_key(stack: Stack) -> None:
    counters, access = stack.replica_seen()
    callers = [
        {},
        bearer(REPLICA_KEY[:-1]),
        bearer(REPLICA_KEY + "x"),
        bearer(REPLICA_KEY.upper()),
        bearer(REPLICA_KEY, "Basic"),
        {"authorization": REPLICA_KEY},
        {"x-api-key": REPLICA_KEY},
        *(bearer(key) for key in (*DATA_KEYS, ADMIN_KEY)),  # the gateway's keys open no replica
    ]
    sent = 0
    for method, path in REPLICA_PATHS:
        body = {"model": stack.model, "prompt": "hi", "tokens": [1], "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        for headers in callers:
            response = stack.request(
                "replica without its key", method, stack.replica + path, headers=headers, json=body
            )
            error = assert_refused(response, 401, "invalid_api_key", f"replica {method} {path} {headers}")
            assert error["type"] == "authentication_error"
            sent += 1
        query = stack.request(
            "replica without its key", method, f"{stack.replica}{path}?api_key={REPLICA_KEY}", json=body
        )
        assert_refused(query, 401, "invalid_api_key", f"replica {method} {path}?api_key=")
        sent += 1
    assert stack.replica_seen()[0] == counters, "a refused call reached the replica's engine"
    # its access log has the refused calls, and nothing else: no /reset_prefix_cache was run
    reset = stack.request(
        "replica", "POST", f"{stack.replica}/reset_prefix_cache", headers=bearer(REPLICA_KEY)
    )
    assert reset.status_code == 200
    lines = stack.replica_seen()[1] - access
    print(f"\n{sent} calls to the replica without its key: all 401 ({lines} access-log lines)")


# --- keys are written nowhere -------------------------------------------------------------------


def test_a_key_in_the_query_is_refused_and_no_key_is_written_anywhere(stack: Stack) -> None:
    gateway, replica = stack.gateway, stack.replica
    # keys in query strings, on every kind of path: refused where a key is needed
    for key in ALL_KEYS:
        for method, url, status in (
            ("POST", f"{gateway}/v1/chat/completions", 401),
            ("GET", f"{gateway}/v1/models", 401),
            ("GET", f"{gateway}/admin/replicas", 401),
            ("POST", f"{replica}/tokenize", 401),
            ("GET", f"{replica}/v1/models", 401),
            ("GET", f"{gateway}/health", 200),
            ("GET", f"{replica}/health", 200),
        ):
            for query in (f"api_key={key}", f"key={key}&x=1", f"token=Bearer%20{key}"):
                response = stack.request("key in the query", method, f"{url}?{query}", json=stack.chat())
                assert response.status_code == status, (url, query, response.text)
                if status == 401:
                    assert_refused(response, 401, "invalid_api_key", f"{url}?{query}")
    # the keys in use: a chat (whole and streamed) through the gateway, which sends the replica key
    for fields in ({}, {"stream": True}):
        body = stack.chat(**fields)
        reply = with_rate_retry(
            lambda body=body: stack.request(
                "keys in use", "POST", f"{gateway}/v1/chat/completions", headers=bearer(DATA_KEY), json=body
            )
        )
        assert reply.status_code == 200
    admin = stack.request("keys in use", "GET", f"{gateway}/admin/replicas", headers=bearer(ADMIN_KEY))
    assert admin.status_code == 200
    # errors answered to a valid key, and to keys one character off
    for headers, status in (
        (bearer(ADMIN_KEY), 404),
        (bearer(DATA_KEY + "0"), 401),
        (bearer(ADMIN_KEY[:-1]), 401),
    ):
        response = stack.request("errors", "POST", f"{gateway}/v1/chat/completions", headers=headers,
                                 json={**stack.chat(), "model": "no-such-model"})  # fmt: skip
        assert_refused(response, status, response.json()["error"]["code"], f"error to {headers}")
    for body in (admin.text, stack.request("open", "GET", f"{gateway}/health").text):
        assert not [key for key in ALL_KEYS if key in body]

    wait_until(lambda: "?…" in stack.processes.gateway.log(), "the access log's redacted lines", timeout=5)
    logs = {path.name: path.read_text(errors="replace") for path in stack.processes.workdir.glob("*.log")}
    assert {"gateway.log", "replica-0.log"} <= set(logs), sorted(logs)
    metrics = {"gateway": scrape(gateway), "replica": scrape(replica)}
    contents = redis_contents(stack.processes.redis.client())
    redis_bytes = b"\n".join(name + b"\n" + b"\n".join(items) for name, items in contents.items())
    for key in ALL_KEYS:
        for name, text in {**logs, **metrics}.items():
            assert key not in text, f"{key} is in {name}"
        assert key.encode() not in redis_bytes, f"{key} is in Redis"
    redacted = sum(text.count("?…") for text in logs.values())
    characters = sum(map(len, logs.values()))
    print(f"\nno key in {len(logs)} logs ({characters} characters, {redacted} request lines "
          f"with their query redacted), {len(metrics)} metric scrapes, {len(contents)} Redis keys "
          f"({sum(len(items) for items in contents.values())} fields and values)")  # fmt: skip


# --- per-key rate limits ------------------------------------------------------------------------


def test_a_burst_over_the_limit_is_429_and_other_keys_are_not_affected(stack: Stack) -> None:
    url = f"{stack.gateway}/v1/models"
    statuses, times = [], []
    for _ in range(8):
        times.append(time.monotonic())
        statuses.append(stack.request("rate limit", "GET", url, headers=bearer(BURST_KEY)).status_code)
    print(f"\n8 requests at once with one key: {statuses} in {times[-1] - times[0]:.2f} s")
    assert statuses[:BURST] == [200] * BURST
    if times[BURST] - times[0] < 1 / RATE - 0.03:  # not even one token back yet
        assert statuses[BURST] == 429
    allowed = statuses.count(200)
    assert allowed <= BURST + (times[-1] - times[0]) * RATE + 1, statuses
    tries = (stack.request("rate limit", "GET", url, headers=bearer(BURST_KEY)) for _ in range(20))
    refused = next(response for response in tries if response.status_code != 200)
    error = assert_refused(refused, 429, "rate_limit_exceeded", "over the rate")
    assert error["type"] == "rate_limit_error"
    retry_after = int(refused.headers["retry-after"])
    assert 1 <= retry_after <= 1 + 1 / RATE, retry_after
    # other keys, and the admin key (never limited), are untouched meanwhile
    for key in (OTHER_KEY,) * BURST + (ADMIN_KEY,) * 25:
        assert stack.request("rate limit", "GET", url, headers=bearer(key)).status_code == 200, key
    time.sleep(retry_after)
    again = [
        stack.request("rate limit", "GET", url, headers=bearer(BURST_KEY)).status_code for _ in range(BURST)
    ]
    assert again == [200] * BURST, f"after retry-after ({retry_after} s): {again}"


def test_requests_refused_for_their_rate_never_reach_the_replica(stack: Stack) -> None:
    counters, _ = stack.replica_seen()
    chat = stack.chat()

    def send(_: int) -> httpx.Response:
        url = f"{stack.gateway}/v1/chat/completions"
        return stack.request("rate limit", "POST", url, headers=bearer(FLOOD_KEY), json=chat)

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(send, range(8)))
    took = time.monotonic() - started
    statuses = Counter(response.status_code for response in responses)
    print(f"\n8 concurrent chats with one key: {dict(statuses)} in {took:.2f} s")
    assert set(statuses) <= {200, 429} and BURST <= statuses[200] <= BURST + took * RATE + 1, statuses
    for response in responses:
        if response.status_code == 429:
            assert_refused(response, 429, "rate_limit_exceeded", "a concurrent chat over the rate")
            assert int(response.headers["retry-after"]) >= 1
    expected = counters["vllm:request_success_total"] + statuses[200]
    wait_until(
        lambda: stack.replica_seen()[0]["vllm:request_success_total"] == expected,
        "the replica to count the chats",
    )
    assert stack.replica_seen()[0]["vllm:e2e_request_latency_seconds_count"] == (
        counters["vllm:e2e_request_latency_seconds_count"] + statuses[200]
    ), "a request refused for its rate reached the replica"


def test_unauthorized_floods_are_not_rate_limited_into_anything_else(stack: Stack) -> None:
    """401s take no token from anyone: a flood of wrong keys leaves a real key its whole burst."""
    url = f"{stack.gateway}/v1/models"
    time.sleep(BURST / RATE + 0.1)  # OTHER_KEY's bucket full again
    wrong = [
        stack.request("rate limit", "GET", url, headers=bearer(f"{OTHER_KEY}-{i}")).status_code
        for i in range(50)
    ]
    assert set(wrong) == {401}
    assert [
        stack.request("rate limit", "GET", url, headers=bearer(OTHER_KEY)).status_code for _ in range(BURST)
    ] == [200] * BURST
