"""Bad input and the checks on what comes back, for the abuse and security batteries
(``tests/stack/test_abuse.py``, ``tests/stack/test_security.py``).

* ``check_reply``: the rule every answer to bad input must follow: no 5xx, and every 4xx is an
  OpenAI error object (``{"error": {"message", "type", "param", "code"}}``), small whatever the
  request was; a 200 stream ends in ``[DONE]`` with no error event.
* ``Tally``: requests sent and their statuses, printed so ``pytest -s`` shows them.
* Hypothesis strategies for JSON values (huge, negative and non-finite numbers, lone surrogates,
  control characters, deep nesting, raw fragments that are not JSON at all) and for near-valid
  request bodies (the right keys with wrong types or values, unknown fields).
* ``raw_exchange``: bytes over a plain socket, for HTTP that no client library would send.
* ``redis_contents``: every key of a Redis and its type-appropriate content.
"""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis
from hypothesis import strategies as st

ERROR_FIELDS = {"message", "type", "param", "code"}
MAX_ERROR_BYTES = 1024  # an answer repeats at most 100 characters of the client's own values


# --- what every answer must look like ------------------------------------------------------------


def assert_openai_error(status: int, content_type: str | None, body: bytes, what: str = "") -> dict[str, Any]:
    """``body`` is an OpenAI error object for a 4xx (or 5xx) ``status``; returns its ``error``."""
    shown = body[:300]
    assert content_type is not None and content_type.startswith("application/json"), (
        f"{what}: {status} with content-type {content_type!r}: {shown!r}"
    )
    assert len(body) <= MAX_ERROR_BYTES, f"{what}: a {len(body)}-byte error body: {shown!r}"
    payload = json.loads(body)
    assert isinstance(payload, dict) and set(payload) == {"error"}, f"{what}: {shown!r}"
    error = payload["error"]
    assert isinstance(error, dict) and set(error) == ERROR_FIELDS, f"{what}: {shown!r}"
    assert isinstance(error["message"], str) and error["message"], f"{what}: {shown!r}"
    assert isinstance(error["type"], str) and error["type"], f"{what}: {shown!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"{what}: {shown!r}"
    assert error["code"] is None or isinstance(error["code"], str), f"{what}: {shown!r}"
    return error


def sse_payloads(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line.strip()]


def check_reply(response: httpx.Response, what: str = "") -> None:
    """No 5xx; a 4xx is an OpenAI error; a 200 is JSON, or an SSE stream that ends in [DONE]."""
    status = response.status_code
    assert status < 500, f"{what}: {status} {response.content[:500]!r}"
    if response.request.method == "HEAD":
        return
    content_type = response.headers.get("content-type")
    if status >= 400:
        assert_openai_error(status, content_type, response.content, what)
    elif status == 200 and content_type is not None and content_type.startswith("text/event-stream"):
        events = sse_payloads(response.text)
        assert events and events[-1] == "[DONE]", f"{what}: a stream without [DONE]: {response.text[-300:]!r}"
        for event in events[:-1]:
            payload = json.loads(event)
            assert "error" not in payload, f"{what}: an error event in a 200 stream: {event[:300]}"
    elif status == 200 and response.content:
        json.loads(response.content)


@dataclass
class Tally:
    """Requests sent and their statuses, per case and in all."""

    statuses: Counter[int] = field(default_factory=Counter)
    by_case: dict[str, Counter[int]] = field(default_factory=dict)

    def record(self, case: str, status: int) -> None:
        self.statuses[status] += 1
        self.by_case.setdefault(case, Counter())[status] += 1

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)

    def report(self, title: str) -> str:
        lines = [f"{title}: {self.sent} requests, statuses {dict(sorted(self.statuses.items()))}, "
                 f"{self.server_errors} 5xx"]  # fmt: skip
        lines += [
            f"  {case}: {dict(sorted(counts.items()))}" for case, counts in sorted(self.by_case.items())
        ]
        return "\n".join(lines)


# --- JSON values, including what JSON does not allow ---------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A fragment of JSON text put into a body as is: often not JSON at all, on purpose."""

    text: str


RAW_FRAGMENTS = (
    "NaN", "-NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "-0", "0e0", "1E+2", "-0.0",
    "9" * 4300, "-" + "9" * 4300, "9" * 4301, "1." + "0" * 5000 + "1", "123456789012345678901234567890",
    '"\\ud800"', '"\\udfff"', '"x\\ud800y"', '"\\ud83d\\ude00"', '"\\ud83d"', '"\\udc00\\ud800"',
    '"\\u0000"', '"\\u001f\\u007f"', '"\x00"', '"\x01\x1f"', '"a\nb"', '"\\x41"', '"\\u12"', '"\\"',
    "'single'", "tru", "nul", "01", "+1", ".5", "1.", "0x10", "[1,]", "{,}", '{"a" 1}', "", "[",
    "[" * 300 + "]" * 300, '{"a":' * 300 + "1" + "}" * 300, "[" * 150 + "]" * 150,
    '"\ufeff"', '"\u2028\u2029"', '"\U0010ffff"', '"\\/\\b\\f\\n\\r\\t"',
)  # fmt: skip

