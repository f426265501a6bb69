"""Tokenizing a multi-turn chat (4 of :mod:`loadtests.bench_gateway`): from scratch, as a replica
does, and with the gateway's tokenizer registry, which encodes only a chat's new turn."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.tokenizer_registry import TokenizerRegistry
from kvroute.text.tokenizer import TextTokenizer
from loadtests.bench_gateway.settings import TOKENIZE_TOKENS, TOKENIZE_TURNS, filler


def multi_turn_chat(tokenizer: TextTokenizer, tokens: int, turns: int) -> list[dict[str, str]]:
    """A chat of ``turns`` user turns (assistant answers between them) of about ``tokens`` tokens."""
    chars = 40
    while True:
        messages = [{"role": "system", "content": filler(chars, 0)}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"{filler(chars, 2 * turn + 1)} ({turn * 1234})?"})
            messages.append({"role": "assistant", "content": filler(chars, 2 * turn + 2)})
        messages.pop()
        if len(tokenizer.encode_chat(messages)) >= tokens:
            return messages
        chars = chars * 5 // 4


def measure_tokenization(model_dir: Path, repeats: int) -> dict[str, Any]:
    """µs per request to get the ids of turn 10 of a ~4,000-token chat three ways (module docstring).

    Each timed request asks for another last user message, so none is a verbatim repeat of a
    cached one but in the third mode."""
    tokenizer = TextTokenizer.from_dir(model_dir)
    messages = multi_turn_chat(tokenizer, TOKENIZE_TOKENS, TOKENIZE_TURNS)
    last = messages[-1]["content"]
    variants = [[*messages[:-1], {"role": "user", "content": f"{last} #{i}"}] for i in range(repeats)]

    async def registry_us(warm: list[dict[str, str]], timed: list[list[dict[str, str]]]) -> float:
        async with httpx.AsyncClient() as http:
            registry = TokenizerRegistry(http)
            await registry.encode_chat(tokenizer, warm, None, {})
            start = time.perf_counter()
            for chat in timed:
                await registry.encode_chat(tokenizer, chat, None, {})
            return 1e6 * (time.perf_counter() - start) / len(timed)

    start = time.perf_counter()
    for chat in variants:
        tokenizer.encode_chat(chat)
    scratch = 1e6 * (time.perf_counter() - start) / repeats
    return {
        "prompt_tokens": len(tokenizer.encode_chat(variants[0])),
        "turns": TOKENIZE_TURNS,
        "from_scratch_us": scratch,
        "previous_turn_cached_us": asyncio.run(registry_us(messages[:-2], variants)),
        "verbatim_repeat_us": asyncio.run(registry_us(variants[0], [variants[0]] * repeats)),
    }
