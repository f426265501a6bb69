"""The gateway's tokenizer registry against a real replica process on the tiny Qwen3.

The gateway must produce the very token ids the replica prefills, so every encoding check compares
with what the replica itself reports (``usage.prompt_tokens`` and ``/tokenize``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from gateway.tokenizers import TokenizerMismatch, TokenizerRegistry, TokenizerUnavailable
from kvroute.local_redis import free_port
from kvroute.openai_protocol import ChatCompletionRequest, parse_request
from kvroute.tokenizer import TextTokenizer
from tests.replica_process import ReplicaProcess

MODEL = "tiny-qwen3"
BLOCK_SIZE = 8
T = TypeVar("T")

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And of"}, {"type": "text", "text": "Italy?"}]},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def replica_url(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with ReplicaProcess(
        qwen3_dir,
        tmp_path_factory.mktemp("replica") / "server.log",
        "--served-model-name", MODEL, "--dtype", "float32", "--kv-cache-tokens", "8192",
        "--max-model-len", "8192", "--block-size", str(BLOCK_SIZE),
    ) as replica:  # fmt: skip
        yield replica.url


@pytest.fixture(scope="module")
def payload(replica_url: str) -> dict[str, Any]:
    response = httpx.get(f"{replica_url}/kvroute/tokenizer", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def fingerprint(payload: dict[str, Any]) -> str:
    return payload["fingerprint"]


def _run(scenario: Callable[[httpx.AsyncClient], Coroutine[Any, Any, T]], hooks: Sequence[Any] = ()) -> T:
    """Runs ``scenario`` with a fresh AsyncClient (``hooks`` see every request it sends)."""

    async def main() -> T:
        async with httpx.AsyncClient(timeout=30, event_hooks={"request": list(hooks)}) as http:
            return await asyncio.wait_for(scenario(http), 60)

    return asyncio.run(main())


class _RequestCounter:
    """An httpx request hook counting tokenizer fetches."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    async def __call__(self, request: httpx.Request) -> None:
        if request.url.path == "/kvroute/tokenizer":
            self.urls.append(str(request.url))


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def _replica_tokens(url: str, body: dict[str, Any]) -> list[int]:
    response = httpx.post(f"{url}/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def _count_calls(monkeypatch: pytest.MonkeyPatch, tokenizer: TextTokenizer, name: str) -> list[int]:
    """Wraps ``tokenizer.name``; returns the list of thread idents it ran on, one per call."""
    original = getattr(tokenizer, name)
    threads: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, name, counted)
    return threads


# --- the replica endpoint ------------------------------------------------------------------------


def test_endpoint_serves_files_that_rebuild_the_same_tokenizer(
    payload: dict[str, Any], qwen3_dir: Path
) -> None:
    assert set(payload) == {
        "model", "fingerprint", "block_size", "tokenizer_json", "chat_template", "tokenizer_config",
    }  # fmt: skip
    assert payload["model"] == MODEL
    assert payload["block_size"] == BLOCK_SIZE
    local = TextTokenizer.from_dir(qwen3_dir)
    assert payload["fingerprint"] == local.fingerprint
    assert local.chat_template is not None
    assert payload["chat_template"] == local.chat_template
    rebuilt = TextTokenizer.from_files(
        payload["tokenizer_json"], payload["chat_template"], payload["tokenizer_config"]
    )
    assert rebuilt.fingerprint == local.fingerprint
    assert rebuilt.encode_chat(CONVERSATION) == local.encode_chat(CONVERSATION)


# --- fetching ------------------------------------------------------------------------------------


def test_concurrent_gets_share_one_fetch(replica_url: str, fingerprint: str) -> None:
    counter = _RequestCounter()

    async def scenario(http: httpx.AsyncClient) -> list[TextTokenizer]:
        registry = TokenizerRegistry(http)
        assert registry.cached(MODEL, fingerprint) is None
        got = await asyncio.gather(*(registry.get(MODEL, fingerprint, [replica_url]) for _ in range(20)))
        again = await registry.get(MODEL, fingerprint, [replica_url])
        assert registry.cached(MODEL, fingerprint) is again
        return [*got, again]

    tokenizers = _run(scenario, [counter])
    assert len(counter.urls) == 1
    assert all(tokenizer is tokenizers[0] for tokenizer in tokenizers)
    assert tokenizers[0].fingerprint == fingerprint