CHARS = st.one_of(
    st.characters(),
    st.integers(0xD800, 0xDFFF).map(chr),  # lone surrogates: escaped, or invalid UTF-8 when raw
    st.sampled_from('\x00\x01\x08\x1b\x7f\x85\xa0\u2028\u2029\ufeff\ufffe\uffff\U0010ffff{}[]"\\'),
)
TEXT = st.text(CHARS, max_size=24)
INTEGERS = st.one_of(
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.sampled_from(
        [0, -1, 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30]
    ),
)
FLOATS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 0.5, 1e-300, 5e-324, 1.7976931348623157e308, 2.0000001, 1.0000001]),
)
NON_FINITE = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 4301]).map(Raw)
SCALARS = st.one_of(st.none(), st.booleans(), INTEGERS, FLOATS, TEXT, st.sampled_from(RAW_FRAGMENTS).map(Raw))
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=4),
    max_leaves=12,
)
NOT_NULL = JSON_VALUES.filter(lambda value: value is not None)

_MARK = "@@raw{}@@"


def encode(value: Any, *, ascii_only: bool = True) -> bytes:
    """``value`` as JSON text with its :class:`Raw` fragments in place; with ``ascii_only`` False,
    lone surrogates go out as they are (CESU bytes: invalid UTF-8)."""
    fragments: list[str] = []

    def marked(item: Any) -> Any:
        if isinstance(item, Raw):
            fragments.append(item.text)
            return _MARK.format(len(fragments) - 1)
        if isinstance(item, list):
            return [marked(x) for x in item]
        if isinstance(item, dict):
            return {key: marked(x) for key, x in item.items()}
        return item

    text = json.dumps(marked(value), ensure_ascii=ascii_only)
    for index, fragment in enumerate(fragments):
        text = text.replace(f'"{_MARK.format(index)}"', fragment, 1)
    return text.encode("utf-8", "surrogatepass")


# --- near-valid request bodies -------------------------------------------------------------------

ROLES = ("system", "user", "assistant", "tool", "developer")
# Values small enough that a body which turns out valid costs a few tokens, or past any window;
# never null, which would leave a chat's max_tokens to the whole window.
MAX_TOKENS = st.one_of(
    st.sampled_from(
        [-1, 0, 1, 2, 3, 512, 513, 4096, 10**6, 2**63, 2**64, 10**30, 1.0, 2.5, "2", True, [], {}]
    ),
    NON_FINITE,
    NOT_NULL.filter(lambda v: not isinstance(v, int) or v < 0 or v > 600 or v <= 3),
)
COUNTS = st.one_of(st.sampled_from([-1, 0, 1, 2, 4, 16, 17, 2**31, 10**30, 1.0, "2", True, None]), NON_FINITE)
NUMBERS = st.one_of(INTEGERS, FLOATS, NON_FINITE, st.sampled_from(["0.5", "1", True, None, [], {}]))
STRINGS = st.one_of(TEXT, JSON_VALUES)
ARGUMENTS = st.one_of(  # tool-call arguments: a JSON document inside a string (see test_abuse.py)
    st.sampled_from(["", "{}", '{"a": 1}', "not json", "[1, 2", "NaN", '{"a": ' + "9" * 5000 + "}"]),
    TEXT,
    JSON_VALUES.map(lambda v: encode(v).decode("utf-8", "surrogatepass")),
)
TOOL_CALLS = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"id": STRINGS, "function": st.fixed_dictionaries({"name": STRINGS, "arguments": ARGUMENTS})},
            optional={"type": st.sampled_from(["function", "code"]) | JSON_VALUES},
        ),
        max_size=2,
    ),
    JSON_VALUES,
)
CONTENT = st.one_of(
    TEXT,
    st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "TEXT"]) | JSON_VALUES},
                              optional={"text": STRINGS}),
        max_size=3,
    ),
    JSON_VALUES,
)  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from([*ROLES, "User", "function", "", "assistant\x00"]) | JSON_VALUES},
    optional={
        "content": CONTENT,
        "name": STRINGS,
        "tool_calls": TOOL_CALLS,
        "tool_call_id": STRINGS,
        "reasoning_content": STRINGS,
    },
)
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=4), JSON_VALUES)
TOKEN_IDS = st.lists(st.one_of(st.integers(-3, 600), INTEGERS, NON_FINITE, JSON_VALUES), max_size=8)
PROMPTS = st.one_of(
    TEXT,
    TOKEN_IDS,
    st.lists(TEXT, max_size=4),
    st.lists(TOKEN_IDS, max_size=3),
    st.lists(st.one_of(TEXT, TOKEN_IDS), max_size=3),
    JSON_VALUES,
)
TOOLS = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"function": st.fixed_dictionaries({"name": STRINGS},
                                               optional={"parameters": JSON_VALUES, "description": STRINGS,
                                                         "strict": JSON_VALUES})},
            optional={"type": st.sampled_from(["function", "retrieval"]) | JSON_VALUES},
        ),
        max_size=2,
    ),
    JSON_VALUES,
)  # fmt: skip
TEMPLATE_KWARGS = st.one_of(
    st.dictionaries(
        st.sampled_from(["enable_thinking", "bos_token", "messages", "tools", "add_generation_prompt",
                         "documents", "raise_exception", "namespace", "dict", "loop", "range"]) | TEXT,
        JSON_VALUES,
        max_size=3,
    ),
    JSON_VALUES,
)  # fmt: skip
UNKNOWN_NAMES = st.one_of(
    st.sampled_from(["store", "metadata", "logit_bias", "functions", "response_format", "best_of",
                     "__proto__", "Model", "model ", "prompt\x00", "messages\u200b", ""]),
    TEXT,
)  # fmt: skip

