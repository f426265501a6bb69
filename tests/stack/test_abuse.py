"""Bad input against a real stack: the gateway and, directly, its replica (the tiny model).

Whatever a client sends, the answer is below 500, every 4xx is an OpenAI error object (and small),
nothing hangs, and afterwards the stack serves as before with no KV page held and nothing in
flight. Generated bodies (hypothesis, about 1,300 requests: any JSON value, near-valid bodies with
the right keys and wrong values, broken JSON text and bytes, odd paths, methods and queries) go
out as raw bytes through plain httpx; the hand-written cases cover what a generator rarely hits
(a 10 MB body, 100,000 messages, 1,000-deep nesting, a 1 MB model name, prompts over the window,
malformed HTTP on a raw socket, wrong methods, wrong Content-Length). ``pytest -s`` prints the
counts. docs/SECURITY.md ("Limits a client meets") is the contract.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.abuse import (
    JSON_VALUES,
    TEXT,
    RawReply,
    Tally,
    assert_openai_error,
    broken_texts,
    check_reply,
    encode,
    near_valid_bodies,
    raw_exchange,
    valid_body,
)
from tests.helpers.metrics import sample_value, scrape
from tests.helpers.processes import Service, running_stack
from tests.helpers.waiting import wait_until

ADMIN_KEY = "sk-abuse-admin-5c1e"
WINDOW = 512  # the replica's --max-model-len: prompts over it are cheap to build
BODY_TIMEOUT_S = 2
HEADER_TIMEOUT_S = 2
MAX_PROMPT_CHARS = 100_000  # the gateway's own limit
TARGETS = ("gateway", "replica")
GENERATION = ("/v1/chat/completions", "/v1/completions")
POSTS = [
    ("gateway", "/v1/chat/completions"),
    ("gateway", "/v1/completions"),
    ("replica", "/v1/chat/completions"),
    ("replica", "/v1/completions"),
    ("replica", "/tokenize"),
    ("replica", "/detokenize"),
]

# Per parametrized case: 6 x (40 + 110 + 40) + 2 x 80 = 1,300 generated requests.
ANY_JSON_EXAMPLES, NEAR_VALID_EXAMPLES, BROKEN_TEXT_EXAMPLES, PATH_EXAMPLES = 40, 110, 40, 80
GENERATED_CASES = len(POSTS) * 3 + len(TARGETS)
FUZZ = settings(
    deadline=None,
    database=None,  # nothing written into the checkout; a failure prints its reproduction blob
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@dataclass
class Stack:
    model: str
    gateway: Service
    replica: Service
    clients: dict[str, httpx.Client]
    tally: Tally = field(default_factory=Tally)

    def url(self, target: str) -> str:
        return self.gateway.url if target == "gateway" else self.replica.url

    def send(
        self,
        target: str,
        method: str,
        path: str,
        content: bytes | None = None,
        *,
        case: str,
        headers: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> httpx.Response:
        """One request as raw bytes; counted under ``case`` and checked by ``check_reply``."""
        headers = {"content-type": "application/json"} if headers is None else headers
        response = self.clients[target].request(
            method, path, content=content, headers=headers, timeout=timeout
        )
        self.tally.record(case, response.status_code)
        check_reply(response, f"{case}: {method} {path} {(content or b'')[:200]!r}")
        return response

    def post(self, target: str, path: str, body: bytes | dict[str, Any], *, case: str) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.send(target, "POST", path, content, case=case)

    def raw(self, target: str, data: bytes, case: str, **options: Any) -> tuple[list[RawReply], bool, float]:
        replies, closed, took = raw_exchange(self.url(target), data, **options)
        for reply in replies:
            self.tally.record(case, reply.status)
        return replies, closed, took


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    limits = ("--body-timeout", str(BODY_TIMEOUT_S), "--header-timeout", str(HEADER_TIMEOUT_S))
    with running_stack(
        llama_dir,
        tmp_path_factory.mktemp("abuse-stack"),
        1,
        replica_args=("--max-model-len", str(WINDOW), *limits),
        gateway_args=("--admin-key", ADMIN_KEY, "--max-prompt-chars", str(MAX_PROMPT_CHARS), *limits),
    ) as processes:
        replica = processes.replicas[0]
        with (
            httpx.Client(base_url=processes.gateway.url) as gateway,
            httpx.Client(base_url=replica.url) as direct,
        ):
            built = Stack(
                processes.model, processes.gateway, replica, {"gateway": gateway, "replica": direct}
            )
            yield built
            print("\n" + built.tally.report("abuse battery"))


# --- generated -----------------------------------------------------------------------------------


def generated_post(stack: Stack, target: str, path: str, body: bytes, case: str) -> None:
    stack.post(target, path, body, case=case)


@pytest.mark.parametrize(("target", "path"), POSTS)
@settings(FUZZ, max_examples=ANY_JSON_EXAMPLES)
@given(value=JSON_VALUES, ascii_only=st.booleans())
def test_any_json_value(stack: Stack, target: str, path: str, value: Any, ascii_only: bool) -> None:
    body = encode(value, ascii_only=ascii_only)
    generated_post(stack, target, path, body, f"generated any-json {target} {path}")


@pytest.mark.parametrize(("target", "path"), POSTS)
@settings(FUZZ, max_examples=NEAR_VALID_EXAMPLES)
@given(data=st.data())
def test_near_valid_bodies(stack: Stack, target: str, path: str, data: st.DataObject) -> None:
    body = data.draw(near_valid_bodies(path, stack.model), label="body")
    generated_post(stack, target, path, body, f"generated near-valid {target} {path}")


@pytest.mark.parametrize(("target", "path"), POSTS)
@settings(FUZZ, max_examples=BROKEN_TEXT_EXAMPLES)
@given(data=st.data())
def test_broken_json_text_and_bytes(stack: Stack, target: str, path: str, data: st.DataObject) -> None:
    body = data.draw(broken_texts(path, stack.model), label="body")
    generated_post(stack, target, path, body, f"generated broken-text {target} {path}")


def _quoted(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)


@pytest.mark.parametrize("target", TARGETS)
@settings(FUZZ, max_examples=PATH_EXAMPLES)
@given(
    method=st.sampled_from(["GET", "GET", "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    path=st.one_of(
        st.sampled_from(
            ["/v1/models", "/v1/models/", "/v1", "/v1/", "/v1/models/..%2f..%2fetc", "//v1/models"]
        ),
        TEXT.map(lambda text: "/v1/models/" + _quoted(text)),
        TEXT.map(lambda text: "/v1/" + _quoted(text)),
        st.just("/v1/models/" + "m" * 20_000),
    ),
    query=st.dictionaries(TEXT, TEXT, max_size=3),
    body=st.none() | JSON_VALUES.map(encode),
    headers=st.dictionaries(
        st.sampled_from(
            ["x-session-id", "x-kvroute-policy", "content-type", "accept", "x-forwarded-for", "range"]
        ),
        PRINTABLE.map(str.strip),  # h11 sends no value with spaces around it
        max_size=3,
    ),
)
def test_models_paths_methods_and_queries(
    stack: Stack,
    target: str,
    method: str,
    path: str,
    query: dict[str, str],
    body: bytes | None,
    headers: dict[str, str],
) -> None:
    if query:
        pairs = {
            k.encode("utf-8", "surrogatepass"): v.encode("utf-8", "surrogatepass") for k, v in query.items()
        }
        path += "?" + urlencode(pairs)
    stack.send(target, method, path, body, headers=headers, case=f"generated paths {target}")


# --- hand-written: bodies ------------------------------------------------------------------------

NOT_JSON = [
    b"",
    b"{",
    b"}",
    b"null",
    b"[]",
    b'"a string"',
    b"42",
    b'{"model": }',
    b'{"model": "m",}',
    b"{'model': 'm'}",
    b'{"model": "m"} {"model": "m"}',
    b'{"model": "m"}garbage',
    b"\x00" * 64,
    b"\xff\xfe{\x00}\x00",  # UTF-16
    '{"model": "m"}'.encode("utf-16"),
    '{"model": "m", "prompt": "x"}'.encode("utf-32"),
]
NOT_UTF8 = [
    b'{"model": "\xff", "prompt": "x"}',
    b'{"model": "m", "prompt": "\xc0\xaf"}',  # overlong
    b'{"model": "m", "prompt": "\xe2\x82"}',  # truncated
    b'{"model": "m", "prompt": "\xed\xa0\x80"}',  # a surrogate, CESU-encoded
    b'{"model": "m", "prompt": "\xf4\x90\x80\x80"}',  # above U+10FFFF
    b'{"mod\xffel": "m", "prompt": "x"}',
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("path", GENERATION)
def test_invalid_json_and_invalid_utf8_are_400(stack: Stack, target: str, path: str) -> None:
    for body in NOT_JSON + NOT_UTF8:
        response = stack.post(
            target, path, body.replace(b'"m"', f'"{stack.model}"'.encode()), case="not JSON"
        )
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] is None, (body, error)


def _chunks(data: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("target", TARGETS)
def test_a_10_mb_body_is_a_413(stack: Stack, target: str) -> None:
    content = "x" * (10 * 1000 * 1000)
    body = json.dumps({"model": stack.model, "messages": [{"role": "user", "content": content}]}).encode()
    client = stack.clients[target]
    for payload in (body, _chunks(body)):  # with a Content-Length, then chunked (counted as it comes)
        response = client.post("/v1/chat/completions", content=payload, timeout=60)
        stack.tally.record("10 MB body", response.status_code)
        check_reply(response, "10 MB body")
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    # refused on the declared length alone: the answer comes before a single byte of the body
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    [reply], _, took = stack.raw(target, head, "10 MB body", timeout=10)
    assert reply.status == 413 and reply.error()["code"] == "request_too_large"
    assert took < BODY_TIMEOUT_S


@pytest.mark.parametrize("target", TARGETS)
def test_100000_one_word_messages(stack: Stack, target: str) -> None:
    messages = [{"role": "user", "content": "word"} for _ in range(100_000)]
    started = time.monotonic()
    response = stack.post(
        target, "/v1/chat/completions", {"model": stack.model, "messages": messages, "max_tokens": 1},
        case="100,000 messages",
    )  # fmt: skip
    took = time.monotonic() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert took < 10, f"refusing 100,000 messages took {took:.1f} s"
    # as many prompts in a batch, stop strings or token ids: refused (stop token ids have no cap)
    one = messages[:1]
    for path, body, status in (
        ("/v1/completions", {"model": stack.model, "prompt": ["word"] * 100_000}, 400),
        ("/v1/completions", {"model": stack.model, "prompt": "x", "stop": ["word"] * 100_000}, 400),
        ("/v1/completions", {"model": stack.model, "prompt": [7] * 100_000}, 400),
        (
            "/v1/chat/completions",
            {"model": stack.model, "messages": one, "max_tokens": 1, "stop_token_ids": [1] * 100_000},
            200,
        ),
    ):
        answered = stack.post(target, path, body, case="100,000 items")
        assert answered.status_code == status, answered.text[:300]


def test_more_messages_than_the_window_are_refused_before_rendering(stack: Stack) -> None:
    """Each message costs a token at least: 100,000 of them cannot fit a 512-token window."""
    messages = [{"role": "user", "content": "word"} for _ in range(100_000)]
    started = time.monotonic()
    response = stack.post(
        "replica", "/tokenize", {"model": stack.model, "messages": messages}, case="100,000 messages"
    )
    took = time.monotonic() - started
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert took < 2, f"refusing took {took:.1f} s"


def test_a_long_tokenize_does_not_stall_the_replica(stack: Stack) -> None:
    """A chat at the message bound with 5 KB in each message: rendered and encoded off the replica's
    event loop, so /health and chats through the gateway go on meanwhile."""
    messages = [{"role": "user", "content": "word " * 1000} for _ in range(WINDOW)]
    body = {"model": stack.model, "messages": messages}
    health: list[float] = []
    through_gateway: Counter[int] = Counter()
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(httpx.post, f"{stack.replica.url}/tokenize", json=body, timeout=120)
        while not job.done():
            asked = time.monotonic()
            httpx.get(f"{stack.replica.url}/health", timeout=60)
            health.append(time.monotonic() - asked)
            chat = valid_body("/v1/chat/completions", stack.model)
            through_gateway[stack.clients["gateway"].post("/v1/chat/completions", json=chat).status_code] += 1
        tokenized = job.result()
    took = time.monotonic() - started
    slowest = max(health, default=0.0)
    print(f"\n/tokenize of {WINDOW} messages of 5 KB: {tokenized.status_code} in {took:.1f} s; slowest"
          f" /health meanwhile {slowest:.2f} s over {len(health)} calls; chats through the gateway"
          f" meanwhile {dict(through_gateway)}")  # fmt: skip
    assert tokenized.status_code == 200 and tokenized.json()["count"] > WINDOW * 1000
    assert len(health) >= 2, "the tokenize was too quick to show anything"
    assert slowest < 1.0, f"/health waited {slowest:.1f} s behind one /tokenize"
    assert set(through_gateway) == {200}


def _nested(depth: int, leaf: str = "1", *, kind: str = "[]") -> str:
    if kind == "[]":
        return "[" * depth + leaf + "]" * depth
    return '{"a":' * depth + leaf + "}" * depth


@pytest.mark.parametrize("target", TARGETS)
def test_1000_deep_nesting(stack: Stack, target: str) -> None:
    model = json.dumps(stack.model)
    chat = f'"model": {model}, "max_tokens": 1, "messages": [{{"role": "user", "content": "hi"}}]'
    bodies = {
        "top level": _nested(1000).encode(),
        "messages": f'{{"model": {model}, "messages": {_nested(1000)}}}'.encode(),
        "content": (
            f'{{"model": {model}, "messages": [{{"role": "user", "content": {_nested(1000)}}}]}}'.encode()
        ),
        "unknown field": f'{{{chat}, "metadata": {_nested(1000, kind="{}")}}}'.encode(),
        "template kwargs": f'{{{chat}, "chat_template_kwargs": {_nested(1000, kind="{}")}}}'.encode(),
        "tool parameters": (
            f'{{{chat}, "tools": [{{"type": "function", "function": {{"name": "f", '
            f'"parameters": {_nested(1000, kind="{}")}}}}}]}}'
        ).encode(),
        "unclosed": f'{{"model": {model}, "prompt": {"[" * 100_000}'.encode(),
    }
    for name, body in bodies.items():
        response = stack.post(target, "/v1/chat/completions", body, case="1,000-deep nesting")
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error", name
    # nesting the JSON parser accepts reaches the template as data, and is served
    shallow = f'{{{chat}, "chat_template_kwargs": {{"extra": {_nested(100, kind="{}")}}}}}'.encode()
    assert stack.post(target, "/v1/chat/completions", shallow, case="100-deep nesting").status_code == 200


def _assistant_call(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "assistant", "tool_calls": [call]}, {"role": "user", "content": "and then?"}]


@pytest.mark.parametrize("target", TARGETS)
def test_tool_call_arguments_that_are_not_json_are_400(stack: Stack, target: str) -> None:
    """The arguments string is a JSON document of its own, decoded for the template."""
    for arguments in ("not json", "[1, 2", '{"a": ' + "9" * 5000 + "}", _nested(100)):
        body = {"model": stack.model, "messages": _assistant_call(arguments), "max_tokens": 1}
        response = stack.post(target, "/v1/chat/completions", body, case="tool-call arguments")
        assert response.status_code in (200, 400), (arguments[:40], response.text)


@pytest.mark.parametrize(
    ("target", "path"), [(t, p) for t, p in POSTS if p in ("/v1/chat/completions", "/tokenize")]
)
def test_deeply_nested_tool_call_arguments_are_400(target: str, path: str, stack: Stack) -> None:
    body = {"model": stack.model, "messages": _assistant_call(_nested(1000)), "max_tokens": 1}
    response = stack.post(target, path, body, case="1,000-deep tool-call arguments")
    assert response.status_code == 400


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    ("path", "name"),
    [("/v1/chat/completions", "max_tokens"), ("/v1/chat/completions", "max_completion_tokens"),
     ("/v1/completions", "max_tokens")],
)  # fmt: skip
def test_a_4300_digit_max_tokens_is_400(stack: Stack, target: str, path: str, name: str) -> None:
    body = {k: v for k, v in valid_body(path, stack.model).items() if k != "max_tokens"}
    raw = json.dumps(body)[:-1] + f', "{name}": {"9" * 4300}}}'
    response = stack.post(target, path, raw.encode(), case=f"a 4,300-digit {name}")
    assert response.status_code == 400 and response.json()["error"]["param"] == name


@pytest.mark.parametrize("target", TARGETS)
def test_a_tiny_temperature_fails_only_its_own_request(stack: Stack, target: str) -> None:
    other = {"model": stack.model, "prompt": "Another client's long answer", "max_tokens": 300,
             "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(base_url=stack.replica.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=other) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it is running
            tiny = {**valid_body("/v1/completions", stack.model), "temperature": 1e-300}
            response = stack.post(target, "/v1/completions", tiny, case="temperature 1e-300")
            rest = "\n\n".join(lines)
        harmed = '"error"' in rest
        print(f"\ntemperature 1e-300: {response.status_code} {response.text[:120]}; the other stream: "
              f"{'an error event' if harmed else 'unharmed'}")  # fmt: skip
        assert response.status_code == 200, "a temperature this small is greedy"
        assert '"error"' not in rest, f"a concurrent stream failed: {rest[-300:]}"


@pytest.mark.parametrize("target", TARGETS)
def test_a_1_mb_model_name_gets_a_small_404(stack: Stack, target: str) -> None:
    name = "m" * (1024 * 1024)
    cases = [
        ("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"model": name, "prompt": "hi"}),
    ]
    if target == "replica":
        cases += [
            ("/tokenize", {"model": name, "prompt": "hi"}),
            ("/detokenize", {"model": name, "tokens": [1]}),
        ]
    for path, body in cases:
        response = stack.post(target, path, body, case="1 MB model name")
        assert response.status_code == 404, response.text[:300]
        assert len(response.content) < 1024 and response.json()["error"]["code"] == "model_not_found"
    if target == "replica":  # the name in the URL (too long for httpx): GET /v1/models/{name}
        request = f"GET /v1/models/{name} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        [reply], _, _ = stack.raw(target, request, "1 MB model name")
        print(f"\nGET /v1/models/<1 MB name>: {reply.status} {reply.body[:100]!r}")
        assert reply.status in (400, 404)  # 400: the server refuses so long a request line
        reply.error("1 MB model name in the URL")


@pytest.mark.parametrize("target", TARGETS)
def test_prompts_over_the_window_are_400_context_length_exceeded(stack: Stack, target: str) -> None:
    long_text = "Once upon a time " * 1000  # 17,000 characters: surely over 512 tokens
    many_tokens = " a" * (WINDOW + 10)  # short in characters, over the window once tokenized
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": many_tokens}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": WINDOW},
            "messages",
        ),
        ("/v1/completions", {"prompt": long_text}, "prompt"),
        ("/v1/completions", {"prompt": many_tokens}, "prompt"),
        ("/v1/completions", {"prompt": [7] * (WINDOW + 1)}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", long_text]}, "prompt"),  # any prompt of a batch
        ("/v1/completions", {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
    ]
    for path, fields, param in cases:
        response = stack.post(target, path, {"model": stack.model, **fields}, case="over the window")
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param, (fields.keys(), error)
    over_chars = stack.post(
        "gateway", "/v1/completions", {"model": stack.model, "prompt": "x" * (MAX_PROMPT_CHARS + 1)},
        case="over the window",
    )  # fmt: skip
    assert f"at most {MAX_PROMPT_CHARS}" in over_chars.json()["error"]["message"]


# --- hand-written: HTTP itself -------------------------------------------------------------------

GARBAGE = [
    b"\x00\x01\x02\x03 garbage\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\r\n\r\n",  # a TLS hello
    b"hello\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    b"G\xffT /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Name: value\r\n\r\n",
    b"GET /v1/mo\xffdels HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/mo dels HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\nHost: x\n\x00\n\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n"
    b"2\r\n{}\r\n0\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
]


@pytest.mark.parametrize("target", TARGETS)
def test_malformed_http_gets_a_json_400(stack: Stack, target: str) -> None:
    for data in GARBAGE:
        replies, closed, _ = stack.raw(target, data, "malformed HTTP")
        assert replies, f"no answer to {data[:60]!r}"
        reply = replies[0]
        assert reply.status == 400, (data[:60], reply)
        reply.error(f"malformed HTTP {data[:60]!r}")
        assert closed, f"the connection stayed open after {data[:60]!r}"


@pytest.mark.parametrize("target", TARGETS)
def test_a_wrong_method_on_a_generation_path_is_a_json_405(stack: Stack, target: str) -> None:
    for path in GENERATION:
        for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"):
            response = stack.send(target, method, path, case="wrong method")
            assert response.status_code == 405, (method, path)
            assert response.headers["allow"] == "POST"
            if method != "HEAD":
                assert_openai_error(405, response.headers["content-type"], response.content)
    for method, path in (("POST", "/v1/models"), ("DELETE", "/v1/models"), ("PUT", "/health")):
        assert stack.send(target, method, path, case="wrong method").status_code == 405
    if target == "replica":
        assert stack.send(target, "GET", "/tokenize", case="wrong method").status_code == 405


def _head(target: str, length: str, path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {target}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


@pytest.mark.parametrize("target", TARGETS)
def test_header_only_requests_and_wrong_content_lengths(stack: Stack, target: str) -> None:
    short = json.dumps(valid_body("/v1/completions", stack.model)).encode()

    def declared_but_never_sent() -> None:  # 408 once the body timeout is over, connection closed
        [reply], closed, took = stack.raw(target, _head(target, "100"), "wrong Content-Length")
        assert reply.status == 408 and reply.error()["code"] == "request_timeout" and closed
        assert BODY_TIMEOUT_S - 0.5 < took < BODY_TIMEOUT_S + 5

    def declared_then_hung_up() -> None:  # the client gives up: the server closes, nothing hangs
        replies, closed, _ = stack.raw(
            target, _head(target, "100") + b'{"mo', "wrong Content-Length", half_close=True
        )
        assert closed and all(reply.status < 500 for reply in replies)

    def head_never_finished() -> None:  # 408 once the header timeout is over
        data = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
        [reply], closed, took = stack.raw(target, data, "headers never end")
        assert reply.status == 408 and closed
        reply.error("headers never end")
        assert HEADER_TIMEOUT_S - 0.5 < took < HEADER_TIMEOUT_S + 5

    def declared_too_short() -> None:  # the rest of the body is read as the next request: garbage
        # the first body's 400, then the garbage's (the first is lost when the garbage's is written first)
        replies, closed, _ = stack.raw(target, _head(target, "10") + short, "wrong Content-Length", replies=2)
        assert 1 <= len(replies) <= 2 and closed
        for reply in replies:
            assert reply.status == 400
            assert reply.error("the rest of a body as a request")["type"] == "invalid_request_error"

    def zero_length() -> None:
        [reply], _, _ = stack.raw(target, _head(target, "0"), "wrong Content-Length")
        assert reply.status == 400 and reply.error()["param"] is None

    def declared_too_long_then_pipelined() -> None:  # the next request's bytes are taken as body
        data = _head(target, str(len(short) + 20)) + short + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        [reply], _, _ = stack.raw(target, data, "wrong Content-Length")
        assert reply.status == 400
        reply.error("a body that swallowed the next request")

    checks = [declared_but_never_sent, declared_then_hung_up, head_never_finished, declared_too_short,
              zero_length, declared_too_long_then_pipelined]  # fmt: skip
    with ThreadPoolExecutor(len(checks)) as pool:  # the timeouts run side by side
        for outcome in [pool.submit(check) for check in checks]:
            outcome.result()


# --- afterwards ----------------------------------------------------------------------------------


def test_after_the_battery_the_stack_serves_and_holds_nothing(stack: Stack) -> None:
    def replica_idle() -> bool:
        text = scrape(stack.replica.url)
        return (
            sample_value(text, "vllm:num_requests_running") == 0
            and sample_value(text, "vllm:num_requests_waiting") == 0
            and sample_value(text, "vllm:kv_cache_usage_perc") == 0
        )

    wait_until(replica_idle, "the replica to hold no request and no KV page", timeout=20, interval=0.2)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    [row] = stack.clients["gateway"].get("/admin/replicas", headers=admin).json()["replicas"]
    assert row["load"]["gateway_inflight"] == 0 and row["healthy"] and not row["ejected"], row
    for target in TARGETS:
        response = stack.post(target, "/v1/chat/completions", valid_body("/v1/chat/completions", stack.model),
                              case="afterwards")  # fmt: skip
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    wait_until(replica_idle, "the replica to be idle again", timeout=20, interval=0.2)

    tally = stack.tally
    generated = {case: counts for case, counts in tally.by_case.items() if case.startswith("generated")}
    sent = sum(sum(counts.values()) for counts in generated.values())
    print(f"\n{sent} generated requests in {len(generated)} cases; {tally.sent} requests in all; "
          f"statuses {dict(sorted(tally.statuses.items()))}; {tally.server_errors} 5xx")  # fmt: skip
    assert tally.server_errors == 0
    if len(generated) == GENERATED_CASES:  # the whole file ran
        assert sent >= 1000
