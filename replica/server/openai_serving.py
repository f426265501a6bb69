"""OpenAI chat and completions on top of ``AsyncEngine``: prompts, limits, JSON and SSE replies.

Both endpoints run one pipeline: prompts -> one engine request per prompt (each with ``n``
choices) -> merged choice deltas -> one JSON body, or SSE chunks ending in ``data: [DONE]``.
Only the per-choice JSON differs, and that lives in :class:`_ChatShape` / :class:`_CompletionShape`.

A request whose client goes away is cancelled, and cancelling closes the engine generators, which
aborts the engine requests and frees their KV pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvroute.http import CLIENT_CLOSED_REQUEST, unless_client_leaves
from kvroute.openai_api.errors import APIError, internal_error
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest, Prompt
from kvroute.protocol import GATEWAY_ID_HEADER, is_gateway_id
from kvroute.text.prompt_ids import PromptEncoder
from kvroute.text.tokenizer import TextTokenizer
from replica.engine.async_engine import AsyncEngine, EngineDeadError
from replica.engine.outputs import ChoiceDelta, RequestOutput, TokenLogprob
from replica.engine.sampling_params import SamplingParams
from replica.server.metrics import ReplicaMetrics, RequestTracker

log = logging.getLogger("kvroute.replica")

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports impossible tokens with this value
_DONE = "data: [DONE]\n\n"


# --- engine side: one API request = several engine requests ------------------------------------


@dataclass
class _Job:
    """One engine request: a prompt with its ``n`` choices, numbered from ``first_choice``."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_choice: int
    tracker: RequestTracker
    last: RequestOutput | None = None


class _Generation:
    """The engine requests behind one API request, merged into one stream of choice deltas."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ReplicaMetrics,
        base_id: str,
        specs: list[tuple[list[int], SamplingParams]],
        source: str | None = None,
    ) -> None:
        self._engine = engine
        self._source = source
        self.jobs: list[_Job] = []
        self.num_choices = 0
        for i, (prompt_ids, params) in enumerate(specs):
            self.jobs.append(_Job(f"{base_id}-{i}", prompt_ids, params, self.num_choices, metrics.track()))
            self.num_choices += params.n

    async def deltas(self) -> AsyncGenerator[tuple[int, ChoiceDelta], None]:
        """``(choice index, delta)`` as the engine produces them.

        One task per engine request feeds a queue. Closing this generator (or cancelling its
        consumer) cancels those tasks, which closes their engine generators, which abort. All of
        it is synchronous, so it still happens inside an already-cancelled scope.
        """
        queue: asyncio.Queue[tuple[_Job, RequestOutput] | _Job | Exception] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(job, queue)) for job in self.jobs]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, _Job):
                    running -= 1
                    continue
                job, output = item
                job.last = output
                job.tracker.observe(output)
                for delta in output.deltas:
                    yield job.first_choice + delta.index, delta
        finally:
            for task in tasks:
                task.cancel()
            for job in self.jobs:
                job.tracker.close(job.params.n)

    async def _pump(self, job: _Job, queue: asyncio.Queue[Any]) -> None:
        try:
            generation = self._engine.generate(job.request_id, job.prompt_ids, job.params, self._source)
            async for output in generation:
                queue.put_nowait((job, output))
        except Exception as error:
            queue.put_nowait(error)
        else:
            queue.put_nowait(job)

    def usage(self) -> dict[str, Any]:
        """OpenAI usage; ``cached_tokens`` is what the radix cache really served."""
        prompt = sum(len(job.prompt_ids) for job in self.jobs)
        completion = sum(job.last.completion_tokens for job in self.jobs if job.last is not None)
        cached = sum(job.last.cached_tokens for job in self.jobs if job.last is not None)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def _as_api_error(error: Exception) -> APIError:
    """What a client sees for a failure during generation."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError("The engine is not running; retry on another replica.", 503)
    if isinstance(error, ValueError):  # the engine's own request checks
        return APIError(str(error), 400)
    log.error("generation failed", exc_info=error)
    return internal_error("The engine failed while generating this request.")


# --- response shapes -----------------------------------------------------------------------------