_SHARED = {
    "model": st.one_of(st.sampled_from(["", " ", "gpt-4o", "\x00", "x" * 300]), STRINGS),
    "max_tokens": MAX_TOKENS,
    "temperature": NUMBERS,
    "top_p": NUMBERS,
    "top_k": NUMBERS,
    "n": COUNTS,
    "seed": NUMBERS,
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=18), JSON_VALUES),
    "stop_token_ids": st.one_of(TOKEN_IDS, JSON_VALUES),
    "presence_penalty": NUMBERS,
    "frequency_penalty": NUMBERS,
    "stream": st.one_of(st.booleans(), st.sampled_from(["true", 1, 0, None]), JSON_VALUES),
    "stream_options": st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON_VALUES}), JSON_VALUES
    ),
    "user": STRINGS,
    "ignore_eos": st.one_of(st.booleans(), JSON_VALUES),
    "skip_special_tokens": st.one_of(st.booleans(), JSON_VALUES),
}
FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/v1/chat/completions": _SHARED | {
        "messages": MESSAGES,
        "max_completion_tokens": MAX_TOKENS,
        "logprobs": st.one_of(st.booleans(), JSON_VALUES),
        "top_logprobs": COUNTS,
        "tools": TOOLS,
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required", {"type": "function"}]), JSON_VALUES
        ),
        "chat_template_kwargs": TEMPLATE_KWARGS,
    },
    "/v1/completions": _SHARED | {
        "prompt": PROMPTS,
        "logprobs": COUNTS,
        "echo": st.one_of(st.booleans(), JSON_VALUES),
    },
    "/tokenize": {
        "model": _SHARED["model"],
        "prompt": st.one_of(TEXT, JSON_VALUES),
        "messages": MESSAGES,
        "add_special_tokens": st.one_of(st.booleans(), JSON_VALUES),
        "add_generation_prompt": st.one_of(st.booleans(), JSON_VALUES),
        "tools": TOOLS,
        "chat_template_kwargs": TEMPLATE_KWARGS,
    },
    "/detokenize": {"model": _SHARED["model"], "tokens": st.one_of(TOKEN_IDS, JSON_VALUES)},
}  # fmt: skip


def valid_body(path: str, model: str) -> dict[str, Any]:
    """A small request that succeeds at ``path``: what the near-valid bodies start from."""
    if path == "/v1/chat/completions":
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if path == "/v1/completions":
        return {"model": model, "prompt": "Once upon", "max_tokens": 2}
    if path == "/tokenize":
        return {"model": model, "prompt": "Once upon a time"}
    return {"model": model, "tokens": [1, 2, 3]}


@st.composite
def near_valid_bodies(draw: st.DrawFn, path: str, model: str) -> bytes:
    """A valid body for ``path`` with a few fields set to odd values, maybe a field left out,
    maybe unknown fields, as ASCII-only JSON or raw UTF-8 (lone surrogates then as CESU bytes)."""
    fields = FIELDS[path]
    body: dict[str, Any] = valid_body(path, model)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 9)) == 0:  # now and then a required (or defining) field goes missing
        body.pop(draw(st.sampled_from(sorted(set(body) - {"max_tokens"}))), None)
    for name, value in draw(st.dictionaries(UNKNOWN_NAMES, JSON_VALUES, max_size=2)).items():
        if name not in fields:
            body[name] = value
    return encode(body, ascii_only=draw(st.booleans()))