def test_wrong_fingerprint_or_model_is_refused_and_not_cached(replica_url: str, fingerprint: str) -> None:
    async def scenario(http: httpx.AsyncClient) -> None:
        registry = TokenizerRegistry(http)
        with pytest.raises(TokenizerMismatch, match="is registered"):
            await registry.get(MODEL, "0" * 64, [replica_url])
        with pytest.raises(TokenizerMismatch, match="serves model"):
            await registry.get("other-model", fingerprint, [replica_url])
        assert registry.cached(MODEL, "0" * 64) is None
        # a failure does not poison the key: the right fingerprint still loads
        assert (await registry.get(MODEL, fingerprint, [replica_url])).fingerprint == fingerprint

    _run(scenario)


def test_unreachable_replica_falls_back_to_the_next(replica_url: str, fingerprint: str) -> None:
    counter = _RequestCounter()
    dead = _dead_url()

    async def scenario(http: httpx.AsyncClient) -> TextTokenizer:
        return await TokenizerRegistry(http).get(MODEL, fingerprint, [dead, replica_url + "/"])

    assert _run(scenario, [counter]).fingerprint == fingerprint
    assert [url.rsplit("/kvroute", 1)[0] for url in counter.urls] == [dead, replica_url]


def test_no_usable_replica_is_unavailable(replica_url: str, fingerprint: str) -> None:
    async def scenario(http: httpx.AsyncClient) -> None:
        registry = TokenizerRegistry(http)
        with pytest.raises(TokenizerUnavailable, match="ConnectError"):
            await registry.get(MODEL, fingerprint, [_dead_url(), _dead_url()])
        with pytest.raises(TokenizerUnavailable, match="no replica URLs"):
            await registry.get(MODEL, fingerprint, [])
        with pytest.raises(TokenizerUnavailable, match="404"):  # a replica without the endpoint
            await registry.get(MODEL, fingerprint, [replica_url + "/nothing-here"])

    _run(scenario)


def _forging_client(forged: dict[str, Any], counter: _RequestCounter) -> httpx.AsyncClient:
    """A client on which http://forger answers ``forged``; other hosts are real."""
    forger = httpx.MockTransport(lambda request: httpx.Response(200, json=forged))
    return httpx.AsyncClient(timeout=30, mounts={"http://forger": forger}, event_hooks={"request": [counter]})


def test_files_that_do_not_hash_to_the_claimed_fingerprint_are_refused(
    replica_url: str, fingerprint: str, payload: dict[str, Any]
) -> None:
    """A replica that claims the right fingerprint but serves other files (say, an edited template)
    is refused, and the next replica is asked."""
    forged = {**payload, "chat_template": payload["chat_template"] + "{# edited #}"}
    counter = _RequestCounter()

    async def main() -> None:
        async with _forging_client(forged, counter) as http:
            registry = TokenizerRegistry(http)
            with pytest.raises(TokenizerMismatch, match="hash to"):
                await registry.get(MODEL, fingerprint, ["http://forger"])
            tokenizer = await registry.get(MODEL, fingerprint, ["http://forger", replica_url])
            assert tokenizer.fingerprint == fingerprint

    asyncio.run(main())
    assert len(counter.urls) == 3


def test_mismatch_wins_over_unreachable_in_the_error(replica_url: str, fingerprint: str) -> None:
    async def scenario(http: httpx.AsyncClient) -> None:
        with pytest.raises(TokenizerMismatch, match="ConnectError"):
            await TokenizerRegistry(http).get(MODEL, "0" * 64, [_dead_url(), replica_url])

    _run(scenario)


def test_local_directory_instead_of_fetching(qwen3_dir: Path, fingerprint: str) -> None:
    counter = _RequestCounter()

    async def scenario(http: httpx.AsyncClient) -> None:
        registry = TokenizerRegistry(http)
        local = registry.register_local(MODEL, qwen3_dir)
        assert local.fingerprint == fingerprint
        assert await registry.get(MODEL, fingerprint, [_dead_url()]) is local
        with pytest.raises(TokenizerMismatch, match="local tokenizer"):
            await registry.get(MODEL, "f" * 64, [_dead_url()])

    _run(scenario, [counter])
    assert counter.urls == []


