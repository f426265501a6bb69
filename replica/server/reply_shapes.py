"""The JSON an OpenAI reply takes, per endpoint: chat completions and legacy completions, whole or
as SSE chunks. Only the per-choice JSON differs between the two; the rest is shared.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvroute.text.tokenizer import TextTokenizer
from replica.engine.outputs import ChoiceDelta, TokenLogprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports impossible tokens with this value


@dataclass
class WholeChoice:
    """A choice's output so far, for a non-streaming reply."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text.append(delta.text)
        self.logprobs.extend(delta.logprobs or ())
        self.finish_reason = delta.finish_reason or self.finish_reason


class ReplyShape(ABC):
    """The JSON one API request answers with; a fresh instance per request (it numbers the reply)."""

    object: ClassVar[str]
    chunk_object: ClassVar[str]
    id_prefix: ClassVar[str]
    prompt_noun: ClassVar[str]  # what OpenAI's context-length message calls the prompt

    def __init__(
        self,
        tokenizer: TextTokenizer,
        model: str,
        include_usage: bool,
        with_logprobs: bool,
        continuous_usage: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.with_logprobs = with_logprobs
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, choices: list[WholeChoice], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [self.final_choice(i, choice) for i, choice in enumerate(choices)],
            "usage": usage,
            "system_fingerprint": None,
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """One SSE chunk; with include_usage every chunk has ``usage`` (null but in the last, unless
        ``stream_options.continuous_usage_stats`` asks for it in every one)."""
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return body

    def opening_choice(self, index: int) -> dict[str, Any] | None:
        """What opens choice ``index``, sent with its first output token (None: nothing)."""
        return None

    def stream_choice(self, index: int, delta: ChoiceDelta) -> dict[str, Any] | None:
        """The chunk choice for one delta; None when it carries nothing (text held back for a stop)."""
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return None
        logprobs = self.logprobs(index, delta.logprobs or []) if self.with_logprobs else None
        return self.choice(index, delta.text, logprobs, delta.finish_reason, stream=True)

    def final_choice(self, index: int, choice: WholeChoice) -> dict[str, Any]:
        logprobs = self.logprobs(index, choice.logprobs) if self.with_logprobs else None
        return self.choice(index, "".join(choice.text), logprobs, choice.finish_reason, stream=False)

    @abstractmethod
    def choice(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None, *, stream: bool
    ) -> dict[str, Any]:
        """One choice: a chunk's (``stream``) or the whole reply's."""

    @abstractmethod
    def logprobs(self, index: int, entries: list[TokenLogprob]) -> dict[str, Any]:
        """Choice ``index``'s logprobs for ``entries``, its next tokens."""

    def token(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and bytes for logprobs (bytes may be part of one character)."""
        try:
            raw = self.tokenizer.token_bytes(token_id)
        except ValueError:  # an id of the model's padded vocabulary that the tokenizer lacks
            raw = b""
        return raw.decode("utf-8", errors="replace"), raw


def _finite(logprob: float) -> float:
    return logprob if logprob > _MIN_LOGPROB else _MIN_LOGPROB


class ChatShape(ReplyShape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_noun = "messages"

    def opening_choice(self, index: int) -> dict[str, Any] | None:
        """The role and empty content, as OpenAI and vLLM open a choice: with its first token, so a
        client timing the first chunk with choices measures the real time to first token."""
        delta = {"role": "assistant", "content": ""}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def choice(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None, *, stream: bool
    ) -> dict[str, Any]:
        if stream:
            body: dict[str, Any] = {"index": index, "delta": {"content": text} if text else {}}
        else:
            body = {"index": index, "message": {"role": "assistant", "content": text, "refusal": None}}
        body.update(logprobs=logprobs, finish_reason=finish_reason)
        return body

    def logprobs(self, index: int, entries: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for entry in entries:
            top = [self._entry(token_id, logprob) for token_id, logprob in entry.top]
            content.append({**self._entry(entry.token_id, entry.logprob), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.token(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}


class CompletionShape(ReplyShape):
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"
    prompt_noun = "prompt"

    def __init__(
        self,
        tokenizer: TextTokenizer,
        model: str,
        include_usage: bool,
        with_logprobs: bool,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(tokenizer, model, include_usage, with_logprobs, continuous_usage)
        self._text_offsets: dict[int, int] = {}  # per choice: characters of token text reported so far

    def choice(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None, *, stream: bool
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, index: int, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The legacy format; ``top_logprobs`` holds the alternatives plus the chosen token, as in vLLM."""
        offset = self._text_offsets.get(index, 0)
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for entry in entries:
            text = self.token(entry.token_id)[0]
            top = {self.token(token_id)[0]: _finite(logprob) for token_id, logprob in entry.top}
            top[text] = _finite(entry.logprob)  # the chosen token wins a clash of equal strings
            tokens.append(text)
            token_logprobs.append(_finite(entry.logprob))
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