@st.composite
def broken_texts(draw: st.DrawFn, path: str, model: str) -> bytes:
    """A valid body's text cut, spliced with a raw fragment or with odd bytes: malformed JSON and
    malformed UTF-8 at any position."""
    text = json.dumps(valid_body(path, model)).encode()
    at = draw(st.integers(0, len(text)))
    how = draw(st.sampled_from(["cut", "fragment", "bytes", "value"]))
    if how == "cut":
        return text[:at]
    if how == "fragment":
        return text[:at] + draw(st.sampled_from(RAW_FRAGMENTS)).encode() + text[at:]
    if how == "bytes":
        odd = draw(
            st.sampled_from(
                [
                    b"\xff",
                    b"\xc0\xaf",
                    b"\xe2\x82",
                    b"\xed\xa0\x80",
                    b"\xf4\x90\x80\x80",
                    b"\x00",
                    b"\r\n",
                    b"\xef\xbb\xbf",
                    b"\\",
                    b'"',
                ]
            )
            | st.binary(max_size=6)
        )
        return text[:at] + odd + text[at:]
    # a value's text replaced by a fragment: '"model": NaN', '"max_tokens": 1e999', ...
    name = draw(st.sampled_from(sorted(valid_body(path, model))))
    value = json.dumps(valid_body(path, model)[name])
    return text.replace(
        f'"{name}": {value}'.encode(), f'"{name}": {draw(st.sampled_from(RAW_FRAGMENTS))}'.encode()
    )


# --- HTTP over a plain socket -------------------------------------------------------------------


@dataclass
class RawReply:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self, what: str = "") -> dict[str, Any]:
        return assert_openai_error(self.status, self.headers.get("content-type"), self.body, what)


def _parse_replies(data: bytes) -> tuple[list[RawReply], bool]:
    """The whole HTTP/1.1 responses at the start of ``data``, and whether any bytes are left over."""
    replies = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            return replies, True
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        if len(rest) < length:
            return replies, True
        replies.append(RawReply(int(status_line.split(" ")[1]), headers, rest[:length]))
        data = rest[length:]
    return replies, False


def raw_exchange(
    url: str,
    data: bytes,
    *,
    replies: int = 1,
    half_close: bool = False,
    timeout: float = 15.0,
    close_within: float = 1.0,
) -> tuple[list[RawReply], bool, float]:
    """Sends ``data`` on a new connection and reads until ``replies`` whole responses came (then at
    most ``close_within`` seconds more, to see whether the server closes) or the server closed.
    Returns the responses, whether the server closed the connection, and the seconds until the last
    response. A server that neither answers nor closes within ``timeout`` fails the test: a hang."""
    parts = urlsplit(url)
    started = time.monotonic()
    received = b""
    closed = False
    took = None
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if took is not None:
                    break  # answered, and the connection stays open
                raise AssertionError(f"no answer and no close within {timeout} s to {data[:120]!r}") from None
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                closed = True
                break
            received += chunk
            if took is None and len(_parse_replies(received)[0]) >= replies:
                took = time.monotonic() - started
                sock.settimeout(close_within)
    parsed, partial = _parse_replies(received)
    assert not partial or closed, f"half a response: {received[:300]!r}"
    return parsed, closed, time.monotonic() - started if took is None else took


# --- everything Redis holds ----------------------------------------------------------------------


def redis_contents(client: redis.Redis) -> dict[bytes, list[bytes]]:
    """Every key (SCAN) and its content read the way its type is read: strings whole, hashes'
    fields and values, lists, sets and sorted sets (with scores), streams' entries."""
    contents: dict[bytes, list[bytes]] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "string":
            items = [client.get(key) or b""]
        elif kind == "hash":
            items = [part for pair in client.hgetall(key).items() for part in pair]
        elif kind == "list":
            items = list(client.lrange(key, 0, -1))
        elif kind == "set":
            items = list(client.smembers(key))
        elif kind == "zset":
            items = [part for member, score in client.zrange(key, 0, -1, withscores=True)
                     for part in (member, repr(score).encode())]  # fmt: skip
        elif kind == "stream":
            items = [f"{entry_id!r}".encode() + b"".join(k + v for k, v in fields.items())
                     for entry_id, fields in client.xrange(key)]  # fmt: skip
        else:
            items = [f"(a key of type {kind})".encode()]
        contents[key] = items
    return contents
