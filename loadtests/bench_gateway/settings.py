"""The gateway benchmark's sizes, targets and settings, and the request every side is sent."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loadtests.harness import reporter

BENCH = "bench_gateway"
progress = reporter(BENCH)

# Sizes of a full run and of a --quick smoke run; explicit options override either.
FULL = {"sequential": 400, "concurrent": 600, "rounds": 3, "warmup": 50, "tokenize": 200, "client": 3000}
QUICK = {"sequential": 20, "concurrent": 64, "rounds": 1, "warmup": 5, "tokenize": 10, "client": 100}

CONCURRENCY = 32
CHAT_CHARS = 2000
SYSTEM_CHARS = 400
TOKENIZE_TOKENS = 4000  # the multi-turn chat of the tokenization measurement
TOKENIZE_TURNS = 10
MODES = ("non_streaming", "streaming")
SIDES = ("direct", "gateway", "sglang_router")

REPLICA_ENGINES = {
    "sim": "the sim backend, `instant` profile (a simulation: the real replica server, tokenizer, "
    "scheduler and radix cache, a forward pass that costs nothing), tiny test model's tokenizer",
    "torch": "tiny random llama test model on the torch engine, float32 (the smallest real engine response)",
}

# Targets.
ADDED_P50_MS_TARGET = 0.5
CPU_US_TARGET = 300.0
REQ_S_TARGET = 2500.0

WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "judges",
    "watch",
)


@dataclass
class Settings:
    sequential: int  # requests per side per mode at concurrency 1
    concurrent: int  # requests per side per mode per round at concurrency 32
    rounds: int
    warmup: int
    tokenize: int  # turn-10 variants timed per tokenization mode
    client: int  # requests per upstream client, concurrency and mode
    out: str
    replica_engine: str  # a key of REPLICA_ENGINES


def filler(chars: int, seed: int) -> str:
    words, n = [], seed
    while sum(len(w) + 1 for w in words) < chars:
        words.append(WORDS[n % len(WORDS)])
        n = n * 7 + 3
    return " ".join(words)[:chars]


def chat_body(model: str, stream: bool) -> bytes:
    system = filler(SYSTEM_CHARS, 1)
    user = filler(CHAT_CHARS - SYSTEM_CHARS, 2)
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 1,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


HEADERS = {"content-type": "application/json"}
CHAT_PATH = "/v1/chat/completions"
