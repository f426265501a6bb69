"""The gateway's tokenizer registry against a real replica process on the tiny Qwen3, and its
cache of token ids across chat turns against full tokenizations.

The gateway must produce the very token ids the replica prefills, so every encoding check compares
with what the replica itself reports (``usage.prompt_tokens`` and ``/tokenize``), or with a full
tokenization by the same tokenizer the replica runs.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import AddedToken, Tokenizer

from gateway.tokenizer_registry import TokenizerMismatch, TokenizerRegistry, TokenizerUnavailable
from kvroute.openai_api.schema import ChatCompletionRequest, parse_request
from kvroute.protocol import block_hashes
from kvroute.text.tokenizer import PIECEWISE_TEXT_CHARS, TextTokenizer
from launcher.local_redis import free_port
from tests.helpers.processes import ReplicaProcess

pytestmark = pytest.mark.anyio  # async tests run on asyncio (tests/conftest.py)

MODEL = "tiny-qwen3"
TIMEOUT_S = 60  # the bound of each test that talks to the replica
BLOCK_SIZE = 8
TEMPLATES = Path(__file__).parents[1] / "templates"

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


class _RequestCounter:
    """An httpx request hook counting tokenizer fetches."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    async def __call__(self, request: httpx.Request) -> None:
        if request.url.path == "/kvroute/tokenizer":
            self.urls.append(str(request.url))


@pytest.fixture
def fetches() -> _RequestCounter:
    """The tokenizer fetches ``http`` sends."""
    return _RequestCounter()


@pytest.fixture
async def http(fetches: _RequestCounter) -> AsyncIterator[httpx.AsyncClient]:
    """A fresh AsyncClient per test; ``fetches`` sees every request it sends."""
    async with httpx.AsyncClient(timeout=30, event_hooks={"request": [fetches]}) as client:
        yield client


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
        "model", "fingerprint", "block_size", "max_model_len", "tokenizer_json", "chat_template",
        "tokenizer_config",
    }  # fmt: skip
    assert payload["model"] == MODEL
    assert isinstance(payload["max_model_len"], int) and payload["max_model_len"] > 0
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


async def test_concurrent_gets_share_one_fetch(
    replica_url: str, fingerprint: str, http: httpx.AsyncClient, fetches: _RequestCounter
) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        registry = TokenizerRegistry(http)
        assert registry.cached(MODEL, fingerprint) is None
        got = await asyncio.gather(*(registry.get(MODEL, fingerprint, [replica_url]) for _ in range(20)))
        again = await registry.get(MODEL, fingerprint, [replica_url])
        assert registry.cached(MODEL, fingerprint) is again
    tokenizers = [*got, again]
    assert len(fetches.urls) == 1
    assert all(tokenizer is tokenizers[0] for tokenizer in tokenizers)
    assert tokenizers[0].fingerprint == fingerprint


async def test_wrong_fingerprint_or_model_is_refused_and_not_cached(
    replica_url: str, fingerprint: str, http: httpx.AsyncClient
) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        registry = TokenizerRegistry(http)
        with pytest.raises(TokenizerMismatch, match="is registered"):
            await registry.get(MODEL, "0" * 64, [replica_url])
        with pytest.raises(TokenizerMismatch, match="serves model"):
            await registry.get("other-model", fingerprint, [replica_url])
        assert registry.cached(MODEL, "0" * 64) is None
        # a failure does not poison the key: the right fingerprint still loads
        assert (await registry.get(MODEL, fingerprint, [replica_url])).fingerprint == fingerprint


async def test_unreachable_replica_falls_back_to_the_next(
    replica_url: str, fingerprint: str, http: httpx.AsyncClient, fetches: _RequestCounter
) -> None:
    dead = _dead_url()

    async with asyncio.timeout(TIMEOUT_S):
        tokenizer = await TokenizerRegistry(http).get(MODEL, fingerprint, [dead, replica_url + "/"])
    assert tokenizer.fingerprint == fingerprint
    assert [url.rsplit("/kvroute", 1)[0] for url in fetches.urls] == [dead, replica_url]


async def test_no_usable_replica_is_unavailable(
    replica_url: str, fingerprint: str, http: httpx.AsyncClient
) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        registry = TokenizerRegistry(http)
        with pytest.raises(TokenizerUnavailable, match="ConnectError"):
            await registry.get(MODEL, fingerprint, [_dead_url(), _dead_url()])
        with pytest.raises(TokenizerUnavailable, match="no replica URLs"):
            await registry.get(MODEL, fingerprint, [])
        with pytest.raises(TokenizerUnavailable, match="404"):  # a replica without the endpoint
            await registry.get(MODEL, fingerprint, [replica_url + "/nothing-here"])


