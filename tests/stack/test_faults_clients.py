"""Faults on the client's side, with real processes: slow and half-sent requests, a flood of
connections past the cap, and the largest prompt the window's bound lets through beside one far
over it, at the gateway and at a replica.

Each test prints its figures (``pytest -s``) and asserts its target; docs/RELIABILITY.md records the
latest run's.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.openai_api.errors import APIError
from kvroute.openai_api.schema import ChatCompletionRequest, parse_request
from kvroute.text.bounds import refuse_surely_too_long
from kvroute.text.tokenizer import TextTokenizer
from launcher.local_redis import free_port
from tests.helpers.faults import ADMIN, ADMIN_KEY, LatencyProbe, chat_body, sim_args, wide_model
from tests.helpers.metrics import sample_value, scrape
from tests.helpers.processes import KvrouteProcess, ReplicaProcess, Service
from tests.helpers.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.anyio  # async tests run on asyncio (tests/conftest.py)


# --- 5. slow clients, half requests, and the connection cap ----------------------------------------

BODY_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 160
SLOW_BODIES, HALF_LINES = 100, 40
DECLARED = 100 * 1024  # the body each slow client announces, and sends half of
SLOW_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n" % DECLARED
)


@dataclass
class Answer:
    """What a raw connection got before the server closed it, and when."""

    seconds: float  # from the last byte sent to the close
    raw: bytes

    @property
    def status(self) -> int:
        return int(self.raw.split(b" ", 2)[1]) if self.raw.startswith(b"HTTP/1.1 ") else 0

    @property
    def headers(self) -> dict[str, str]:
        head = self.raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
        return {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in head)}

    @property
    def error(self) -> dict[str, Any]:
        return json.loads(self.raw.partition(b"\r\n\r\n")[2])["error"]


async def _answer_to(port: int, data: bytes, within: float) -> Answer:
    """Connects, sends ``data``, and reads until the server closes the connection (failing the
    test if it does not within ``within`` seconds)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        sent = time.monotonic()
        chunks = []
        try:
            async with asyncio.timeout(within):
                while chunk := await reader.read(65536):
                    chunks.append(chunk)
        except ConnectionResetError:
            pass  # closed with our unread bytes still in its buffer: a reset, after the answer
        except TimeoutError:
            pytest.fail(f"the server kept a connection open {within:g} s after {data[:40]!r}...")
        return Answer(time.monotonic() - sent, b"".join(chunks))
    finally:
        writer.close()


