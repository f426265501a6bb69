"""Token ids of chat and completions prompts, cached so repeated and multi-turn chats are cheap.

Gateway and replica share this code: both must produce exactly the ids the replica computes, and
both see every turn of a chat resend its whole history. Tokenizing costs about 1 ms per 1,000
tokens here, so the ids are cached, in one LRU bounded in bytes, under two kinds of key:

* **The whole input** (messages, tools and template arguments, or a completions prompt): a request
  repeated verbatim costs one hash and one dict lookup.
* **The rendered chat up to each boundary token** (:meth:`TextTokenizer.boundaries`: the special
  tokens the tokenizer cuts text at before anything else, so the ids of the text before one do not
  depend on what follows it). Turn N+1 renders turn N's history again, so the longest key of its
  rendering that is cached gives its ids up to that boundary, and only the rest is tokenized. No
  template is trusted to render history stably: a key is a 128-bit hash of the exact text before
  the boundary, and the token at the boundary must be the same, so where a template renders the
  history differently (Qwen3 drops past reasoning, for one) the match simply ends earlier. Keys
  move to the newest rendering that holds them, and a rendering left without any is dropped, so a
  conversation holds one copy of its ids, not one per turn.

The part left to tokenize is encoded in a worker thread when it is longer than a threshold, so the
event loop never stalls on it (``tokenizers`` releases the GIL while encoding).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import xxhash

from kvroute.protocol import block_hashes
from kvroute.text.tokenizer import TextTokenizer

T = TypeVar("T")

# Estimated bytes a cached prompt costs beyond its ids (4 bytes a token): each key that finds it (a
# dict slot, the key, a tuple) and the record itself. tests/stack/test_gateway_tokenizers.py checks the
# total against tracemalloc.
_KEY_BYTES = 200
_RECORD_BYTES = 400


class PromptIds:
    """A prompt's token ids (uint32) and its block hashes, computed once per (block size, seed).

    ``base``: an earlier prompt and how many leading ids this one shares with it; the hashes of the
    whole blocks among those are taken from it instead of being computed again.
    """

    __slots__ = ("_base", "_hashes", "ids")

    def __init__(self, ids: array[int], base: tuple[PromptIds, int] | None = None) -> None:
        self.ids = ids
        self._base = base
        self._hashes: tuple[int, int, list[int]] | None = None

    @classmethod
    def of(cls, ids: Sequence[int]) -> PromptIds:
        """A prompt given as token ids (OverflowError for an id that is not a uint32)."""
        return cls(array("I", ids))

    def __len__(self) -> int:
        return len(self.ids)

    def digest(self, length: int) -> int:
        """A 64-bit hash of the first ``length`` ids: whether a later prompt starts with this one
        (a chat's next turn holds its previous prompt whole) is one hash of its first ids."""
        return xxhash.xxh3_64_intdigest(memoryview(self.ids)[:length])

    def block_hashes(self, block_size: int, seed: int) -> list[int]:
        """``kvroute.protocol.block_hashes`` of the ids, memoized: the list is shared, do not modify it."""
        memo = self._hashes
        if memo is not None and memo[0] == block_size and memo[1] == seed:
            return memo[2]
        reused: list[int] = []
        if self._base is not None:
            base, shared = self._base
            known = base._hashes
            if known is not None and known[0] == block_size and known[1] == seed:
                reused = known[2][: shared // block_size]
            self._base = None  # used once; do not keep the earlier prompt alive
        start = len(reused) * block_size
        hashes = reused + block_hashes(self.ids[start:], block_size, reused[-1] if reused else seed)
        self._hashes = (block_size, seed, hashes)
        return hashes


class _Record:
    """A cached prompt, the keys that led to it, and how many of its boundary keys still do."""

    __slots__ = ("keys", "live", "prompt", "size")

    def __init__(self, prompt: PromptIds) -> None:
        self.prompt = prompt
        self.keys: list[int] = []
        self.live = 0
        self.size = _RECORD_BYTES + 4 * len(prompt)


class _PromptCache:
    """Prompts in LRU order, bounded by their estimated bytes, found by key.

    A key (a 128-bit hash) maps to ``(record, index)``: a whole input's to the whole prompt (index
    -1), a boundary's to the ids before the boundary token at ``index``. A boundary key added for
    a new prompt moves there from the one that held it; a prompt left with none of its boundary
    keys is dropped at once (the newer one holds its ids).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._keys: dict[int, tuple[_Record, int]] = {}
        self._records: OrderedDict[_Record, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def peek(self, key: int) -> tuple[_Record, int] | None:
        return self._keys.get(key)

    def get(self, key: int) -> tuple[_Record, int] | None:
        """Like :meth:`peek`, and the record becomes the most recently used."""
        found = self._keys.get(key)
        if found is not None:
            self._records.move_to_end(found[0])
        return found

    def add(self, prompt: PromptIds, whole_key: int, boundary_keys: Sequence[tuple[int, int]]) -> None:
        record = _Record(prompt)
        if record.size + _KEY_BYTES * (1 + len(boundary_keys)) > self.max_bytes:
            return  # larger than the whole cache
        self._records[record] = None
        self._attach(record, whole_key, -1)
        for key, index in boundary_keys:
            self._attach(record, key, index)
        record.live = len(boundary_keys)
        self.bytes += record.size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._records)))

    def _attach(self, record: _Record, key: int, index: int) -> None:
        previous = self._keys.get(key)
        self._keys[key] = (record, index)
        record.keys.append(key)
        record.size += _KEY_BYTES
        if previous is not None and index >= 0 and previous[0] is not record:
            holder = previous[0]
            holder.live -= 1
            if holder.live == 0:
                self._drop(holder)

    def _drop(self, record: _Record) -> None:
        del self._records[record]
        self.bytes -= record.size
        for key in record.keys:
            found = self._keys.get(key)
            if found is not None and found[0] is record:
                del self._keys[key]


class PromptEncoder:
    """Encodes prompts with any :class:`TextTokenizer`, keeping an LRU of the ids it produced.

    ``cache_bytes`` bounds the LRU (ids at 4 bytes a token, plus an estimate per key);
    ``thread_threshold_chars`` is the size of text to encode above which encoding leaves the event
    loop. Counters: ``cache_hits`` (whole inputs found), ``cache_misses``, and ``prefix_hits``
    (misses whose rendering began with a cached one: only the rest was tokenized).
    """

    def __init__(self, *, cache_bytes: int, thread_threshold_chars: int = 8192) -> None:
        self._thread_threshold = thread_threshold_chars
        self._cache = _PromptCache(cache_bytes)
        self._secret = secrets.randbits(64)
        self._seeds: dict[str, int] = {}
        self.cache_hits = 0
        self.cache_misses = 0
        self.prefix_hits = 0

    @property
    def cache_bytes(self) -> int:
        """Estimated bytes the cached prompts hold."""
        return self._cache.bytes

    @property
    def cache_entries(self) -> int:
        """Prompts cached."""
        return len(self._cache)

    async def encode_chat(
        self,
        tokenizer: TextTokenizer,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
    ) -> PromptIds:
        """A chat prompt's ids, as the replica computes them (``ChatCompletionRequest.template_inputs()``
        in, generation prompt on). Raises ValueError as the replica does (e.g. no chat template)."""
        # Key order is kept, not sorted: a template may iterate a dict, so order can change the text.
        inputs = json.dumps([messages, tools, template_kwargs], ensure_ascii=False, separators=(",", ":"))
        key = self._input_key(tokenizer, b"c", inputs)
        if (prompt := self._cached(key)) is not None:
            return prompt
        text = tokenizer.render_chat(messages, tools, add_generation_prompt=True, **template_kwargs)
        return await self._encode_rendered(tokenizer, text, key)

    async def encode_prompt(self, tokenizer: TextTokenizer, text: str) -> PromptIds:
        """A completions prompt's ids, as the replica computes them (special tokens added)."""
        key = self._input_key(tokenizer, b"p", text)
        if (prompt := self._cached(key)) is not None:
            return prompt
        prompt = PromptIds(await self._off_loop_if_long(len(text), _encode, tokenizer, text))
        self._cache.add(prompt, key, ())
        return prompt

    async def _encode_rendered(self, tokenizer: TextTokenizer, text: str, whole_key: int) -> PromptIds:
        """``text``'s ids: a cached prompt's up to the last boundary cached, the rest encoded now."""
        candidates = tokenizer.boundaries(text)
        if candidates and candidates[0][0] == 0:
            candidates = candidates[1:]  # nothing before it to reuse
        keys = self._boundary_keys(tokenizer, text, candidates)
        reuse = self._longest_cached(keys, candidates)
        if reuse is not None:
            position, base, shared, earlier = reuse
            offset = candidates[position][0]
            tail = [(start - offset, token_id) for start, token_id in candidates[position:]]
            ids, indices = await self._off_loop_if_long(
                len(text) - offset, _encode_with_boundaries, tokenizer, text[offset:], tail
            )
            if indices[0] == 0:  # cut at the same token again, as it must be
                self.prefix_hits += 1
                prompt = PromptIds(base.ids[:shared] + ids, (base, shared))
                self._cache.add(prompt, whole_key, earlier + _cut(keys[position:], indices, shared))
                return prompt
        ids, indices = await self._off_loop_if_long(
            len(text), _encode_with_boundaries, tokenizer, text, candidates
        )
        prompt = PromptIds(ids)
        self._cache.add(prompt, whole_key, _cut(keys, indices, 0))
        return prompt

    def _cached(self, key: int) -> PromptIds | None:
        found = self._cache.get(key)
        if found is None:
            self.cache_misses += 1
            return None
        self.cache_hits += 1
        return found[0].prompt

    def _input_key(self, tokenizer: TextTokenizer, kind: bytes, inputs: str) -> int:
        return xxhash.xxh3_128_intdigest(
            kind + inputs.encode("utf-8", "surrogatepass"), self._seed(tokenizer)
        )

    def _boundary_keys(
        self, tokenizer: TextTokenizer, text: str, candidates: Sequence[tuple[int, int]]
    ) -> list[int]:
        """For each candidate boundary, a 128-bit hash of ``text`` before it (one pass over the text)."""
        hasher = xxhash.xxh3_128(seed=self._seed(tokenizer))
        keys = []
        start = 0
        for offset, _ in candidates:
            hasher.update(text[start:offset].encode("utf-8", "surrogatepass"))
            keys.append(hasher.intdigest())
            start = offset
        return keys

    def _seed(self, tokenizer: TextTokenizer) -> int:
        """The keys' hash seed: secret (nobody outside can aim for a collision), one per tokenizer."""
        seed = self._seeds.get(tokenizer.fingerprint)
        if seed is None:
            seed = xxhash.xxh3_64_intdigest(tokenizer.fingerprint.encode(), seed=self._secret)
            self._seeds[tokenizer.fingerprint] = seed
        return seed

    def _longest_cached(
        self, keys: Sequence[int], candidates: Sequence[tuple[int, int]]
    ) -> tuple[int, PromptIds, int, list[tuple[int, int]]] | None:
        """The last candidate whose key is cached with the same token at the boundary: its position,
        the cached prompt and how many of its ids precede the boundary, and the candidates before it
        that are cached too (with their indices, valid in any prompt with this text before them)."""
        for position in range(len(keys) - 1, -1, -1):
            found = self._cache.get(keys[position])
            if found is not None and _is_boundary(found, candidates[position][1]):
                earlier = [
                    (key, held[1])
                    for key, (_, token_id) in zip(keys[:position], candidates, strict=False)
                    if (held := self._cache.peek(key)) is not None and _is_boundary(held, token_id)
                ]
                return position, found[0].prompt, found[1], earlier
        return None

    async def _off_loop_if_long(self, chars: int, function: Callable[..., T], *args: Any) -> T:
        if chars > self._thread_threshold:
            return await asyncio.to_thread(function, *args)
        return function(*args)


def _encode(tokenizer: TextTokenizer, text: str) -> array[int]:
    """``text``'s ids as the array a prompt keeps: made, and the list freed, where the encoding ran
    (off the event loop for a long text)."""
    return array("I", tokenizer.encode(text))


def _encode_with_boundaries(
    tokenizer: TextTokenizer, text: str, candidates: Sequence[tuple[int, int]]
) -> tuple[array[int], list[int]]:
    """:meth:`TextTokenizer.encode_with_boundaries`, its ids as an array (as :func:`_encode`)."""
    ids, indices = tokenizer.encode_with_boundaries(text, candidates)
    return array("I", ids), indices


def _cut(keys: Sequence[int], indices: Sequence[int], shift: int) -> list[tuple[int, int]]:
    """``(key, index + shift)`` for each candidate boundary the tokenizer cut at (``index >= 0``)."""
    return [(key, index + shift) for key, index in zip(keys, indices, strict=True) if index >= 0]


def _is_boundary(entry: tuple[_Record, int], token_id: int) -> bool:
    """Whether a cache entry gives the ids before a boundary, and that boundary is ``token_id``."""
    record, index = entry
    return index >= 0 and record.prompt.ids[index] == token_id