@dataclass
class _Choice:
    """A choice's output so far, for a non-streaming reply."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text.append(delta.text)
        self.logprobs.extend(delta.logprobs or ())
        self.finish_reason = delta.finish_reason or self.finish_reason


class _Shape(ABC):
    """The JSON one API request answers with; a fresh instance per request (it numbers the reply)."""

    object: ClassVar[str]
    chunk_object: ClassVar[str]
    id_prefix: ClassVar[str]
    prompt_noun: ClassVar[str]  # what OpenAI's context-length message calls the prompt

    def __init__(
        self, tokenizer: TextTokenizer, model: str, include_usage: bool, with_logprobs: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.include_usage = include_usage
        self.with_logprobs = with_logprobs
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, choices: list[_Choice], usage: dict[str, Any]) -> dict[str, Any]:
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
        """One SSE chunk; with include_usage every chunk has ``usage`` (null but in the last)."""
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

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        """Choices sent before any output."""
        return []

    def stream_choice(self, index: int, delta: ChoiceDelta) -> dict[str, Any] | None:
        """The chunk choice for one delta; None when it carries nothing (text held back for a stop)."""
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return None
        logprobs = self.logprobs(index, delta.logprobs or []) if self.with_logprobs else None
        return self.choice(index, delta.text, logprobs, delta.finish_reason, stream=True)

    def final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
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


class _ChatShape(_Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_noun = "messages"

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        """OpenAI opens every choice with the role and empty content."""
        delta = {"role": "assistant", "content": ""}
        return [
            {"index": i, "delta": delta, "logprobs": None, "finish_reason": None} for i in range(num_choices)
        ]

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


class _CompletionShape(_Shape):
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"
    prompt_noun = "prompt"

    def __init__(
        self, tokenizer: TextTokenizer, model: str, include_usage: bool, with_logprobs: bool
    ) -> None:
        super().__init__(tokenizer, model, include_usage, with_logprobs)
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


# --- replies -----------------------------------------------------------------------------------


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse_events(shape: _Shape, generation: _Generation) -> AsyncGenerator[str, None]:
    """The whole SSE stream; a failure becomes an error event, and ``[DONE]`` always ends it."""
    try:
        for choice in shape.opening_choices(generation.num_choices):
            yield _sse(shape.chunk([choice]))
        async with aclosing(generation.deltas()) as deltas:
            async for index, delta in deltas:
                choice = shape.stream_choice(index, delta)
                if choice is not None:
                    yield _sse(shape.chunk([choice]))
        if shape.include_usage:  # sent with [DONE]: nothing comes between them
            yield _sse(shape.chunk([], usage=generation.usage())) + _DONE
            return
    except Exception as error:
        yield _sse(_as_api_error(error).to_dict()) + _DONE
        return
    yield _DONE


class _EventStream(StreamingResponse):
    """The SSE reply: each string the generator yields goes out as one body message.

    A client that hangs up cancels the stream at once (not at the next event), and the generator
    is closed however the response ends, which aborts its engine requests. Starlette's own
    ``__call__`` watches the client through an anyio task group, about a third of a short stream's
    CPU here; this one shares the non-streaming path's single watcher.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_client_leaves(receive, self._send_events(send))
        except OSError:
            pass  # the client left while we sent (ASGI servers of spec 2.4 and later say so)
        finally:
            await self._events.aclose()

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self._events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})


async def _collect(shape: _Shape, generation: _Generation) -> Response:
    choices = [_Choice() for _ in range(generation.num_choices)]
    try:
        async with aclosing(generation.deltas()) as deltas:
            async for index, delta in deltas:
                choices[index].add(delta)
    except Exception as error:
        return _as_api_error(error).to_response()
    return JSONResponse(shape.response(choices, generation.usage()))


# --- the handlers --------------------------------------------------------------------------------


PROMPT_CACHE_BYTES = 64 * 1024 * 1024
"""Token ids kept for repeated and multi-turn prompts (a chat's next turn tokenizes only its new
messages: ~0.3 ms instead of ~2 ms for a 4,000-token history)."""


def request_source(request: Request) -> str | None:
    """The gateway that sent the request (its ``x-kvroute-gateway`` header), if it is a valid id:
    the heartbeat reports each gateway's share of the load, so ids are short and plain."""
    source = request.headers.get(GATEWAY_ID_HEADER)
    return source if source is not None and is_gateway_id(source) else None