def _forging_client(forged: dict[str, Any], counter: _RequestCounter) -> httpx.AsyncClient:
    """A client on which http://forger answers ``forged``; other hosts are real."""
    forger = httpx.MockTransport(lambda request: httpx.Response(200, json=forged))
    return httpx.AsyncClient(timeout=30, mounts={"http://forger": forger}, event_hooks={"request": [counter]})


async def test_files_that_do_not_hash_to_the_claimed_fingerprint_are_refused(
    replica_url: str, fingerprint: str, payload: dict[str, Any]
) -> None:
    """A replica that claims the right fingerprint but serves other files (say, an edited template)
    is refused, and the next replica is asked."""
    forged = {**payload, "chat_template": payload["chat_template"] + "{# edited #}"}
    counter = _RequestCounter()

    async with _forging_client(forged, counter) as http:
        registry = TokenizerRegistry(http)
        with pytest.raises(TokenizerMismatch, match="hash to"):
            await registry.get(MODEL, fingerprint, ["http://forger"])
        tokenizer = await registry.get(MODEL, fingerprint, ["http://forger", replica_url])
        assert tokenizer.fingerprint == fingerprint
    assert len(counter.urls) == 3


async def test_mismatch_wins_over_unreachable_in_the_error(
    replica_url: str, fingerprint: str, http: httpx.AsyncClient
) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        with pytest.raises(TokenizerMismatch, match="ConnectError"):
            await TokenizerRegistry(http).get(MODEL, "0" * 64, [_dead_url(), replica_url])


async def test_local_directory_instead_of_fetching(
    qwen3_dir: Path, fingerprint: str, http: httpx.AsyncClient, fetches: _RequestCounter
) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        registry = TokenizerRegistry(http)
        local = registry.register_local(MODEL, qwen3_dir)
        assert local.fingerprint == fingerprint
        assert await registry.get(MODEL, fingerprint, [_dead_url()]) is local
        with pytest.raises(TokenizerMismatch, match="local tokenizer"):
            await registry.get(MODEL, "f" * 64, [_dead_url()])
    assert fetches.urls == []


# --- encoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [{}, {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}],
    ids=["plain", "tools-and-kwargs"],
)
async def test_encode_chat_matches_the_replica(
    replica_url: str, fingerprint: str, extra: dict[str, Any], http: httpx.AsyncClient
) -> None:
    body = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 1, **extra}
    request = parse_request(ChatCompletionRequest, json.dumps(body).encode())

    async with asyncio.timeout(TIMEOUT_S):
        registry = TokenizerRegistry(http)
        tokenizer = await registry.get(MODEL, fingerprint, [replica_url])
        ids = (await registry.encode_chat(tokenizer, *request.template_inputs())).ids.tolist()
    completion = httpx.post(f"{replica_url}/v1/chat/completions", json=body, timeout=60)
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == len(ids)
    assert _replica_tokens(replica_url, {"messages": CONVERSATION, **extra}) == ids


