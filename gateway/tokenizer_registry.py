"""The gateway's tokenizers: fetched from the replicas, checked by fingerprint, cached with their output.

The gateway must produce exactly the token ids a replica will, or its block hashes (and so its
routing) are wrong. It therefore runs the same code (:class:`kvroute.text.tokenizer.TextTokenizer`) on the
same files, which it gets from a replica's ``GET /kvroute/tokenizer`` rather than from model files of
its own, and accepts them only when both the fingerprint the replica serves and the one recomputed
from the files equal the fingerprint the replicas registered. A local model directory may be
registered instead (:meth:`TokenizerRegistry.register_local`).

The token ids it produces are cached (:class:`kvroute.text.prompt_ids.PromptEncoder`, shared with
the replicas): a repeated request costs a hash and a lookup, a chat's next turn tokenizes only its
new messages.

Never imports torch or anything from replica/ (the gateway must start fast and stay small).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvroute.text.prompt_ids import PromptEncoder
from kvroute.text.tokenizer import TextTokenizer

log = logging.getLogger("kvroute.gateway")

TOKENIZER_PATH = "/kvroute/tokenizer"


class TokenizerError(Exception):
    """No usable tokenizer for a model."""


class TokenizerMismatch(TokenizerError):
    """A replica served (or a local directory holds) a tokenizer without the registered fingerprint."""


class TokenizerUnavailable(TokenizerError):
    """No replica answered with its tokenizer."""


def _build_checked(model: str, fingerprint: str, url: str, body: bytes) -> tuple[TextTokenizer, int | None]:
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
    window = payload.get("max_model_len")
    return tokenizer, window if isinstance(window, int) and window > 0 else None


class TokenizerRegistry(PromptEncoder):
    """One tokenizer per (model, fingerprint), and (as a :class:`PromptEncoder`) an LRU of the
    token ids they produced. ``http`` is the gateway's shared client (its timeouts apply to
    fetches); the other settings are the encoder's."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        cache_bytes: int = 256 * 1024 * 1024,
        thread_threshold_chars: int = 8192,
    ) -> None:
        super().__init__(cache_bytes=cache_bytes, thread_threshold_chars=thread_threshold_chars)
        self._http = http
        self._tokenizers: dict[tuple[str, str], TextTokenizer] = {}
        self._local: dict[str, TextTokenizer] = {}
        self._fetches: dict[tuple[str, str], asyncio.Task[TextTokenizer]] = {}
        self._windows: dict[tuple[str, str], int | None] = {}

    # -- tokenizers -------------------------------------------------------------------------------

    def register_local(self, model: str, path: str | Path) -> TextTokenizer:
        """Use the tokenizer in a local model directory for ``model`` instead of fetching one."""
        tokenizer = TextTokenizer.from_dir(path)
        self._local[model] = tokenizer
        self._tokenizers[(model, tokenizer.fingerprint)] = tokenizer
        return tokenizer

    def window(self, model: str, fingerprint: str) -> int | None:
        """The model's context window, as the replicas whose tokenizer this is serve it (None:
        not known, e.g. a local tokenizer)."""
        return self._windows.get((model, fingerprint))

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
                built = await asyncio.to_thread(_build_checked, model, fingerprint, url, response.content)
            except TokenizerMismatch as error:
                mismatch = True
                errors.append(str(error))
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
                errors.append(f"{url}: {type(error).__name__}: {error}")
            else:
                tokenizer, self._windows[(model, fingerprint)] = built
                self._tokenizers[(model, fingerprint)] = tokenizer
                return tokenizer
            log.warning("tokenizer for %s not taken from %s: %s", model, url, errors[-1])
        kind = TokenizerMismatch if mismatch else TokenizerUnavailable
        tried = "; ".join(errors) or "no replica URLs given"
        raise kind(f"no usable tokenizer {fingerprint[:12]} for {model!r}: {tried}")