class OpenAIServing:
    """Turns validated requests into engine requests and OpenAI replies."""

    def __init__(self, engine: AsyncEngine, metrics: ReplicaMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.prompts = PromptEncoder(cache_bytes=PROMPT_CACHE_BYTES)

    async def chat(self, request: ChatCompletionRequest, raw: Request) -> Response:
        messages, tools, template_kwargs = request.template_inputs()
        try:
            encoded = await self.prompts.encode_chat(self.engine.tokenizer, messages, tools, template_kwargs)
        except ValueError as error:
            raise APIError(f"Invalid 'messages': {error}", param="messages", code="invalid_value") from None
        prompt = encoded.ids.tolist()
        shape = _ChatShape(
            self.engine.tokenizer, request.model, request.include_usage, with_logprobs=request.logprobs
        )
        spec = self._spec(shape, request, prompt, request.requested_max_tokens, request.num_logprobs)
        return await self._serve(shape, request.stream, [spec], raw)

    async def completions(self, request: CompletionRequest, raw: Request) -> Response:
        shape = _CompletionShape(
            self.engine.tokenizer,
            request.model,
            request.include_usage,
            with_logprobs=request.logprobs is not None,
        )
        specs = [
            self._spec(shape, request, await self._prompt_ids(prompt), request.max_tokens, request.logprobs)
            for prompt in request.prompt
        ]
        return await self._serve(shape, request.stream, specs, raw)

    async def _serve(
        self, shape: _Shape, stream: bool, specs: list[tuple[list[int], SamplingParams]], raw: Request
    ) -> Response:
        generation = _Generation(self.engine, self.metrics, shape.id, specs, request_source(raw))
        if stream:
            return _EventStream(_sse_events(shape, generation))
        response = await unless_client_leaves(raw.receive, _collect(shape, generation))
        return response or Response(status_code=CLIENT_CLOSED_REQUEST)

    async def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return (await self.prompts.encode_prompt(self.engine.tokenizer, prompt)).ids.tolist()
        self._check_vocab(prompt, "prompt")
        return prompt

    def _check_vocab(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.engine.tokenizer.vocab_size
        if token_ids and max(token_ids) >= vocab_size:
            raise APIError(
                f"Invalid '{param}': token id {max(token_ids)} is out of vocabulary (size {vocab_size}).",
                param=param,
                code="invalid_value",
            )

    def _spec(
        self,
        shape: _Shape,
        request: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
    ) -> tuple[list[int], SamplingParams]:
        """One engine request's prompt and sampling parameters, within the context window."""
        if not prompt_ids:
            raise APIError(f"Invalid '{shape.prompt_noun}': the prompt is empty.", param=shape.prompt_noun)
        self._check_vocab(request.stop_token_ids, "stop_token_ids")
        defaults = self.engine.generation_defaults
        top_k = request.top_k if request.top_k is not None else defaults.get("top_k", 0)
        params = SamplingParams(
            max_tokens=self._fit_context(len(prompt_ids), max_tokens, shape.prompt_noun),
            temperature=request.temperature
            if request.temperature is not None
            else defaults.get("temperature", 1.0),
            top_p=request.top_p if request.top_p is not None else defaults.get("top_p", 1.0),
            top_k=max(top_k, 0),
            seed=request.seed,
            n=request.n,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
        )
        return prompt_ids, params

    def _fit_context(self, prompt_tokens: int, max_tokens: int | None, noun: str) -> int:
        """``max_tokens`` checked against the window (OpenAI's wording); absent, whatever is left."""
        limit = self.engine.max_model_len
        if max_tokens is None and prompt_tokens < limit:
            return limit - prompt_tokens
        if max_tokens is None:
            message = (
                f"This model's maximum context length is {limit} tokens. However, your {noun} resulted in "
                f"{prompt_tokens} tokens. Please reduce the length of the {noun}."
            )
        elif prompt_tokens + max_tokens > limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {noun}, {max_tokens} in the "
                f"completion). Please reduce the length of the {noun} or completion."
            )
        else:
            return max_tokens
        raise APIError(message, param=noun, code="context_length_exceeded")