async def test_encode_prompt_matches_the_replica(
    replica_url: str, fingerprint: str, http: httpx.AsyncClient
) -> None:
    text = "Once upon a time, in a land of tokens,"

    async with asyncio.timeout(TIMEOUT_S):
        registry = TokenizerRegistry(http)
        tokenizer = await registry.get(MODEL, fingerprint, [replica_url])
        ids = (await registry.encode_prompt(tokenizer, text)).ids.tolist()
    completion = httpx.post(
        f"{replica_url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}, timeout=60
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == len(ids)
    assert _replica_tokens(replica_url, {"prompt": text}) == ids


async def test_repeated_conversation_is_a_cache_hit(
    qwen3_dir: Path, fingerprint: str, monkeypatch: pytest.MonkeyPatch, http: httpx.AsyncClient
) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        registry = TokenizerRegistry(http)
        tokenizer = registry.register_local(MODEL, qwen3_dir)
        chats = _count_calls_args(monkeypatch, tokenizer, "encode_with_boundaries")
        prompts = _count_calls(monkeypatch, tokenizer, "encode")
        first = await registry.encode_chat(tokenizer, CONVERSATION, None, {})
        second = await registry.encode_chat(tokenizer, json.loads(json.dumps(CONVERSATION)), None, {})
        assert second is first and len(chats) == 1
        assert first.ids.tolist() == tokenizer.encode_chat(CONVERSATION)
        # tools, template arguments and the kind of request are part of the key; the rendering
        # with thinking off is the same up to the generation prompt, so only that is tokenized
        await registry.encode_chat(tokenizer, CONVERSATION, TOOLS, {})
        off = await registry.encode_chat(tokenizer, CONVERSATION, None, {"enable_thinking": False})
        assert len(chats) == 3 and registry.prefix_hits == 1
        assert off.ids.tolist() == tokenizer.encode_chat(CONVERSATION, enable_thinking=False)
        assert len(chats[-1]) < len(tokenizer.render_chat(CONVERSATION, enable_thinking=False)) // 4
        before = len(prompts)  # (the direct encode_chat calls above encode too)
        await registry.encode_prompt(tokenizer, "hello")
        await registry.encode_prompt(tokenizer, "hello")
        assert len(prompts) == before + 1
        assert (registry.cache_hits, registry.cache_misses) == (2, 4)


async def test_long_inputs_are_tokenized_off_the_event_loop(
    replica_url: str, fingerprint: str, monkeypatch: pytest.MonkeyPatch, http: httpx.AsyncClient
) -> None:
    long_text = " ".join(f"word{i} and some filler text" for i in range(400))  # > 8192 chars
    assert len(long_text) > 8192
    messages = [{"role": "user", "content": long_text}]
    next_turn = [*messages, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "More?"}]

    async with asyncio.timeout(TIMEOUT_S):
        registry = TokenizerRegistry(http)
        tokenizer = await registry.get(MODEL, fingerprint, [replica_url])
        chats = _count_calls(monkeypatch, tokenizer, "encode_with_boundaries")
        prompts = _count_calls(monkeypatch, tokenizer, "encode")
        short = await registry.encode_chat(tokenizer, CONVERSATION, None, {})
        long_chat = await registry.encode_chat(tokenizer, messages, None, {})
        long_prompt = await registry.encode_prompt(tokenizer, long_text)
        # the next turn is long too, but only its short new part is left to tokenize
        followed = await registry.encode_chat(tokenizer, next_turn, None, {})
        assert len(short) and len(chats) == 3 and len(prompts) == 1 and registry.prefix_hits == 1
        loop_thread = threading.get_ident()
        assert chats[0] == loop_thread  # a short input is not worth a thread hop
        assert chats[1] != loop_thread and prompts[0] != loop_thread
        assert chats[2] == loop_thread
    assert _replica_tokens(replica_url, {"messages": messages}) == long_chat.ids.tolist()
    assert _replica_tokens(replica_url, {"prompt": long_text}) == long_prompt.ids.tolist()
    assert _replica_tokens(replica_url, {"messages": next_turn}) == followed.ids.tolist()


def _count_calls_args(monkeypatch: pytest.MonkeyPatch, tokenizer: TextTokenizer, name: str) -> list[str]:
    """Wraps ``tokenizer.name``; returns the list of texts it was asked to encode."""
    original = getattr(tokenizer, name)
    texts: list[str] = []

    def counted(text: str, *args: Any, **kwargs: Any) -> Any:
        texts.append(text)
        return original(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, name, counted)
    return texts


# --- ids reused across turns ---------------------------------------------------------------------

# Content pieces meant to stress the seams: unicode (combining marks, astral, right-to-left), digit
# runs (both families split digits), whitespace runs, and special-token text inside a message.
PIECES = [
    "hello", " world", "  ", "\n", "\n\n", "\t", "12345", " 3.14159", " 42 ", "2024-01-01", "é",
    "e\u0301", "日本語の", "😀👍🏽", " مرحبا", "Ω≈ç√", "don't", "ABC", "x" * 30, ".", "?!",
    "<|im_end|>", "<|im_start|>", "<|im_", "|>", "<think>", "</think>", "<tool_call>",
]  # fmt: skip


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 20)))


