"""The gateway's tokenizers: fetched from the replicas, checked by fingerprint, cached with their output.

The gateway must produce exactly the token ids a replica will, or its block hashes (and so its
routing) are wrong. It therefore runs the same code (:class:`kvroute.tokenizer.TextTokenizer`) on the
same files, which it gets from a replica's ``GET /kvroute/tokenizer`` rather than from model files of
its own, and accepts them only when both the fingerprint the replica serves and the one recomputed
from the files equal the fingerprint the replicas registered. A local model directory may be
registered instead (:meth:`TokenizerRegistry.register_local`).

Tokenizing a long chat costs milliseconds, so results are kept in an LRU keyed by the tokenizer's
fingerprint and a hash of the exact inputs: a request repeated verbatim costs one hash and one dict
lookup. Inputs longer than a threshold are tokenized in a worker thread so the event loop never
stalls on them (``tokenizers`` releases the GIL while encoding).

Next step (not done): multi-turn chats resend the whole history with one more turn, so their full
inputs never repeat and this cache misses on every turn. When a template renders a message prefix
stably (the rendering of messages[:k] is a prefix of the rendering of messages[:k+1]), the ids of the
longest cached message prefix can be reused and only the new tail tokenized; that needs a per-template
stability check and care at the boundary token, where BPE may merge across the seam.

Never imports torch or anything from replica/ (the gateway must start fast and stay small).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvroute.tokenizer import TextTokenizer

log = logging.getLogger("kvroute.gateway")

TOKENIZER_PATH = "/kvroute/tokenizer"


class TokenizerError(Exception):
    """No usable tokenizer for a model."""


class TokenizerMismatch(TokenizerError):
    """A replica served (or a local directory holds) a tokenizer without the registered fingerprint."""


class TokenizerUnavailable(TokenizerError):
    """No replica answered with its tokenizer."""


def _build_checked(model: str, fingerprint: str, url: str, body: bytes) -> TextTokenizer:
    """Parse a replica's reply and rebuild its tokenizer, refusing any fingerprint but ``fingerprint``.

    Runs in a worker thread: tokenizer.json can be megabytes, and parsing it takes a while.
    """
    payload = json.loads(body)
    served = payload["fingerprint"]
    if payload["model"] != model:
        raise TokenizerMismatch(f"{url} serves model {payload['model']!r}, not {model!r}")
    if served != fingerprint:
        raise TokenizerMismatch(
            f"{url} serves tokenizer {served[:12]} for {model!r}, but {fingerprint[:12]} is registered"
        )
    tokenizer = TextTokenizer.from_files(
        payload["tokenizer_json"], payload["chat_template"], payload["tokenizer_config"]
    )
    if tokenizer.fingerprint != fingerprint:
        raise TokenizerMismatch(
            f"the files {url} serves for {model!r} hash to {tokenizer.fingerprint[:12]}, "
            f"not the fingerprint {fingerprint[:12]} it claims"
        )
    return tokenizer


class TokenizerRegistry:
    """One tokenizer per (model, fingerprint), and an LRU of the token ids it produced.

    ``http`` is the gateway's shared client (its timeouts apply to fetches). ``cache_entries``
    bounds the LRU of encoded inputs (stored as uint32 arrays, 4 bytes a token);
    ``thread_threshold_chars`` is the input size above which encoding leaves the event loop.
    """

    def __init__(
        self, http: httpx.AsyncClient, *, cache_entries: int = 4096, thread_threshold_chars: int = 8192
    ) -> None:
        self._http = http
        self._cache_entries = cache_entries
        self._thread_threshold = thread_threshold_chars
        self._tokenizers: dict[tuple[str, str], TextTokenizer] = {}
        self._local: dict[str, TextTokenizer] = {}
        self._fetches: dict[tuple[str, str], asyncio.Task[TextTokenizer]] = {}
        self._encoded: OrderedDict[tuple[str, bytes], array[int]] = OrderedDict()
        self.cache_hits = 0
        self.cache_misses = 0

    # -- tokenizers -------------------------------------------------------------------------------

    def register_local(self, model: str, path: str | Path) -> TextTokenizer:
        """Use the tokenizer in a local model directory for ``model`` instead of fetching one."""
        tokenizer = TextTokenizer.from_dir(path)
        self._local[model] = tokenizer
        self._tokenizers[(model, tokenizer.fingerprint)] = tokenizer
        return tokenizer

    def cached(self, model: str, fingerprint: str) -> TextTokenizer | None:
        """The tokenizer if already loaded (the hot path's no-await check)."""
        return self._tokenizers.get((model, fingerprint))

    async def get(self, model: str, fingerprint: str, replica_urls: Sequence[str]) -> TextTokenizer:
        """The tokenizer ``model``'s replicas registered as ``fingerprint``.

        Fetched once from the first of ``replica_urls`` that serves a matching one; concurrent
        callers share that fetch, and a failed fetch is retried by the next call. Raises
        :class:`TokenizerMismatch` if a replica served a different tokenizer (or a local directory
        is registered for ``model`` with another fingerprint), else :class:`TokenizerUnavailable`.
        """
        key = (model, fingerprint)
        if (tokenizer := self._tokenizers.get(key)) is not None:
            return tokenizer
        if (local := self._local.get(model)) is not None:
            raise TokenizerMismatch(
                f"the local tokenizer for {model!r} is {local.fingerprint[:12]}, "
                f"but a replica registered {fingerprint[:12]}"
            )
        task = self._fetches.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch(model, fingerprint, list(replica_urls)))
            self._fetches[key] = task
            task.add_done_callback(lambda done: self._fetch_done(key, done))
        # shield: one caller giving up must not cancel the fetch the others wait on
        return await asyncio.shield(task)

    def _fetch_done(self, key: tuple[str, str], task: asyncio.Task[TextTokenizer]) -> None:
        self._fetches.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: its callers may all have given up

    async def _fetch(self, model: str, fingerprint: str, urls: list[str]) -> TextTokenizer:
        errors: list[str] = []
        mismatch = False
        for url in urls:
            try:
                response = await self._http.get(url.rstrip("/") + TOKENIZER_PATH)
                response.raise_for_status()
                tokenizer = await asyncio.to_thread(_build_checked, model, fingerprint, url, response.content)
            except TokenizerMismatch as error:
                mismatch = True
                errors.append(str(error))
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
                errors.append(f"{url}: {type(error).__name__}: {error}")
            else:
                self._tokenizers[(model, fingerprint)] = tokenizer
                return tokenizer
            log.warning("tokenizer for %s not taken from %s: %s", model, url, errors[-1])
        kind = TokenizerMismatch if mismatch else TokenizerUnavailable
        tried = "; ".join(errors) or "no replica URLs given"
        raise kind(f"no usable tokenizer {fingerprint[:12]} for {model!r}: {tried}")

    # -- encoding ---------------------------------------------------------------------------------

    async def encode_chat(
        self,
        tokenizer: TextTokenizer,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
    ) -> list[int]:
        """A chat prompt's ids, as the replica computes them (``ChatCompletionRequest.template_inputs()``
        in, generation prompt on). Raises ValueError as the replica does (e.g. no chat template)."""
        # Key order is kept, not sorted: a template may iterate a dict, so order can change the text.
        inputs = json.dumps([messages, tools, template_kwargs], ensure_ascii=False, separators=(",", ":"))

        def encode() -> list[int]:
            return tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=True, **template_kwargs)

        return await self._encode(tokenizer, b"c", inputs, encode)

    async def encode_prompt(self, tokenizer: TextTokenizer, text: str) -> list[int]:
        """A completions prompt's ids, as the replica computes them (special tokens added)."""
        return await self._encode(tokenizer, b"p", text, lambda: tokenizer.encode(text))

    async def _encode(
        self, tokenizer: TextTokenizer, kind: bytes, inputs: str, encode: Callable[[], list[int]]
    ) -> list[int]:
        digest = hashlib.blake2b(kind + inputs.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        key = (tokenizer.fingerprint, digest)
        if (ids := self._encoded.get(key)) is not None:
            self._encoded.move_to_end(key)
            self.cache_hits += 1
            return ids.tolist()
        self.cache_misses += 1
        if len(inputs) > self._thread_threshold:
            result = await asyncio.to_thread(encode)
        else:
            result = encode()
        self._encoded[key] = array("I", result)
        if len(self._encoded) > self._cache_entries:
            self._encoded.popitem(last=False)
        return result
