"""The prompt's ids the gateway forwards (``kvroute_prompt_ids``) never push a body the gateway
accepted over the replica's limit (the same ``--max-body-bytes`` on both): a chat that fits as
sent, but not with its ids added, goes without them and is answered, not refused with a 413."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.processes import StackProcesses, running_stack

LIMIT = 4096


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProcesses]:
    limit = ("--max-body-bytes", str(LIMIT))
    with running_stack(
        llama_dir, tmp_path_factory.mktemp("prompt-ids"), 1, replica_args=limit, gateway_args=limit
    ) as processes:
        yield processes


@pytest.mark.parametrize("words", [20, 800])
def test_a_chat_near_the_body_limit_is_answered(stack: StackProcesses, words: int) -> None:
    text = " ".join(f"w{i % 97}" for i in range(words))
    body = {"model": stack.model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    size = len(httpx.Request("POST", "http://x", json=body).content)
    assert size < LIMIT and (words < 100 or size + 2 * words > LIMIT), "the case this test is for"
    reply = httpx.post(f"{stack.gateway.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] > words
