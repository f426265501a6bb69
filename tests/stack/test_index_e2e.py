"""Replica process -> Redis -> gateway index mirror, end to end on the tiny model.

The gateway side tokenizes from the files a replica serves (``TextTokenizer.from_files``) and
parses the request with the shared OpenAI schema, exactly as the gateway will; the replica side
is the real server. Both must agree on every block hash.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from gateway.index.mirror import IndexMirror
from kvroute.openai_api.schema import ChatCompletionRequest, parse_request
from kvroute.protocol import block_hashes, model_seed
from kvroute.text.tokenizer import TextTokenizer
from launcher.local_redis import RedisServer
from tests.helpers.processes import ReplicaProcess
from tests.helpers.waiting import wait_until_async

pytestmark = pytest.mark.anyio  # async tests run on asyncio (tests/conftest.py)

SYSTEM = "You are a careful assistant. " * 12
CHAT = {
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which replica holds the prefix of this prompt, and why?"},
    ],
    "max_tokens": 4,
    "temperature": 0,
}


def gateway_side_hashes(model_dir: Path, model: str) -> tuple[list[int], list[int]]:
    """Token ids and block hashes as the gateway computes them, from the replica's served files."""
    tokenizer = TextTokenizer.from_files(
        (model_dir / "tokenizer.json").read_text(),
        (model_dir / "chat_template.jinja").read_text(),
        json.loads((model_dir / "tokenizer_config.json").read_text()),
    )
    request = parse_request(ChatCompletionRequest, json.dumps({"model": model, **CHAT}).encode())
    messages, tools, kwargs = request.template_inputs()
    ids = tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=True, **kwargs)
    return ids, block_hashes(ids, 16, model_seed(model, tokenizer.fingerprint))


async def test_mirror_tracks_what_a_replica_caches(
    redis_server: RedisServer, llama_dir: Path, tmp_path: Path
) -> None:
    model = llama_dir.name
    replica = ReplicaProcess(
        llama_dir, tmp_path / "replica.log",
        "--dtype", "float32", "--kv-cache-tokens", "4096", "--redis", redis_server.url,
        "--heartbeat-interval", "0.2",
    )  # fmt: skip
    replica_id = f"127.0.0.1:{replica.port}"
    prompt_ids, hashes = gateway_side_hashes(llama_dir, model)
    assert len(hashes) >= 8, "the prompt should span several blocks"
    client = OpenAI(base_url=f"{replica.url}/v1", api_key="x", max_retries=0)

    try:
        mirror = IndexMirror(redis_server.url, poll_interval=0.1)
        await mirror.start()
        try:
            await wait_until_async(
                lambda: [r.replica_id for r in mirror.replicas(model)] == [replica_id],
                "the replica in the mirror",
            )
            assert mirror.lookup(model, hashes) == {replica_id: 0}

            reply = await asyncio.to_thread(client.chat.completions.create, model=model, **CHAT)
            assert reply.usage.prompt_tokens == len(prompt_ids)  # same tokenization on both sides
            await wait_until_async(
                lambda: mirror.lookup(model, hashes) == {replica_id: len(hashes)},
                "the prompt's blocks in the mirror",
            )

            again = await asyncio.to_thread(client.chat.completions.create, model=model, **CHAT)
            cached = again.usage.prompt_tokens_details.cached_tokens
            assert cached == min(len(hashes), (len(prompt_ids) - 1) // 16) * 16

            evicted = httpx.post(f"{replica.url}/reset_prefix_cache", timeout=10).json()["evicted_pages"]
            assert evicted >= len(hashes)
            await wait_until_async(
                lambda: mirror.lookup(model, hashes) == {replica_id: 0}, "the reset to reach the mirror"
            )
        finally:
            await mirror.stop()
    finally:
        replica.terminate()
