"""A real replica process on a tiny random Llama, driven by the official ``openai`` client and httpx.

One server per module keeps the suite fast; every test leaves it idle. The model is random, so
tests pin what the API promises (shapes, counts, determinism), never particular words.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from kvroute.text.tokenizer import TextTokenizer
from replica.engine.async_engine import EngineDeadError
from replica.engine.llm_engine import EngineStats
from replica.engine.outputs import ChoiceDelta, RequestOutput
from replica.server.app import build_app
from replica.server.metrics import ReplicaMetrics
from tests.helpers.metrics import engine_requests, sample_value, scrape
from tests.helpers.processes import ReplicaProcess
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.anyio  # async tests run on asyncio (tests/conftest.py)

MODEL = "tiny-llama"
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 64 * 1024
LONG = {"ignore_eos": True}  # a random model may emit EOS at any step; these tests want exact lengths


@pytest.fixture(scope="module")
def base_url(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with ReplicaProcess(
        llama_dir,
        tmp_path_factory.mktemp("replica") / "server.log",
        "--served-model-name", MODEL, "--dtype", "float32", "--kv-cache-tokens", "8192",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", str(MAX_BODY_BYTES),
    ) as replica:  # fmt: skip
        yield replica.url


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as session:
        yield session


def _aborted(http: httpx.Client) -> float:
    return sample_value(scrape(http), "vllm:request_success_total", finished_reason="abort")


def _wait_idle(http: httpx.Client) -> None:
    wait_until(lambda: engine_requests(http) == 0, "the replica's requests to finish", timeout=10)


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def _sse_payloads(body: str) -> list[str]:
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line.strip()]
    assert all(not line.startswith("data:") for line in events)
    return events


def _greedy(client: OpenAI, content: str, max_tokens: int, **fields: Any) -> str:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body=LONG,
        **fields,
    )
    return response.choices[0].message.content or ""


# --- discovery and plumbing ----------------------------------------------------------------------


def test_models_and_health(client: OpenAI, http: httpx.Client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL).id == MODEL
    assert http.get("/health").status_code == 200


def test_tokenize_and_detokenize(client: OpenAI, http: httpx.Client, llama_dir: Path) -> None:
    tokenizer = TextTokenizer.from_dir(llama_dir)
    tokens = http.post("/tokenize", json={"prompt": "def add(a, b):"}).json()
    assert tokens["tokens"] == tokenizer.encode("def add(a, b):")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == tokenizer.decode(tokens["tokens"], skip_special_tokens=False)

    messages = [{"role": "user", "content": "count my tokens"}]
    counted = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert counted["tokens"] == tokenizer.encode_chat(messages)
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == counted["count"]


def test_a_gateways_prompt_ids_are_served_without_tokenizing_again(
    http: httpx.Client, llama_dir: Path
) -> None:
    """What a gateway sends with a request it tokenized to route (``kvroute_prompt_ids``) is the
    prompt the replica serves: here ids that differ from the messages' own, so the usage and the
    greedy answer show which prompt ran."""
    tokenizer = TextTokenizer.from_dir(llama_dir)
    messages = [{"role": "user", "content": "one short question"}]
    other = tokenizer.encode_chat([{"role": "user", "content": "a different, somewhat longer question"}])
    greedy = {"model": MODEL, "max_tokens": 4, "temperature": 0, **LONG}
    sent = http.post(
        "/v1/chat/completions", json={**greedy, "messages": messages, "kvroute_prompt_ids": other}
    )
    assert sent.status_code == 200, sent.text
    assert sent.json()["usage"]["prompt_tokens"] == len(other) != len(tokenizer.encode_chat(messages))
    as_ids = http.post("/v1/completions", json={**greedy, "prompt": other}).json()
    assert sent.json()["choices"][0]["message"]["content"] == as_ids["choices"][0]["text"]
    completion = http.post("/v1/completions", json={**greedy, "prompt": "x", "kvroute_prompt_ids": other})
    assert completion.json()["usage"]["prompt_tokens"] == len(other)


# --- chat ----------------------------------------------------------------------------------------


def test_chat_non_streaming(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5, extra_body=LONG
    )
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == MODEL
    [choice] = response.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert isinstance(choice.message.content, str) and choice.logprobs is None
    usage = response.usage
    assert usage is not None and usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + 5
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None


def test_chat_streaming_matches_non_streaming(client: OpenAI) -> None:
    content = "stream me something"
    expected = _greedy(client, content, 12)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LONG,
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first, *middle, last = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.usage is None for c in [first, *middle])
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens is not None
    assert [c.choices[0].finish_reason for c in middle][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in middle[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_raw_sse_framing(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    response = http.post("/v1/chat/completions", json={**body, **LONG})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    *events, done = _sse_payloads(response.text)
    assert done == "[DONE]"
    chunks = [json.loads(event) for event in events]
    assert all("usage" not in chunk for chunk in chunks)  # only include_usage adds the key
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_n_choices(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "two"}], max_tokens=4, n=2, seed=3, extra_body=LONG
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage is not None and response.usage.completion_tokens == 8

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "two"}],
        max_tokens=4,
        n=2,
        stream=True,
        extra_body=LONG,
    )
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in stream if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_cached_tokens_on_repeated_prompt(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "a long shared prefix about caches " * 12}]
    usages = [
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=LONG).usage
        for _ in range(2)
    ]
    assert all(u is not None and u.prompt_tokens_details is not None for u in usages)
    first, second = (u.prompt_tokens_details.cached_tokens for u in usages)  # type: ignore[union-attr]
    assert second is not None and second >= 64 and second > (first or 0)


def test_chat_logprobs_shape(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "logprobs"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body=LONG,
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == 4
    for entry in logprobs.content:
        assert entry.logprob <= 0 and isinstance(entry.token, str) and entry.bytes is not None
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5


def test_stop_string_is_not_emitted(client: OpenAI) -> None:
    full = _greedy(client, "stop somewhere", 24)
    stop = next(
        s for i in range(4, len(full) - 1) if (s := full[i : i + 2]).isprintable() and "\ufffd" not in s
    )
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stop somewhere"}],
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body=LONG,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == full[: full.index(stop)]


def test_seed_reproducibility(client: OpenAI) -> None:
    def sample(seed: int) -> str:
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "random"}],
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body=LONG,
        )
        return response.choices[0].message.content or ""

    assert sample(1234) == sample(1234)
    assert len({sample(1234), sample(1), sample(2)}) > 1


# --- completions ---------------------------------------------------------------------------------


def test_completions_batch_and_n(client: OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt=["first prompt", "second"], max_tokens=3, n=2, extra_body=LONG
    )
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage is not None and response.usage.completion_tokens == 12


def test_completions_default_max_tokens_is_openais(client: OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt="defaults", extra_body=LONG)
    assert response.usage is not None and response.usage.completion_tokens == 16


def test_completions_token_prompts_streaming(client: OpenAI) -> None:
    prompts = [[5, 6, 7, 8], [9, 10]]
    stream = client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LONG,
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    *text_chunks, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == 6 and last.usage.completion_tokens == 6
    texts = {0: "", 1: ""}
    for chunk in text_chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    expected = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=3, temperature=0, extra_body=LONG
    )
    assert [texts[0], texts[1]] == [c.text for c in expected.choices]


def test_completions_logprobs_shape(client: OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="logprobs", max_tokens=5, logprobs=2, extra_body=LONG
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 5
    assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == 5
    assert logprobs.top_logprobs is not None and all(2 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top[token] == logprob


# --- bad input -----------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "tiny-llama", "messages": [', None),
        (b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
        (json.dumps({**CHAT, "messages": []}).encode(), "messages"),
        (json.dumps({**CHAT, "messages": "hi"}).encode(), "messages"),
        (json.dumps({**CHAT, "max_tokens": "2"}).encode(), "max_tokens"),
        (json.dumps({**CHAT, "temperature": -0.5}).encode(), "temperature"),
        (json.dumps({**CHAT, "top_p": 0}).encode(), "top_p"),
        (json.dumps({**CHAT, "top_p": 1.5}).encode(), "top_p"),
        (json.dumps({**CHAT, "n": 0}).encode(), "n"),
        (json.dumps({**CHAT, "max_tokens": MAX_MODEL_LEN}).encode(), "messages"),
        (json.dumps({**CHAT, "stop_token_ids": [10**6]}).encode(), "stop_token_ids"),
        (json.dumps({**CHAT, "kvroute_prompt_ids": [10**6]}).encode(), "kvroute_prompt_ids"),
        (json.dumps({**CHAT, "kvroute_prompt_ids": []}).encode(), "kvroute_prompt_ids"),
        (json.dumps({**CHAT, "kvroute_prompt_ids": [-1]}).encode(), "kvroute_prompt_ids[0]"),
    ],
)
def test_bad_chat_input_is_a_400(http: httpx.Client, body: bytes, param: str | None) -> None:
    response = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    error = _assert_openai_error(response, 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": [10**6]}, "prompt"),
        ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
        ({"model": MODEL, "prompt": "x" * 8, "max_tokens": MAX_MODEL_LEN}, "prompt"),
        ({"model": MODEL, "prompt": [[1], "a"]}, "prompt"),
        ({"model": MODEL, "prompt": ["a", "b"], "kvroute_prompt_ids": [1]}, "kvroute_prompt_ids"),
    ],
)
def test_bad_completions_input_is_a_400(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    _assert_openai_error(http.post("/v1/completions", json=body), 400, param)


def test_context_overflow_wording(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_MODEL_LEN
        )
    message = caught.value.body["message"]  # type: ignore[index]
    assert re.fullmatch(
        rf"This model's maximum context length is {MAX_MODEL_LEN} tokens\. However, you requested "
        rf"(\d+) tokens \((\d+) in the messages, {MAX_MODEL_LEN} in the completion\)\. .*",
        message,
    )
    assert caught.value.code == "context_length_exceeded"


def test_unknown_model_is_openais_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nope", prompt="hi")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nope")


def test_sdk_raises_bad_request(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert caught.value.param == "messages"  # type: ignore[attr-defined]


def test_oversized_body_is_a_413(http: httpx.Client) -> None:
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (2 * MAX_BODY_BYTES)}]}).encode()
    error = _assert_openai_error(http.post("/v1/chat/completions", content=big), 413)
    assert error["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the server must count as it reads
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    _assert_openai_error(http.post("/v1/chat/completions", content=chunked()), 413)


def test_unknown_routes_and_methods_are_json(http: httpx.Client) -> None:
    _assert_openai_error(http.get("/v1/nothing"), 404)
    _assert_openai_error(http.get("/v1/chat/completions"), 405)


def test_still_serving_after_bad_input(client: OpenAI, http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=2, extra_body=LONG
    )
    assert response.choices[0].finish_reason == "length"
    _wait_idle(http)


# --- metrics and disconnects ---------------------------------------------------------------------

VLLM_METRICS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count",
]


def test_metrics_use_vllm_names(client: OpenAI, http: httpx.Client) -> None:
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, extra_body=LONG)
    text = scrape(http)
    for name in VLLM_METRICS:
        assert re.search(rf'^{re.escape(name)}\{{.*model_name="{MODEL}".*\}} ', text, re.MULTILINE), name
    assert sample_value(text, "vllm:generation_tokens_total") >= 3
    assert sample_value(text, "vllm:prefix_cache_queries_total") >= sample_value(
        text, "vllm:prefix_cache_hits_total"
    )
    assert re.search(r'^vllm:request_success_total\{.*finished_reason="length".*\} [1-9]', text, re.MULTILINE)


def test_disconnect_mid_stream_aborts(base_url: str, http: httpx.Client) -> None:
    _wait_idle(http)
    body = {**CHAT, "max_tokens": MAX_MODEL_LEN - 100, "stream": True, **LONG}
    aborted_before = _aborted(http)
    with (
        httpx.Client(base_url=base_url, timeout=30) as session,
        session.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert next(line for line in lines if '"content"' in line and '"role"' not in line)
        assert sample_value(scrape(http), "vllm:num_requests_running") == 1
    _wait_idle(http)
    assert _aborted(http) == aborted_before + 1


def test_disconnect_while_waiting_for_a_whole_reply_aborts(base_url: str, http: httpx.Client) -> None:
    _wait_idle(http)
    body = {**CHAT, "max_tokens": MAX_MODEL_LEN - 100, **LONG}
    aborted_before = _aborted(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.15))
    _wait_idle(http)
    assert _aborted(http) == aborted_before + 1


# --- engine failures (in process, with an engine that fails on cue) ------------------------------


class _FailingEngine:
    """Just enough of AsyncEngine to reach serving's error paths: one token, then ``error``."""

    served_model_name = MODEL
    max_model_len = MAX_MODEL_LEN
    is_running = True

    def __init__(self, tokenizer: TextTokenizer, error: Exception) -> None:
        self.tokenizer = tokenizer
        self.error = error
        self.generation_defaults: dict[str, Any] = {}
        self.prompts: list[list[int]] = []  # every prompt it was given

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: Any, source: str | None = None
    ) -> Any:
        self.prompts.append(list(prompt_token_ids))
        delta = ChoiceDelta(index=0, text="a", token_ids=[64], logprobs=None, finish_reason=None)
        yield RequestOutput(request_id, len(prompt_token_ids), 0, 1, [delta], finished=False)
        raise self.error

    def stats(self) -> EngineStats:
        return _idle_stats()