def _conversation(rng: random.Random, with_tools: bool) -> list[dict[str, Any]]:
    """A random chat: maybe a system message, then user turns each answered by the assistant (in
    plain text, with reasoning, or with a tool call and its result)."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _text(rng)})
    for turn in range(rng.randint(1, 7)):
        messages.append({"role": "user", "content": _text(rng)})
        kind = rng.random()
        if with_tools and kind < 0.2:
            call = {"id": f"c{turn}", "type": "function", "function": {"name": "f", "arguments": '{"n": 1}'}}
            messages.append({"role": "assistant", "content": _text(rng), "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"c{turn}", "content": _text(rng)})
        elif kind < 0.4:
            messages.append({"role": "assistant", "content": f"<think>{_text(rng)}</think>{_text(rng)}"})
        else:
            messages.append({"role": "assistant", "content": _text(rng)})
    return messages


def _with_template(model_dir: Path, template: str, **config: Any) -> TextTokenizer:
    """The model's tokenizer with a template from tests/templates (and config overrides)."""
    base = TextTokenizer.from_dir(model_dir)
    text = (TEMPLATES / template).read_text(encoding="utf-8")
    return TextTokenizer.from_files(base.tokenizer_json, text, {**base.tokenizer_config, **config})


async def _check_turn_by_turn(
    registry: TokenizerRegistry, tokenizer: TextTokenizer, rng: random.Random, conversations: int
) -> int:
    """Sends random conversations turn by turn (every prefix ending with a user message); each
    prompt must equal a full tokenization, block hashes included. Returns the prompts sent."""
    sent = 0
    for _ in range(conversations):
        with_tools = tokenizer.chat_template is not None and "tools" in tokenizer.chat_template
        messages = _conversation(rng, with_tools)
        tools = TOOLS if with_tools and rng.random() < 0.3 else None
        kwargs = {"enable_thinking": False} if with_tools and rng.random() < 0.3 else {}
        for end in [i + 1 for i, message in enumerate(messages) if message["role"] == "user"]:
            prompt = await registry.encode_chat(tokenizer, messages[:end], tools, kwargs)
            full = tokenizer.encode_chat(messages[:end], tools, **kwargs)
            assert prompt.ids.tolist() == full, (messages[:end], tools, kwargs)
            assert prompt.block_hashes(4, 99) == block_hashes(full, 4, 99)
            sent += 1
    return sent


@pytest.mark.parametrize("template", ["smollm2.jinja", "qwen3.jinja"])
async def test_turn_after_turn_the_ids_equal_a_full_tokenization(
    template: str, llama_dir: Path, qwen3_dir: Path
) -> None:
    """SmolLM2's template on the SmolLM2-style tokenizer, Qwen3's on the Qwen-style one (NFC, its
    split regex, added non-special tokens); Qwen3 re-renders past turns differently (reasoning
    dropped), which only ends the reused prefix earlier."""
    tokenizer = _with_template(llama_dir if template == "smollm2.jinja" else qwen3_dir, template)

    registry = TokenizerRegistry(httpx.AsyncClient())
    sent = await _check_turn_by_turn(registry, tokenizer, random.Random(template), 40)
    assert registry.cache_misses == sent  # no conversation repeats
    assert registry.prefix_hits > 0.7 * sent, (registry.prefix_hits, sent)


async def test_special_tokens_split_as_text_are_no_boundaries(qwen3_dir: Path) -> None:
    """With ``split_special_tokens`` the special tokens are plain text: only the added non-special
    tokens (``<think>``...) still cut the text, and the ids stay exact."""
    tokenizer = _with_template(qwen3_dir, "qwen3.jinja", split_special_tokens=True)
    assert "<|im_start|>" not in tokenizer.boundary_tokens and "<think>" in tokenizer.boundary_tokens

    await _check_turn_by_turn(TokenizerRegistry(httpx.AsyncClient()), tokenizer, random.Random(7), 15)


