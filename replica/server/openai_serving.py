"""OpenAI chat and completions on top of ``AsyncEngine``: prompts, limits, JSON and SSE replies.

Both endpoints run one pipeline: prompts -> one engine request per prompt, each with ``n``
choices (``generation``) -> merged choice deltas -> one JSON body, or SSE chunks ending in
``data: [DONE]``, shaped per endpoint (``reply_shapes``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvroute.http import CLIENT_CLOSED_REQUEST, unless_client_leaves
from kvroute.openai_api.errors import APIError
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest, Prompt
from kvroute.protocol import GATEWAY_ID_HEADER, PROMPT_IDS_FIELD, is_gateway_id
from kvroute.text.bounds import refuse_surely_too_long
from kvroute.text.prompt_ids import PromptEncoder
from replica.engine.async_engine import AsyncEngine
from replica.engine.sampling_params import SamplingParams
from replica.server.generation import Generation, as_api_error
from replica.server.metrics import ReplicaMetrics
from replica.server.reply_shapes import ChatShape, CompletionShape, ReplyShape, WholeChoice

_DONE = "data: [DONE]\n\n"


# --- replies -----------------------------------------------------------------------------------


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse_events(shape: ReplyShape, generation: Generation) -> AsyncGenerator[str, None]:
    """The whole SSE stream; a failure becomes an error event, and ``[DONE]`` always ends it.
    Each choice opens (``opening_choice``) with its first output, not before the prefill."""
    opened: set[int] = set()
    try:
        async with aclosing(generation.deltas()) as deltas:
            async for index, delta in deltas:
                usage = generation.usage() if shape.continuous_usage else None
                if index not in opened:
                    opened.add(index)
                    if (opening := shape.opening_choice(index)) is not None:
                        yield _sse(shape.chunk([opening], usage))
                choice = shape.stream_choice(index, delta)
                if choice is not None:
                    yield _sse(shape.chunk([choice], usage))
        if shape.include_usage:  # sent with [DONE]: nothing comes between them
            yield _sse(shape.chunk([], usage=generation.usage())) + _DONE
            return
    except Exception as error:
        yield _sse(as_api_error(error).to_dict()) + _DONE
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


async def _collect(shape: ReplyShape, generation: Generation) -> Response:
    choices = [WholeChoice() for _ in range(generation.num_choices)]
    try:
        async with aclosing(generation.deltas()) as deltas:
            async for index, delta in deltas:
                choices[index].add(delta)
    except Exception as error:
        return as_api_error(error).to_response()
    return JSONResponse(shape.response(choices, generation.usage()))


# --- the handlers --------------------------------------------------------------------------------


PROMPT_CACHE_BYTES = 64 * 1024 * 1024
"""Token ids kept for repeated and multi-turn prompts: a chat's next turn tokenizes only its new
messages (docs/BENCHMARKS.md, the gateway's tokenizing table, measures the same cache)."""


def request_source(request: Request) -> str | None:
    """The gateway that sent the request (its ``x-kvroute-gateway`` header), if it is a valid id:
    the heartbeat reports each gateway's share of the load, so ids are short and plain."""
    source = request.headers.get(GATEWAY_ID_HEADER)
    return source if source is not None and is_gateway_id(source) else None


class OpenAIServing:
    """Turns validated requests into engine requests and OpenAI replies."""

    def __init__(
        self, engine: AsyncEngine, metrics: ReplicaMetrics, max_prompt_chars: int | None = None
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_prompt_chars = max_prompt_chars
        self.prompts = PromptEncoder(cache_bytes=PROMPT_CACHE_BYTES)

    async def chat(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self._refuse_surely_too_long(request)
        prompt = await self._chat_ids(request)
        shape = ChatShape(
            self.engine.tokenizer,
            request.model,
            request.include_usage,
            with_logprobs=request.logprobs,
            continuous_usage=request.continuous_usage,
        )
        spec = self._spec(shape, request, prompt, request.requested_max_tokens, request.num_logprobs)
        return await self._serve(shape, request.stream, [spec], raw)

    async def completions(self, request: CompletionRequest, raw: Request) -> Response:
        self._refuse_surely_too_long(request)
        shape = CompletionShape(
            self.engine.tokenizer,
            request.model,
            request.include_usage,
            with_logprobs=request.logprobs is not None,
            continuous_usage=request.continuous_usage,
        )
        if (given := self._gateway_ids(request)) is not None:  # one prompt (CompletionRequest.check)
            prompts = [given]
        else:
            prompts = [await self._prompt_ids(prompt) for prompt in request.prompt]
        specs = [self._spec(shape, request, ids, request.max_tokens, request.logprobs) for ids in prompts]
        return await self._serve(shape, request.stream, specs, raw)

    async def _serve(
        self, shape: ReplyShape, stream: bool, specs: list[tuple[list[int], SamplingParams]], raw: Request
    ) -> Response:
        generation = Generation(self.engine, self.metrics, shape.id, specs, request_source(raw))
        if stream:
            return _EventStream(_sse_events(shape, generation))
        response = await unless_client_leaves(raw.receive, _collect(shape, generation))
        return response or Response(status_code=CLIENT_CLOSED_REQUEST)

    def _refuse_surely_too_long(self, request: ChatCompletionRequest | CompletionRequest) -> None:
        engine = self.engine
        refuse_surely_too_long(request, engine.tokenizer, engine.max_model_len, self.max_prompt_chars)

    def _gateway_ids(self, request: ChatCompletionRequest | CompletionRequest) -> list[int] | None:
        """The prompt's ids as a gateway sent them (``PROMPT_IDS_FIELD``), checked, if it did."""
        given = request.kvroute_prompt_ids
        if given is not None:
            self._check_vocab(given, PROMPT_IDS_FIELD)
        return given

    async def _chat_ids(self, request: ChatCompletionRequest) -> list[int]:
        """The rendered chat's ids: those the gateway sent, else tokenized here."""
        if (given := self._gateway_ids(request)) is not None:
            return given
        messages, tools, template_kwargs = request.template_inputs()
        try:
            encoded = await self.prompts.encode_chat(self.engine.tokenizer, messages, tools, template_kwargs)
        except ValueError as error:
            raise APIError(f"Invalid 'messages': {error}", param="messages", code="invalid_value") from None
        return encoded.ids.tolist()

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
        shape: ReplyShape,
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