def _idle_stats() -> EngineStats:
    return EngineStats(0, 0, 0, 1, 0, 0.0, 0, 0, 16, 0, 0, 0)


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(llama_dir)


def _in_process(engine: _FailingEngine) -> httpx.AsyncClient:
    app = build_app(engine)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica")


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (RuntimeError("engine failure: boom"), 500, "server_error"),
        (EngineDeadError("the engine is not running"), 503, "service_unavailable"),
    ],
)
async def test_engine_failure_is_a_clean_error(
    tokenizer: TextTokenizer, error: Exception, status: int, kind: str
) -> None:
    async with asyncio.timeout(30), _in_process(_FailingEngine(tokenizer, error)) as session:
        response = await session.post("/v1/chat/completions", json=CHAT)
        assert _assert_openai_error(response, status)["type"] == kind
        body = {"model": MODEL, "prompt": "x", "stream": True}
        streamed = await session.post("/v1/completions", json=body)
        assert streamed.status_code == 200
        first, error_event, done = _sse_payloads(streamed.text)
        assert json.loads(first)["choices"][0]["text"] == "a"
        assert json.loads(error_event)["error"]["type"] == kind and done == "[DONE]"


async def test_cached_prompt_ids_equal_a_fresh_encoding(tokenizer: TextTokenizer) -> None:
    """Repeated and multi-turn prompts come from the prompt cache (whole, or the history's ids plus
    the new turn's); the engine must get exactly the ids a fresh encoding gives."""
    engine = _FailingEngine(tokenizer, EngineDeadError("stop after the first token"))
    history = [
        {"role": "system", "content": "You answer briefly. " * 20},
        {"role": "user", "content": "First question?"},
    ]
    turns = [list(history)]
    history += [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And then?"}]
    turns += [list(history), list(history)]  # the next turn, then the same again verbatim
    text = "Once upon a time " * 30

    async with asyncio.timeout(30), _in_process(engine) as session:
        for messages in turns:
            await session.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        for _ in range(2):
            await session.post("/v1/completions", json={"model": MODEL, "prompt": text})
    expected = [tokenizer.encode_chat(messages) for messages in turns] + [tokenizer.encode(text)] * 2
    assert engine.prompts == expected


async def test_unexpected_exception_is_a_logged_500(
    tokenizer: TextTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _FailingEngine(tokenizer, RuntimeError())
    engine.stats = lambda: 1 / 0  # type: ignore[method-assign, assignment, return-value]
    engine.is_running = False

    async with _in_process(engine) as session:
        metrics, health = await session.get("/metrics"), await session.get("/health")
    assert _assert_openai_error(metrics, 500)["type"] == "server_error"
    assert any(record.exc_info and record.exc_info[0] is ZeroDivisionError for record in caplog.records)
    assert _assert_openai_error(health, 503)["type"] == "service_unavailable"


def test_metrics_registries_are_per_app() -> None:
    first, second = ReplicaMetrics(_idle_stats, "a"), ReplicaMetrics(_idle_stats, "b")
    first.generation_tokens.inc(3)
    assert b'vllm:generation_tokens_total{engine="0",model_name="a"} 3.0' in first.render()[0]
    assert b'model_name="a"' not in second.render()[0]