async def test_slow_clients_half_requests_and_the_connection_cap(tmp_path: Path) -> None:
    """100 clients send their headers and half of a 100 KB body, 40 send half a request line: the
    body deadline (408) and the head deadline (408) close every one within its deadline + 1 s, and
    /health answers throughout. Past the connection cap a new connection gets a JSON 503 at once,
    a malformed request a JSON 400."""
    nowhere = f"http://127.0.0.1:{free_port()}"  # the deadlines come before any routing
    gateway = KvrouteProcess(
        "gateway", tmp_path / "gateway.log", "--replica", nowhere,
        "--body-timeout", f"{BODY_TIMEOUT_S:g}", "--header-timeout", f"{HEADER_TIMEOUT_S:g}",
        "--max-connections", str(MAX_CONNECTIONS),
    )  # fmt: skip
    port = gateway.port
    with gateway, LatencyProbe(f"{gateway.url}/health", interval=0.02) as health:
        slow_body = SLOW_HEAD + b'{"model": "m", "messages": [' + b" " * (DECLARED // 2)
        started = time.monotonic()
        answers = await asyncio.gather(
            *(_answer_to(port, slow_body, BODY_TIMEOUT_S + 5) for _ in range(SLOW_BODIES)),
            *(_answer_to(port, b"POST /v1/chat/compl", HEADER_TIMEOUT_S + 5) for _ in range(HALF_LINES)),
        )
        flood_s = time.monotonic() - started
        bodies, lines = answers[:SLOW_BODIES], answers[SLOW_BODIES:]
        during_flood = health.between(started, started + flood_s)

        # the cap: idle connections up to it (the probe's keep-alive one counts), then one more
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)]
        capped_at = time.monotonic()
        probe = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
        try:

            async def refused() -> Answer | None:
                answer = await _answer_to(port, probe, 1.0)
                return answer if answer.status == 503 else None

            over = await wait_until_async(refused, "a connection past the cap to be refused", timeout=1.5)
            refused_at = time.monotonic()
            # the probe's kept-alive connection, opened before the cap, still answers at the cap
            await wait_until_async(
                lambda: [s for s in health.samples if s[0] >= refused_at],
                "a /health call at the cap",
                timeout=1,
            )
            at_cap = [s for s in health.samples if s[0] >= capped_at]
        finally:
            for _, writer in idle:
                writer.close()

        def answers_again() -> bool:
            return httpx.get(f"{gateway.url}/health", timeout=2).status_code == 200  # a new connection

        wait_until(answers_again, "/health on a new connection after the cap", timeout=HEADER_TIMEOUT_S + 3)
        malformed = await _answer_to(port, b"NOT HTTP AT ALL\r\n\r\n", 2.0)

    worst_body = max(a.seconds for a in bodies)
    worst_line = max(a.seconds for a in lines)
    worst_health = max(latency for _, latency, _ in during_flood)
    print(
        f"\n[slow clients] {SLOW_BODIES} half-sent bodies: {sum(a.status == 408 for a in bodies)} got 408 and"
        f" were closed {min(a.seconds for a in bodies):.2f}-{worst_body:.2f} s after their last byte (target"
        f" {BODY_TIMEOUT_S:g} s + 1 s); {HALF_LINES} half request lines:"
        f" {sum(a.status == 408 for a in lines)} got 408, closed"
        f" {min(a.seconds for a in lines):.2f}-{worst_line:.2f} s (target"
        f" {HEADER_TIMEOUT_S:g} s + 1 s); /health meanwhile: {len(during_flood)} calls, all 200:"
        f" {all(s == 200 for *_, s in during_flood)}, worst {worst_health * 1000:.0f} ms; past"
        f" {MAX_CONNECTIONS} connections: {over.status} in {over.seconds * 1000:.0f} ms, retry-after"
        f" {over.headers.get('retry-after')}; /health on a kept-alive connection at the cap: all 200:"
        f" {all(s == 200 for *_, s in at_cap)}; malformed request: {malformed.status} (JSON)"
    )
    for answer in bodies:
        assert answer.status == 408 and answer.error["code"] == "request_timeout", answer.raw[:300]
        assert BODY_TIMEOUT_S - 0.2 < answer.seconds < BODY_TIMEOUT_S + 1.0
    for answer in lines:
        assert answer.status == 408 and answer.error["message"], answer.raw[:300]
        assert HEADER_TIMEOUT_S - 0.2 < answer.seconds < HEADER_TIMEOUT_S + 1.0
    assert during_flood and all(status == 200 for *_, status in during_flood)
    assert worst_health < 0.25
    assert over.status == 503 and over.headers["retry-after"] == "1" and over.error["message"]
    assert over.seconds < 0.25, "a connection past the cap is refused at once"
    assert at_cap and all(status == 200 for *_, status in at_cap)
    assert malformed.status == 400 and malformed.error["message"]


# --- 6. the largest accepted prompt, and one far over the bound ------------------------------------

WINDOW = 65536  # tokens: the sim replica's window, which the gateway learns from it
HEALTH_TARGET_S = 0.05
FAR_OVER = "ab " * 2_700_000  # 8.1 MB, under the 8 MiB body limit
WORDS = (
    "Routing a request to the replica that already holds its prefix saves the cost of prefill. "
    "The quick brown fox jumps over the lazy dog; what is the capital of France? "
)


@dataclass
class WideStack:
    model: Path
    replica: Service
    gateway: Service


@pytest.fixture(scope="module")
def wide(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WideStack]:
    """A sim replica with a 65,536-token window and a gateway that knows it by URL."""
    workdir = tmp_path_factory.mktemp("largest-body")
    model = wide_model(llama_dir, workdir / "tiny-llama-wide", WINDOW)
    replica_args = (*sim_args("instant"), "--kv-cache-tokens", str(WINDOW))
    with ReplicaProcess(model, workdir / "replica.log", *replica_args) as replica:
        gateway_args = ("--replica", replica.url, "--admin-key", ADMIN_KEY)
        with KvrouteProcess("gateway", workdir / "gateway.log", *gateway_args) as gateway:
            yield WideStack(model, replica, gateway)


def _routed(gateway: Service) -> int:
    rows = httpx.get(f"{gateway.url}/admin/replicas", headers=ADMIN, timeout=5).json()["replicas"]
    return sum(row["requests_routed"] for row in rows)


def _engine_counts(replica: Service) -> tuple[float, float]:
    text = scrape(replica.url)
    requests = sample_value(text, "vllm:e2e_request_latency_seconds_count", default=0.0)
    return requests, sample_value(text, "vllm:prompt_tokens_total", default=0.0)