async def test_a_longer_token_at_a_cached_boundary_is_not_taken_for_it(
    qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An added token that begins with a boundary token's text: the rendering of the next turn has
    the same text before the boundary, but a different token at it, so that key does not match."""
    base = TextTokenizer.from_dir(qwen3_dir)
    raw = Tokenizer.from_str(base.tokenizer_json)
    raw.add_special_tokens([AddedToken("<|im_start|>assistant\nNo", special=True, normalized=False)])
    template = (TEMPLATES / "smollm2.jinja").read_text(encoding="utf-8")
    tokenizer = TextTokenizer.from_files(raw.to_str(), template, base.tokenizer_config)
    turn = [{"role": "user", "content": "Yes or no?"}]
    next_turn = [*turn, {"role": "assistant", "content": "No."}, {"role": "user", "content": "Sure?"}]

    registry = TokenizerRegistry(httpx.AsyncClient())
    encoded = _count_calls_args(monkeypatch, tokenizer, "encode_with_boundaries")
    await registry.encode_chat(tokenizer, turn, None, {})
    prompt = await registry.encode_chat(tokenizer, next_turn, None, {})
    assert prompt.ids.tolist() == tokenizer.encode_chat(next_turn)
    assert registry.prefix_hits == 1
    # not reused up to the assistant turn's start (another token there now), but to the one before
    assert encoded[-1].startswith("<|im_end|>\n<|im_start|>assistant\nNo.")


@pytest.mark.parametrize("question", ["Yes or no?", "Yes or no? " * 6000], ids=["offsets", "piecewise"])
def test_boundaries_are_where_the_tokenizer_cut(qwen3_dir: Path, question: str) -> None:
    """With a plain tokenizer every candidate's index points at its token. An added token that
    swallows one (it ends with ``<|im_end|>`` and strips on its left, so it is no candidate itself)
    takes that candidate out: read from the offsets, only that one; found piece by piece (a long
    text), the pieces no longer join up to the whole text's ids, and none of them. The ids are a
    full encoding's either way."""
    base = TextTokenizer.from_dir(qwen3_dir)
    template = (TEMPLATES / "smollm2.jinja").read_text(encoding="utf-8")
    chat = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "No."},
        {"role": "user", "content": "Sure?"},
    ]
    raw = Tokenizer.from_str(base.tokenizer_json)
    raw.add_special_tokens([AddedToken("No.<|im_end|>", special=True, normalized=False, lstrip=True)])
    swallowing = TextTokenizer.from_files(raw.to_str(), template, base.tokenizer_config)
    plain = TextTokenizer.from_files(base.tokenizer_json, template, base.tokenizer_config)
    piecewise = len(question) > 100
    for tokenizer, reported in ((plain, 9), (swallowing, 0 if piecewise else 8)):
        text = tokenizer.render_chat(chat, None, add_generation_prompt=True)
        assert (len(text) >= PIECEWISE_TEXT_CHARS) == piecewise
        candidates = tokenizer.boundaries(text)
        ids, indices = tokenizer.encode_with_boundaries(text, candidates)
        assert ids == Tokenizer.from_str(tokenizer.tokenizer_json).encode(text, add_special_tokens=False).ids
        assert len(candidates) == len(indices) == 9
        found = [
            (index, token_id) for index, (_, token_id) in zip(indices, candidates, strict=True) if index >= 0
        ]
        assert len(found) == reported and all(ids[index] == token_id for index, token_id in found)


async def test_the_cache_holds_one_copy_per_conversation_within_its_bound(qwen3_dir: Path) -> None:
    tokenizer = _with_template(qwen3_dir, "qwen3.jinja")
    rng = random.Random(3)

    registry = TokenizerRegistry(httpx.AsyncClient(), cache_bytes=200_000)
    messages = [{"role": "user", "content": "Start."}]
    for turn in range(6):
        await registry.encode_chat(tokenizer, messages, None, {})
        messages += [
            {"role": "assistant", "content": f"Answer {turn}."},
            {"role": "user", "content": "Go on."},
        ]
    assert registry.prefix_hits == 5 and registry.cache_entries == 1
    first = [{"role": "user", "content": "The very first conversation."}]
    await registry.encode_chat(tokenizer, first, None, {})
    for _ in range(300):
        await registry.encode_chat(tokenizer, [{"role": "user", "content": _text(rng) * 3}], None, {})
        assert registry.cache_bytes <= 200_000
    hits = registry.cache_hits
    await registry.encode_chat(tokenizer, first, None, {})
    assert registry.cache_hits == hits, "the oldest entries were evicted"


async def test_the_cache_size_estimate_is_close_to_the_memory_used(qwen3_dir: Path) -> None:
    tokenizer = _with_template(qwen3_dir, "qwen3.jinja")
    conversations = [_conversation(random.Random(seed), with_tools=False) for seed in range(200)]

    async def fill(registry: TokenizerRegistry) -> None:
        for messages in conversations:
            await registry.encode_chat(tokenizer, messages, None, {})

    await fill(TokenizerRegistry(httpx.AsyncClient()))  # warm whatever caches jinja keeps
    registry = TokenizerRegistry(httpx.AsyncClient())
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    await fill(registry)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    estimated = registry.cache_bytes
    assert 0.6 * used < estimated < 1.6 * used, (used, estimated)


# --- boundaries ----------------------------------------------------------------------------------


def test_gateway_tokenizers_do_not_import_torch_or_the_replica() -> None:
    code = (
        "import sys, gateway.tokenizer_registry; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] in ('torch', 'replica')); "
        "print(bad); assert 'torch' not in sys.modules and not bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
