"""Seeded, reproducible workloads: what the benchmark sends, as conversations of one or more turns.

Every workload is a list of :class:`Conversation`: a fixed opening (system/document messages) and
user turns sent one after the other, each carrying the whole history so far (the API is
stateless). Single-shot datasets (random, shared-prefix, most jsonl files) are one-turn
conversations. Lengths are in tokens of the given tokenizer: text is built from whole-word
vocabulary tokens, so it re-tokenizes to (almost exactly) the asked length.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.text.tokenizer import TextTokenizer

Message = dict[str, Any]


@dataclass
class Conversation:
    """One client's session: an opening, then user turns that each wait for the previous answer."""

    opening: list[Message]
    user_turns: list[str]
    max_tokens: int
    think_time_s: float = 0.0  # mean pause between an answer and the next turn (exponential)
    group: int = 0  # which shared prefix/document it opens with (for reports)


@dataclass
class Workload:
    name: str
    conversations: list[Conversation]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(c.user_turns) for c in self.conversations)


class TextSource:
    """Random text of a given token length, for any tokenizer: pseudo-words from a fixed pool of
    syllables, tokenized, cut at the asked length and decoded back to text."""

    _SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "en", "pa", "do", "ri", "so", "tu", "be")

    def __init__(self, tokenizer: TextTokenizer, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self._words = [
            "".join(rng.choice(self._SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(2000)
        ]

    def text(self, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        ids: list[int] = []
        while len(ids) < num_tokens:
            words = " ".join(self.rng.choice(self._words) for _ in range(num_tokens))
            ids += self.tokenizer.encode(" " + words, add_special_tokens=False)
        return self.tokenizer.decode(ids[:num_tokens]).strip()


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in mean·[1-r, 1+r] (vLLM's --random-range-ratio), at least 1."""
    low = max(1, round(mean * (1 - range_ratio)))
    high = max(low, round(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_workload(
    source: TextSource, num_prompts: int, input_len: int, output_len: int, range_ratio: float
) -> Workload:
    """Independent single-turn chats with random text: no shared prefix beyond the template."""
    rng = source.rng
    conversations = [
        Conversation([], [source.text(_length(rng, input_len, range_ratio))], _length(rng, output_len, 0))
        for _ in range(num_prompts)
    ]
    settings = {"input_len": input_len, "output_len": output_len, "range_ratio": range_ratio}
    return Workload("random", conversations, settings)


def shared_prefix_workload(
    source: TextSource,
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
) -> Workload:
    """Many users behind a few long system prompts: each request is one prefix + its own question."""
    rng = source.rng
    prefixes = [source.text(prefix_len) for _ in range(num_prefixes)]
    conversations = []
    for _ in range(num_prompts):
        group = rng.randrange(num_prefixes)
        opening = [{"role": "system", "content": prefixes[group]}]
        conversations.append(Conversation(opening, [source.text(suffix_len)], output_len, group=group))
    settings = {
        "num_prefixes": num_prefixes,
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "output_len": output_len,
    }
    return Workload("shared-prefix", conversations, settings)


def multi_turn_workload(
    source: TextSource,
    num_conversations: int,
    turns: int,
    num_documents: int,
    document_len: tuple[int, int],
    user_len: int,
    output_len: int,
    think_time_s: float,
) -> Workload:
    """Conversations that each open with a long document (shared by several of them) and go on
    with short user turns: the workload where landing on the replica holding the history counts."""
    rng = source.rng
    documents = [source.text(rng.randint(*document_len)) for _ in range(num_documents)]
    conversations = []
    for index in range(num_conversations):
        group = index % num_documents if index < num_documents else rng.randrange(num_documents)
        opening = [{"role": "system", "content": documents[group]}]
        questions = [source.text(_length(rng, user_len, 0.5)) for _ in range(turns)]
        conversations.append(Conversation(opening, questions, output_len, think_time_s, group))
    settings = {
        "num_conversations": num_conversations,
        "turns": turns,
        "num_documents": num_documents,
        "document_len": list(document_len),
        "user_len": user_len,
        "output_len": output_len,
        "think_time_s": think_time_s,
    }
    return Workload("multi-turn", conversations, settings)


def jsonl_workload(path: Path, output_len: int, limit: int | None) -> Workload:
    """One conversation per line: ``{"prompt": str}``, ``{"messages": [...]}`` (sent as is) or
    ``{"system": str, "turns": [str, ...]}`` (multi-turn); an optional ``max_tokens`` per line."""
    conversations: list[Conversation] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if limit is not None and len(conversations) >= limit:
            break
        try:
            conversations.append(_jsonl_conversation(json.loads(line), output_len))
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{path}:{number}: {error}") from None
    if not conversations:
        raise ValueError(f"{path}: no conversations")
    return Workload("jsonl", conversations, {"path": str(path), "output_len": output_len})


def _jsonl_conversation(row: Any, output_len: int) -> Conversation:
    if not isinstance(row, dict):
        raise ValueError("each line must be a JSON object")
    max_tokens = int(row.get("max_tokens", output_len))
    if "prompt" in row:
        return Conversation([], [str(row["prompt"])], max_tokens)
    if "messages" in row:
        messages = list(row["messages"])
        if not messages or messages[-1].get("role") != "user":
            raise ValueError("'messages' must end with a user message")
        return Conversation(messages[:-1], [str(messages[-1]["content"])], max_tokens)
    if "turns" in row:
        opening = [{"role": "system", "content": str(row["system"])}] if row.get("system") else []
        turns = [str(turn) for turn in row["turns"]]
        if not turns:
            raise ValueError("'turns' is empty")
        return Conversation(opening, turns, max_tokens, float(row.get("think_time_s", 0.0)))
    raise ValueError("expected a 'prompt', 'messages' or 'turns' key")


def build_workload(name: str, tokenizer: TextTokenizer, seed: int, options: dict[str, Any]) -> Workload:
    """The named workload from the benchmark's options (see :mod:`loadtests.options`)."""
    builders: dict[str, Callable[[TextSource], Workload]] = {
        "random": lambda source: random_workload(
            source,
            options["num_prompts"],
            options["input_len"],
            options["output_len"],
            options["range_ratio"],
        ),
        "shared-prefix": lambda source: shared_prefix_workload(
            source,
            options["num_prompts"],
            options["num_prefixes"],
            options["prefix_len"],
            options["input_len"],
            options["output_len"],
        ),
        "multi-turn": lambda source: multi_turn_workload(
            source,
            max(1, options["num_prompts"] // options["turns"]),
            options["turns"],
            options["num_documents"] or max(1, options["num_prompts"] // options["turns"] // 2),
            options["document_len"],
            options["input_len"],
            options["output_len"],
            options["think_time"],
        ),
    }
    if name == "jsonl":
        return jsonl_workload(options["dataset_path"], options["output_len"], options["num_prompts"])
    if name not in builders:
        raise ValueError(f"unknown dataset {name!r}")
    return builders[name](TextSource(tokenizer, random.Random(seed)))