def _largest_accepted(model: str, tokenizer: TextTokenizer, salt: str) -> str:
    """The longest message of ``WORDS`` the bound lets through (``kvroute.text.bounds``, the rule
    both servers apply), checked against the bound itself: one character more is refused. ``salt``
    opens it, so no server has its ids cached from an earlier test."""

    def refused(text: str) -> bool:
        body = parse_request(
            ChatCompletionRequest, json.dumps(chat_body(model, text, 1, stream=False)).encode()
        )
        try:
            refuse_surely_too_long(body, tokenizer, WINDOW)
        except APIError:
            return True
        return False

    longest = tokenizer.max_token_chars
    words = f"{salt}: " + WORDS * ((WINDOW + 1) * longest // len(WORDS) + 1)
    size = (WINDOW + 1) * longest  # over the bound however it rounds; down until it is let through
    while refused(words[:size]):
        size -= 1
    assert size >= WINDOW * longest - 1 and refused(words[: size + 1])
    return words[:size]


@pytest.mark.parametrize("target", ["gateway", "replica"])
def test_the_largest_accepted_prompt_and_one_far_over(wide: WideStack, target: str) -> None:
    """A chat whose characters sit just under the window's bound (window x the tokenizer's
    longest token) is tokenized, and /health answers within 50 ms all the while; one of 8.1 MB is
    refused with 400 context_length_exceeded in well under a second, before tokenizing, and never
    reaches the replica's engine (nor, through the gateway, the replica)."""
    name = wide.model.name
    url = getattr(wide, target).url
    tokenizer = TextTokenizer.from_dir(wide.model)
    longest = tokenizer.max_token_chars
    text = _largest_accepted(name, tokenizer, target)
    under = json.dumps(chat_body(name, text, 1, stream=False)).encode()
    over = json.dumps(chat_body(name, FAR_OVER, 1, stream=False)).encode()
    headers = {"content-type": "application/json"}
    probes = [LatencyProbe(f"{service.url}/health") for service in (wide.gateway, wide.replica)]
    probes = probes if target == "gateway" else probes[1:]

    routed_before = _routed(wide.gateway)
    # The client is built before the probes start: building one holds this process's GIL (it
    # loads certificates), which would stall the probes and be read as the servers' latency.
    with httpx.Client(timeout=120) as client, ExitStack() as running:
        for probe in probes:
            running.enter_context(probe)
        started = time.monotonic()
        accepted = client.post(f"{url}/v1/chat/completions", content=under, headers=headers)
        took = time.monotonic() - started
        windows = [probe.between(started, started + took) for probe in probes]
    routed_mid = _routed(wide.gateway)
    engine_before = _engine_counts(wide.replica)
    started = time.monotonic()
    refused = httpx.post(f"{url}/v1/chat/completions", content=over, headers=headers, timeout=60)
    refused_in = time.monotonic() - started
    engine_after = _engine_counts(wide.replica)
    routed_after = _routed(wide.gateway)

    tokens = re.search(r"\((\d+) in the messages", accepted.json()["error"]["message"])
    worst = [max(latency for _, latency, _ in window) for window in windows]
    print(
        f"\n[largest prompt via the {target}] {len(text):,} characters (bound: {WINDOW:,} tokens x"
        f" {longest} characters): {accepted.status_code} after {took:.2f} s, tokenized to"
        f" {tokens.group(1) if tokens else '?'} tokens; worst /health meanwhile"
        f" {', '.join(f'{w * 1000:.0f} ms' for w in worst)} over {sum(map(len, windows))} calls (target"
        f" < {HEALTH_TARGET_S * 1000:.0f} ms); {len(FAR_OVER):,} characters: {refused.status_code}"
        f" {refused.json()['error']['code']} in {refused_in * 1000:.0f} ms (target < 500 ms); engine requests"
        f" {engine_before[0]:.0f} -> {engine_after[0]:.0f}, routed by the gateway"
        f" {routed_mid - routed_before} then {routed_after - routed_mid}"
    )
    # Just under the bound, the prompt is let through and tokenized (by the gateway, then the
    # replica), and only then found longer than the window, as its real token count shows.
    assert accepted.status_code == 400, accepted.text[:300]
    assert accepted.json()["error"]["code"] == "context_length_exceeded" and tokens is not None
    assert int(tokens.group(1)) > WINDOW
    for window, worst_s in zip(windows, worst, strict=True):
        assert len(window) >= 10 and all(status == 200 for *_, status in window)
        assert worst_s < HEALTH_TARGET_S
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "messages" and "at least" in error["message"]
    assert refused_in < 0.5
    assert engine_after == engine_before
    assert routed_mid - routed_before == (1 if target == "gateway" else 0)
    assert routed_after == routed_mid, "the gateway sent a prompt its bound had refused"
