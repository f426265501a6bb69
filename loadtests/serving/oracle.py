"""The oracle cached-token ratio: what perfect affinity with unlimited cache would reach.

Requests are taken in the order they were sent. Each one could have been served from cache for the
longest run of whole blocks it shares with the token stream of any earlier request (its prompt
followed by its answer, since engines cache generated tokens too), never its last prompt token
(an engine computes at least one). The ratio is the sum of those tokens over all prompt tokens: a
routing policy can only approach it from below, up to the approximation noted in
:func:`token_stream`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvroute.protocol import block_hashes
from kvroute.text.tokenizer import TextTokenizer
from loadtests.serving.client import completion_prompt

ORACLE_SEED = 0  # any fixed chain root: only equality of prefixes matters here


@dataclass(frozen=True)
class OracleRequest:
    prompt_ids: Sequence[int]
    stream_ids: Sequence[int]  # prompt followed by the answer's tokens: what an engine caches


@dataclass(frozen=True)
class OracleResult:
    cached_tokens: int
    prompt_tokens: int

    @property
    def ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def token_stream(
    tokenizer: TextTokenizer, messages: list[dict[str, str]], answer: str, chat: bool
) -> OracleRequest:
    """The prompt's token ids as the server builds them, and the stream an engine would cache.

    The answer is re-tokenized from its text: where that differs from the ids the engine generated
    (rare, at most around the answer's first token), the oracle is off by a block or so.
    """
    if chat:
        prompt = tokenizer.encode_chat(messages)
    else:
        prompt = tokenizer.encode(completion_prompt(messages), add_special_tokens=True)
    return OracleRequest(prompt, [*prompt, *tokenizer.encode(answer, add_special_tokens=False)])


def oracle_cached_tokens(requests: Iterable[OracleRequest], block_size: int) -> OracleResult:
    seen: set[int] = set()
    cached = total = 0
    for request in requests:
        total += len(request.prompt_ids)
        cacheable = (len(request.prompt_ids) - 1) // block_size
        matched = 0
        for block_hash in block_hashes(request.prompt_ids, block_size, ORACLE_SEED)[:cacheable]:
            if block_hash not in seen:
                break
            matched += 1
        cached += matched * block_size
        seen.update(block_hashes(request.stream_ids, block_size, ORACLE_SEED))
    return OracleResult(cached, total)