# --- encoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [{}, {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}],
    ids=["plain", "tools-and-kwargs"],
)
def test_encode_chat_matches_the_replica(replica_url: str, fingerprint: str, extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 1, **extra}
    request = parse_request(ChatCompletionRequest, json.dumps(body).encode())

    async def scenario(http: httpx.AsyncClient) -> list[int]:
        registry = TokenizerRegistry(http)
        tokenizer = await registry.get(MODEL, fingerprint, [replica_url])
        return await registry.encode_chat(tokenizer, *request.template_inputs())

    ids = _run(scenario)
    completion = httpx.post(f"{replica_url}/v1/chat/completions", json=body, timeout=60)
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == len(ids)
    assert _replica_tokens(replica_url, {"messages": CONVERSATION, **extra}) == ids


def test_encode_prompt_matches_the_replica(replica_url: str, fingerprint: str) -> None:
    text = "Once upon a time, in a land of tokens,"

    async def scenario(http: httpx.AsyncClient) -> list[int]:
        registry = TokenizerRegistry(http)
        return await registry.encode_prompt(await registry.get(MODEL, fingerprint, [replica_url]), text)

    ids = _run(scenario)
    completion = httpx.post(
        f"{replica_url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}, timeout=60
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == len(ids)
    assert _replica_tokens(replica_url, {"prompt": text}) == ids


def test_repeated_conversation_is_a_cache_hit(
    qwen3_dir: Path, fingerprint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario(http: httpx.AsyncClient) -> None:
        registry = TokenizerRegistry(http, cache_entries=2)
        tokenizer = registry.register_local(MODEL, qwen3_dir)
        chats = _count_calls(monkeypatch, tokenizer, "encode_chat")
        encodes = _count_calls(monkeypatch, tokenizer, "encode")  # encode_chat calls it too
        first = await registry.encode_chat(tokenizer, CONVERSATION, None, {})
        first.append(-1)  # callers get their own list; the cache is not touched
        second = await registry.encode_chat(tokenizer, json.loads(json.dumps(CONVERSATION)), None, {})
        assert len(chats) == 1
        assert second == first[:-1] == tokenizer.encode_chat(CONVERSATION)
        # tools, template arguments and the kind of request are part of the key
        await registry.encode_chat(tokenizer, CONVERSATION, TOOLS, {})
        await registry.encode_chat(tokenizer, CONVERSATION, None, {"enable_thinking": False})
        assert len(chats) == 1 + 3  # (the +1 is the direct call above)
        before = len(encodes)
        await registry.encode_prompt(tokenizer, "hello")
        await registry.encode_prompt(tokenizer, "hello")
        assert len(encodes) == before + 1
        assert (registry.cache_hits, registry.cache_misses) == (2, 4)
        # LRU of 2 entries: "hello" and the newest chat are kept, the first chat was evicted
        await registry.encode_chat(tokenizer, CONVERSATION, None, {})
        assert len(chats) == 5

    _run(scenario)


def test_long_inputs_are_tokenized_off_the_event_loop(
    replica_url: str, fingerprint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_text = " ".join(f"word{i} and some filler text" for i in range(400))  # > 8192 chars
    assert len(long_text) > 8192
    messages = [{"role": "user", "content": long_text}]

    async def scenario(http: httpx.AsyncClient) -> tuple[list[int], list[int]]:
        registry = TokenizerRegistry(http)
        tokenizer = await registry.get(MODEL, fingerprint, [replica_url])
        chats = _count_calls(monkeypatch, tokenizer, "encode_chat")
        encodes = _count_calls(monkeypatch, tokenizer, "encode")  # encode_chat calls it too
        short = await registry.encode_chat(tokenizer, CONVERSATION, None, {})
        long_chat = await registry.encode_chat(tokenizer, messages, None, {})
        long_prompt = await registry.encode_prompt(tokenizer, long_text)
        assert short and len(chats) == 2 and len(encodes) == 3
        loop_thread = threading.get_ident()
        assert chats[0] == loop_thread  # a short input is not worth a thread hop
        assert chats[1] != loop_thread and encodes[2] != loop_thread
        return long_chat, long_prompt

    long_chat, long_prompt = _run(scenario)
    assert _replica_tokens(replica_url, {"messages": messages}) == long_chat
    assert _replica_tokens(replica_url, {"prompt": long_text}) == long_prompt


# --- boundaries ----------------------------------------------------------------------------------


def test_gateway_tokenizers_do_not_import_torch_or_the_replica() -> None:
    code = (
        "import sys, gateway.tokenizers; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] in ('torch', 'replica')); "
        "print(bad); assert 'torch' not in sys.modules and not bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
