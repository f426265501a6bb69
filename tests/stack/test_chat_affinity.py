"""The product's core promise, through real processes: a chat whose next turn is sent the moment
the answer arrives stays on the replica that holds its history, with the default ``kv`` policy and
the default heartbeat and poll intervals. On the tiny test model a 24-token answer spans a good
part of a heartbeat interval, so the heartbeat the gateway holds when the next turn comes often
still counts the request that just finished; the gateway must take it out itself (without that,
a third to a half of these runs lost a turn). Likewise a whole request sent to that replica just
before the next turn counts its prefill only until the replica's events store its prompt (with
its whole prompt counted for up to a second, about one run in ten lost a turn). And a replica
that has just answered a chat awaits its next turn (``--expect-return``): without that, another
chat's first turn could take its place for a cached template opening while a replica idled, and
the next turn then left (about one run in 27). The same chat on the real default model, through
``kvroute up``: tests/stack/test_stack.py."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI

from tests.helpers.chat_turns import converse, lost_turns
from tests.helpers.processes import StackProcesses, running_stack

# What a first-time user asks: one short question each, no two alike (a shared opening would be a
# cached prefix on whichever replica answered it first).
QUESTIONS = {
    "whole": ("What is the capital of France?", "How do I boil an egg?", "Name three primary colors."),
    "streamed": ("Write a haiku about autumn.", "Why is the sky blue?", "How many legs does a spider have?"),
}
# Three people at once, each opening with a few sentences of their own. Their histories outweigh
# one co-running request (the kv policy's decode weight, 64 tokens): two chats of a few tokens
# that share a busy replica may legitimately split, since re-reading so short a history elsewhere
# costs less than waiting behind the other chat.
OPENINGS = (
    "I am planning a small vegetable garden behind my house. The soil is sandy, the spot gets sun "
    "in the morning only, and I have about four square meters. Which vegetables should I plant?",
    "My team writes a web service in Python. Requests are slow when the database is busy, and the "
    "logs show many queries per request. What should we look at first to make it faster?",
    "I want to learn to play the guitar at forty. I can practice half an hour a day after work and "
    "I like folk songs. How should I structure the first three months of practice?",
)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}-replicas")
def stack(
    request: pytest.FixtureRequest, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StackProcesses]:
    workdir = tmp_path_factory.mktemp(f"affinity-{request.param}")
    with running_stack(
        llama_dir, workdir, request.param, replica_args=("--heartbeat-interval", "0.5")
    ) as processes:
        yield processes


def client(stack: StackProcesses) -> OpenAI:
    return OpenAI(base_url=f"{stack.gateway.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("mode", ["whole", "streamed"])
def test_one_chat_at_a_time_keeps_its_replica(stack: StackProcesses, mode: str) -> None:
    for question in QUESTIONS[mode]:
        record = converse(client(stack), stack.model, question, stream=mode == "streamed")
        assert not lost_turns(record), record


def test_three_chats_at_once_keep_their_replicas(stack: StackProcesses) -> None:
    with ThreadPoolExecutor(len(OPENINGS)) as pool:
        futures = [
            pool.submit(converse, client(stack), stack.model, opening, stream=i % 2 == 1)
            for i, opening in enumerate(OPENINGS)
        ]
        records = [future.result() for future in futures]
    assert not [lost for record in records for lost in lost_turns(record)], records
